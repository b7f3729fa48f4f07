"""Named allocation: the TensorAllocator for long-lived buffers, and the
DeviceMemoryStack for step temporaries.

Everything a step touches comes from one of these, sized before the first
step, which is what makes a whole step capturable into one CUDA graph. The
stack is sized exactly by running the step's allocation pattern against a
simulated stack first (the seed's allocate_run_state).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .device import Device
from .device import device as _get_device
from .dtypes import BYTE, FP32
from .dtypes import dtype as _dtype
from .tensor import STATS_SLOTS, Tensor, _normalize_shape

ALIGN = 256  # bytes; cuBLASLt and vectorised kernels want at least 16, TMA 128


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:>12.2f}"


@dataclass
class MemoryReport:
    """Bytes and buffer counts by allocator context and by buffer name.

    `str(report)` (and `print(report)`) is the per-context summary, a dozen lines whatever the
    model size; `report.table(per_buffer=True)` adds one line per named buffer (a 24-layer model
    has over a thousand), largest first.
    """

    by_context: dict[str, list[int]] = field(default_factory=dict)  # context -> [bytes, count]
    by_name: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # (context, name) -> [bytes, count]
    device_bytes: int = 0
    pinned_bytes: int = 0

    @property
    def total(self) -> int:
        return self.device_bytes + self.pinned_bytes

    def table(self, per_buffer: bool = False, top: int | None = None) -> str:
        """The summary by context; with `per_buffer`, then every (context, buffer) line, largest
        first, or only the `top` largest and one line for the rest."""
        lines = [f"{'context':<32}{'buffers':>9}{'MiB':>12}"]
        for ctx, (nbytes, count) in sorted(self.by_context.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"{ctx:<32}{count:>9}{_mib(nbytes)}")
        lines.append(f"{'total device':<32}{'':>9}{_mib(self.device_bytes)}")
        lines.append(f"{'total pinned host':<32}{'':>9}{_mib(self.pinned_bytes)}")
        if per_buffer:
            rows = sorted(self.by_name.items(), key=lambda kv: -kv[1][0])
            shown = rows if top is None else rows[:top]
            lines += ["", f"{'context':<24}{'buffer':<32}{'buffers':>9}{'MiB':>12}"]
            for (ctx, name), (nbytes, count) in shown:
                lines.append(f"{ctx:<24}{name:<32}{count:>9}{_mib(nbytes)}")
            rest = rows[len(shown) :]
            if rest:
                n, b = sum(c for _, (_, c) in rest), sum(nb for _, (nb, _) in rest)
                lines.append(f"{'':<24}{f'({len(rest)} smaller names)':<32}{n:>9}{_mib(b)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


OOM_TABLE_ROWS = 24  # buffer lines in an out-of-memory message (the largest; the rest in one line)


# The memory limit of the container this process runs in, cgroup v2 and v1 as a container sees
# them mounted: (limit file, usage file) under the cgroup root; v1 writes ~2**63 for "no limit".
_CGROUP_LIMITS = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def host_available_bytes(meminfo="/proc/meminfo", cgroup="/sys/fs/cgroup") -> int:
    """Host memory this process can still take: MemAvailable (free plus reclaimable cache, what
    the kernel can give before it kills), capped by the cgroup limit a container runs under.
    Falls back to free pages where /proc is absent."""
    avail = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in _CGROUP_LIMITS:
        with contextlib.suppress(OSError, ValueError):
            limit = (Path(cgroup) / limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 62:
                used = int((Path(cgroup) / usage_file).read_text())
                avail = min(avail, max(int(limit) - used, 0))
    return avail


def available_bytes(device, kind: str = "device") -> tuple[int, str]:
    """(bytes that can still be allocated, where that figure comes from) for `kind` "device" or
    "pinned" memory of `device`: free device memory on cuda (cudaMemGetInfo); host memory (see
    `host_available_bytes`) for pinned memory and for everything on cpu."""
    dev = _get_device(device)
    if dev.is_cuda and kind == "device":
        return int(dev.memory_info()[0]), f"free memory of {dev.name} (cudaMemGetInfo)"
    return host_available_bytes(), "available host memory (MemAvailable)"


class TensorAllocator:
    """Allocates named tensors and remembers what every byte is for.

    Args:
        device: where device tensors live ("cpu", "cuda", a Device).
        limit_bytes: optional cap on device bytes; passing it raises MemoryError as a real
            out-of-memory would, which is how budgets are tested.
    """

    def __init__(self, device="auto", limit_bytes: int | None = None):
        self.device: Device = _get_device(device)
        self.limit_bytes = limit_bytes
        self._contexts = ["Default"]
        self._records: list[tuple[str, str, str, int]] = []  # (context, name, kind, bytes)
        self._buffers: list = []  # keeps storage alive until free_all
        self._device_bytes = 0
        self._budgets: list[dict] = []  # open all_or_nothing blocks, innermost last

    @contextlib.contextmanager
    def context(self, name: str):
        """Label everything allocated inside the `with` block as belonging to `name`."""
        self._contexts.append(name)
        try:
            yield self
        finally:
            self._contexts.pop()

    @contextlib.contextmanager
    def all_or_nothing(self, what: str, check_fit: bool = True):
        """Allocate a plan inside the `with` block: if anything in it raises, every buffer
        allocated in the block is released again, so a failed plan leaves nothing half-allocated.

        With `check_fit`, the block also refuses a plan that cannot fit before memory runs out: the
        device bytes (and pinned host bytes) it allocates are compared with what `available_bytes`
        says at entry, and the allocation that would cross it raises MemoryError naming `what`,
        both figures and the table. This matters most on cpu, where NumPy memory is only taken when
        first written: without it an oversized plan is not refused but killed by the kernel later.
        """
        start = len(self._records)
        budget = {"what": what, "device": 0, "pinned": 0, "avail": {}}
        if check_fit:
            pools = ("device",) if self.device.is_cpu else ("device", "pinned")
            budget["avail"] = {k: available_bytes(self.device, k) for k in pools}
        self._budgets.append(budget)
        try:
            yield self
        except BaseException:
            self._release_from(start)
            raise
        finally:
            self._budgets.pop()

    def _release_from(self, start: int) -> None:
        for _, _, kind, nbytes in self._records[start:]:
            if kind == "device":
                self._device_bytes -= nbytes
            for b in self._budgets:
                b[kind] -= nbytes
        del self._records[start:]
        del self._buffers[start:]

    def _check_budgets(self, name: str, nbytes: int, kind: str) -> None:
        # On cpu, device and pinned buffers are both host memory: one pool, "device".
        pool = "device" if self.device.is_cpu else kind
        for b in self._budgets:
            if pool not in b["avail"]:
                continue
            planned = nbytes + (b["device"] + b["pinned"] if self.device.is_cpu else b[kind])
            avail, source = b["avail"][pool]
            if planned > avail:
                raise MemoryError(self._oom_message(
                    name, nbytes, f"{b['what']} does not fit: its buffers so far need {planned / 2**20:.2f} MiB, "
                    f"more than the {avail / 2**20:.2f} MiB of {source} when it started"))  # fmt: skip

    def allocate(self, dtype, name: str, shape, kind: str = "device", stats: bool | None = None) -> Tensor:
        """A new uninitialised tensor.

        Args:
            dtype: a DType or name ("bf16", "e4m3", ...).
            name: what reports and errors call it.
            shape: tuple of ints.
            kind: "device" or "pinned" (page-locked host memory, for async copies).
            stats: attach an FP8 stats slot; defaults to True for fp8 dtypes.
        Raises:
            MemoryError naming the request, with the allocator's table (context, buffer, MiB), when
            memory runs out; the tensor and its stats slot are then both left unallocated.
        """
        dt = _dtype(dtype)
        if kind not in ("device", "pinned"):
            raise ValueError(f"allocate {name!r}: kind must be 'device' or 'pinned', got {kind!r}")
        shape = _normalize_shape(shape)
        nbytes = math.prod(shape) * dt.itemsize
        with self.all_or_nothing(name, check_fit=False):  # the stats slot may fail after the values
            storage = self._raw(name, nbytes, kind)
            t = Tensor(dt, shape, self.device, storage, 0, name, kind)
            if stats if stats is not None else dt.is_fp8:
                raw = self._raw(f"{name}.stats", 4 * STATS_SLOTS, "device")
                t.stats = Tensor(FP32, (STATS_SLOTS,), self.device, raw, 0, f"{name}.stats").fill_zero()
        return t

    def staging(self, tensor: Tensor, name: str) -> Tensor:
        """A pinned host buffer of `tensor`'s dtype and shape, to fill on the host and copy to the
        device asynchronously (or back). On cpu, where device memory is host memory, it is
        `tensor` itself: no second buffer, and the copy between the two is a no-op."""
        if self.device.is_cpu:
            return tensor
        return self.allocate(tensor.dtype, name, tensor.shape, kind="pinned", stats=False)

    def _raw(self, name: str, nbytes: int, kind: str):
        nbytes = _align(max(nbytes, 1))
        if kind == "device" and self.limit_bytes is not None and self._device_bytes + nbytes > self.limit_bytes:
            raise MemoryError(self._oom_message(name, nbytes, f"over the limit of {self.limit_bytes} bytes"))
        self._check_budgets(name, nbytes, kind)
        try:
            storage = self.device.raw_buffer(nbytes, pinned=(kind == "pinned"))
        except MemoryError as err:
            raise MemoryError(self._oom_message(name, nbytes, str(err))) from None
        self._buffers.append(storage)
        self._records.append((self._contexts[-1], name, kind, nbytes))
        if kind == "device":
            self._device_bytes += nbytes
        for b in self._budgets:
            b[kind] += nbytes
        return storage

    def _oom_message(self, name, nbytes, why) -> str:
        return (
            f"out of memory allocating {name!r} ({nbytes / 2**20:.2f} MiB) in context "
            f"{self._contexts[-1]!r}: {why}\nallocated so far:\n"
            f"{self.report().table(per_buffer=True, top=OOM_TABLE_ROWS)}"
        )

    def report(self) -> MemoryReport:
        rep = MemoryReport()
        by_ctx: dict = defaultdict(lambda: [0, 0])
        by_name: dict = defaultdict(lambda: [0, 0])
        for ctx, name, kind, nbytes in self._records:
            label = ctx if kind == "device" else f"{ctx} (pinned)"
            by_ctx[label][0] += nbytes
            by_ctx[label][1] += 1
            by_name[(label, name)][0] += nbytes
            by_name[(label, name)][1] += 1
            if kind == "device":
                rep.device_bytes += nbytes
            else:
                rep.pinned_bytes += nbytes
        rep.by_context = dict(by_ctx)
        rep.by_name = dict(by_name)
        return rep

    def free_all(self) -> None:
        """Release every buffer. Tensors handed out before keep their storage alive
        only as long as they are referenced; the report starts again from zero."""
        self._release_from(0)


class DeviceMemoryStack:
    """A LIFO bump allocator over one buffer, for temporaries inside a step.

    Every allocation is 256-byte aligned. `free` must release the most recent live
    allocation. In simulation mode (`DeviceMemoryStack.simulate()`) there is no memory
    and the capacity is huge: running a step's allocations through it measures the
    exact size (`max_utilization()`) of the real stack to allocate.
    """

    def __init__(self, storage: Tensor | None, capacity: int | None = None, device=None, name: str = "stack"):
        self.name = name
        if storage is not None:
            self.device = storage.device
            self.capacity = storage.nbytes if capacity is None else int(capacity)
            if self.capacity > storage.nbytes:
                raise ValueError(f"stack {name!r}: capacity {self.capacity} exceeds its buffer of {storage.nbytes}")
            self._base = storage.view(BYTE).flat()
        else:
            self.device = _get_device(device or "cpu")
            self.capacity = int(capacity if capacity is not None else 1 << 50)
            self._base = None
        self._live: list[tuple[Tensor, int, int]] = []  # (tensor, start, end)
        self._top = 0
        self.high_water_mark = 0
        self.high_mark_contents: list[tuple[str, int]] = []  # what was live at the high-water mark

    @classmethod
    def simulate(cls, device=None) -> DeviceMemoryStack:
        """A stack with no memory and a huge capacity, for sizing by simulation."""
        return cls(None, device=device, name="simulated stack")

    @classmethod
    def sized_from(cls, simulation: DeviceMemoryStack, allocator: TensorAllocator,
                   name: str = "stack") -> DeviceMemoryStack:  # fmt: skip
        """A real stack, allocated from `allocator`, exactly as large as `simulation` needed."""
        size = simulation.max_utilization()
        buf = allocator.allocate(BYTE, name, (max(size, 1),))
        stack = cls(buf, size, name=name)
        stack.high_mark_contents = list(simulation.high_mark_contents)
        return stack

    @property
    def is_simulated(self) -> bool:
        return self._base is None

    def allocate(self, dtype, shape, name: str = "temp") -> Tensor:
        dt = _dtype(dtype)
        shape = _normalize_shape(shape)
        nbytes = math.prod(shape) * dt.itemsize
        start = self._top
        end = start + _align(max(nbytes, 1))
        if end > self.capacity:
            live = ", ".join(f"{t.name} ({e - s} B)" for t, s, e in self._live) or "nothing"
            raise MemoryError(
                f"stack {self.name!r}: allocating {name!r} ({nbytes} bytes) needs {end} bytes but the capacity is "
                f"{self.capacity}; live: {live}. Size the stack by simulating the step first."
            )
        if self._base is None:
            t = Tensor(dt, shape, self.device, None, 0, name)
        else:
            t = Tensor(dt, shape, self.device, self._base.storage, self._base.offset + start, name)
        self._live.append((t, start, end))
        self._top = end
        if end > self.high_water_mark:
            self.high_water_mark = end
            self.high_mark_contents = [(lt.name, e - s) for lt, s, e in self._live]
        return t

    def free(self, tensor: Tensor) -> None:
        """Release `tensor`, which must be the most recent live allocation."""
        if not self._live:
            raise ValueError(f"stack {self.name!r}: free({tensor.name!r}) but nothing is allocated")
        top, start, _ = self._live[-1]
        if top is not tensor:
            raise ValueError(
                f"stack {self.name!r}: free({tensor.name!r}) out of order; the most recent allocation is "
                f"{top.name!r}, which must be freed first"
            )
        self._live.pop()
        self._top = start

    @contextlib.contextmanager
    def temporary(self, dtype, shape, name: str = "temp"):
        """`with stack.temporary(dtype, shape, name) as t:` allocates and frees around a block."""
        t = self.allocate(dtype, shape, name)
        try:
            yield t
        finally:
            self.free(t)

    def max_utilization(self) -> int:
        """The most bytes ever live at once: the size a real stack needs."""
        return self.high_water_mark

    @property
    def used(self) -> int:
        return self._top
