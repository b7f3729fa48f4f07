"""Devices: "cuda" runs on CuPy, "cpu" runs the NumPy twins.

Both expose the same streams, events, copies and graph capture, so engine code
is written once. On "cpu" every operation is immediate: streams and events are
placeholders, and a captured graph replays its Python function eagerly.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred through unified addressing


def cuda_device_count() -> int:
    """How many CUDA devices CuPy sees; 0 when it does not import or finds no driver."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return cuda_device_count() > 0


class Event:
    """A point in a stream's work. On cpu it is always complete."""

    def __init__(self, device: Device, timing: bool = False):
        self.device = device
        self.raw = None
        if device.is_cuda:
            import cupy

            self.raw = cupy.cuda.Event(disable_timing=not timing)

    def record(self, stream: Stream | None = None) -> Event:
        if self.raw is not None:
            self.raw.record(self.device._stream(stream).raw)
        return self

    def synchronize(self) -> None:
        if self.raw is not None:
            self.raw.synchronize()

    def done(self) -> bool:
        return True if self.raw is None else self.raw.done

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end`; both must have been recorded with timing."""
        if self.raw is None:
            raise ValueError("event timing needs the cuda device")
        import cupy

        return cupy.cuda.get_elapsed_time(self.raw, end.raw)


STREAM_PRIORITIES = ("normal", "high")


class Stream:
    """An ordered queue of device work. `ptr` is the cudaStream_t handle (0 on cpu).

    priority "high" is the device's greatest stream priority: when an SM frees up, the block
    scheduler takes its kernels' blocks before those of normal streams. The collectives run on
    such a stream, so that a wide kernel of the main stream (an optimizer launch of thousands of
    blocks) does not hold them back until its last wave; graphs keep the priority of each node's
    capturing stream (`Device.capture`)."""

    def __init__(self, device: Device, priority: str = "normal"):
        if priority not in STREAM_PRIORITIES:
            raise ValueError(f"Stream: priority must be one of {STREAM_PRIORITIES}, got {priority!r}")
        self.device, self.priority = device, priority
        self.raw = None
        if device.is_cuda:
            import cupy

            with cupy.cuda.Device(device.index):
                level = _greatest_stream_priority() if priority == "high" else None
                self.raw = cupy.cuda.Stream(non_blocking=True, priority=level)

    @property
    def ptr(self) -> int:
        return 0 if self.raw is None else self.raw.ptr

    def synchronize(self) -> None:
        if self.raw is not None:
            self.raw.synchronize()

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for `event` (no host sync)."""
        if self.raw is not None:
            self.raw.wait_event(event.raw)

    def record(self, event: Event | None = None) -> Event:
        event = event or Event(self.device)
        return event.record(self)


class Graph:
    """A captured sequence of device work, launched as one unit.

    On cuda it holds a CUDA graph; on cpu it holds the captured function and
    launching it calls the function again, so both devices compute the same thing.
    """

    def __init__(self, device: Device, raw=None, fn: Callable[[], None] | None = None):
        self.device = device
        self.raw = raw
        self.fn = fn
        self._exec = _instantiate_with_node_priority(raw.graph) if raw is not None else None

    def launch(self, stream: Stream | None = None) -> None:
        if self._exec is not None:
            import cupy

            cupy.cuda.runtime.graphLaunch(self._exec, self.device._stream(stream).ptr)
        elif self.fn is not None:
            self.fn()

    def __del__(self):
        if getattr(self, "_exec", None):
            try:
                from cuda.bindings import driver

                driver.cuGraphExecDestroy(driver.CUgraphExec(self._exec))
            except Exception:  # interpreter shutdown: the context goes with the process
                pass


def _instantiate_with_node_priority(graph: int) -> int:
    """The cudaGraphExec_t of `graph` (a cudaGraph_t), instantiated with `graph_instantiate_flags()`."""
    from cuda.bindings import driver

    err, exec_ = driver.cuGraphInstantiate(driver.CUgraph(graph), graph_instantiate_flags())
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuGraphInstantiate: {err.name}")
    return int(exec_)


def graph_instantiate_flags() -> int:
    """CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY: each kernel node runs at the priority of the
    stream that captured it, not at that of the stream the graph is launched into, so the
    collectives of a captured step keep their stream's high priority.
    CUENGINE_GRAPH_NODE_PRIORITY=0 instantiates without it (every node at the launch stream's
    priority), to measure what the priority does, as CUENGINE_DEPENDENT_LAUNCH=0 does for
    programmatic dependent launch."""
    from cuda.bindings import driver

    if os.environ.get("CUENGINE_GRAPH_NODE_PRIORITY", "1") == "0":
        return 0
    return int(driver.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)


@functools.cache
def _greatest_stream_priority() -> int:
    """The numerically lowest (most urgent) stream priority of the current context."""
    from cuda.bindings import driver

    err, _, greatest = driver.cuCtxGetStreamPriorityRange()
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuCtxGetStreamPriorityRange: {err.name}")
    return int(greatest)


class Device:
    """A compute device. Use `cuengine.device(name)` rather than constructing one."""

    def __init__(self, kind: str, index: int = 0):
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"device kind must be 'cuda' or 'cpu', got {kind!r}")
        self.kind = kind
        self.index = index
        if kind == "cuda":
            import cupy

            self.xp = cupy
            with cupy.cuda.Device(index):
                props = cupy.cuda.runtime.getDeviceProperties(index)
            self.name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            self.compute_capability = (props["major"], props["minor"])
            self.num_sms = props["multiProcessorCount"]
        else:
            self.xp = np
            self.name = "cpu (NumPy)"
            self.compute_capability = None
            self.num_sms = 1
        self.stream = Stream(self)  # the main stream; launchers default to it

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def __repr__(self) -> str:
        return f"Device({self.kind!r}, {self.index})" if self.is_cuda else "Device('cpu')"

    def _stream(self, stream: Stream | None) -> Stream:
        return self.stream if stream is None else stream

    def activate(self):
        """Context manager making this the current CUDA device (no-op on cpu)."""
        if self.is_cuda:
            return self.xp.cuda.Device(self.index)
        import contextlib

        return contextlib.nullcontext()

    def new_stream(self, priority: str = "normal") -> Stream:
        return Stream(self, priority)

    def event(self, timing: bool = False) -> Event:
        return Event(self, timing=timing)

    def synchronize(self) -> None:
        if self.is_cuda:
            with self.activate():
                self.xp.cuda.runtime.deviceSynchronize()

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory; on cpu, of host memory."""
        if self.is_cuda:
            with self.activate():
                return self.xp.cuda.runtime.memGetInfo()
        import os

        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return avail, pages

    # ---- raw buffers -------------------------------------------------------------------------
    def raw_buffer(self, nbytes: int, pinned: bool = False):
        """An uninitialised byte buffer: a CuPy array on cuda, a NumPy array in pinned memory
        for `pinned=True`, else a NumPy array. Raises MemoryError when it cannot be had."""
        nbytes = max(int(nbytes), 1)
        if self.is_cpu:
            return np.empty(nbytes, np.uint8)
        cupy = self.xp
        try:
            with self.activate():
                if pinned:
                    mem = cupy.cuda.alloc_pinned_memory(nbytes)
                    return np.frombuffer(mem, np.uint8, nbytes)
                # Bypass CuPy's pool: the engine's allocator owns lifetimes and names.
                mem = cupy.cuda.memory.MemoryPointer(cupy.cuda.memory.Memory(nbytes), 0)
                return cupy.ndarray((nbytes,), cupy.uint8, mem)
        except (cupy.cuda.memory.OutOfMemoryError, cupy.cuda.runtime.CUDARuntimeError) as err:
            raise MemoryError(str(err)) from None

    # ---- copies and fills --------------------------------------------------------------------
    def copy_async(self, dst, src, stream: Stream | None = None) -> None:
        """Copy `src` into `dst` (Tensors of equal size) in stream order.

        Host tensors must be pinned: an async copy from pageable memory would make the
        host wait, and cannot be captured into a graph.
        """
        _check_copy(dst, src)
        for t in (dst, src):
            if self.is_cuda and t.kind == "host":
                raise ValueError(
                    f"copy_async: tensor {t.name!r} is in pageable host memory; allocate it with kind='pinned'"
                )
        self._copy(dst, src, stream)

    def copy(self, dst, src, stream: Stream | None = None) -> None:
        """Copy `src` into `dst` and wait for it: the host may use either afterwards."""
        _check_copy(dst, src)
        self._copy(dst, src, stream)
        self._stream(stream).synchronize()

    def _copy(self, dst, src, stream):
        if self.is_cpu or (dst.kind != "device" and src.kind != "device"):
            np.copyto(dst._host_bytes(), src._host_bytes())
            return
        with self.activate():
            self.xp.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, src.nbytes, _MEMCPY_DEFAULT, self._stream(stream).ptr)

    def fill_zero(self, tensor, stream: Stream | None = None) -> None:
        """Set every byte of `tensor` to zero in stream order (capturable)."""
        if self.is_cpu or tensor.kind != "device":
            tensor._host_bytes()[...] = 0
            return
        with self.activate():
            self.xp.cuda.runtime.memsetAsync(tensor.ptr, 0, tensor.nbytes, self._stream(stream).ptr)

    # ---- graphs ------------------------------------------------------------------------------
    def capture(self, fn: Callable[[], None], stream: Stream | None = None) -> Graph:
        """Record `fn`'s work into a graph without running it; `graph.launch()` runs it.

        This is the form to prefer: it behaves the same on both devices.
        """
        if self.is_cpu:
            return Graph(self, fn=fn)
        s = self._stream(stream)
        s.raw.begin_capture()
        try:
            fn()
        finally:
            raw = s.raw.end_capture()
        return Graph(self, raw=raw)


def _check_copy(dst, src):
    if dst.nbytes != src.nbytes:
        raise ValueError(
            f"copy: {dst.name!r} holds {dst.nbytes} bytes {dst.shape} {dst.dtype} but "
            f"{src.name!r} holds {src.nbytes} bytes {src.shape} {src.dtype}"
        )


@functools.cache
def _make_device(kind: str, index: int) -> Device:
    return Device(kind, index)


def device(name: str | Device = "auto") -> Device:
    """Return the device named "cuda", "cuda:N", "cpu" or "auto" (cuda when a GPU is there).

    Devices are cached: the same name gives the same object and the same main stream.
    """
    if isinstance(name, Device):
        return name
    if not isinstance(name, str):
        raise ValueError(f"device name must be a string, got {name!r}")
    kind, _, idx = name.partition(":")
    if kind == "auto":
        kind = "cuda" if cuda_available() else "cpu"
    if kind == "cpu":
        return _make_device("cpu", 0)
    if kind != "cuda":
        raise ValueError(f"unknown device {name!r}; use 'cuda', 'cuda:N', 'cpu' or 'auto'")
    if not cuda_available():
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "device 'cuda' asked for, but CuPy is not installed (pip install 'cuengine[cuda]'); use 'cpu' or 'auto'"
            ) from None
        raise RuntimeError("device 'cuda' asked for, but CuPy finds no CUDA device; use 'cpu' or 'auto'")
    return _make_device("cuda", int(idx or 0))
