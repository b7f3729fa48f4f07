"""Tensor: a typed, shaped window onto a byte buffer that the engine owns.

A Tensor never owns its layout beyond (dtype, shape, byte offset): every view,
reshape or row slice is a new Tensor over the same storage, so aliasing is
explicit and free. FP8 tensors carry their abs-max and scales in a small float32
"stats" slot that travels with every view, as in the seeds.
"""

from __future__ import annotations

import math

import numpy as np

from .device import Device
from .device import device as _get_device
from .dtypes import FP32, DType
from .dtypes import dtype as _dtype

# The stats slot is 12 floats: abs_max at 0, scale = fp8_max/abs_max at 4, scale_inv = abs_max/fp8_max
# at 8. Each field sits in its own 16-byte lane because cuBLASLt answers CUBLAS_STATUS_NOT_SUPPORTED
# for A/B scale pointers that are not 16-byte aligned (seen on the H200, cuBLASLt 13.1).
STATS_SLOTS = 12
STAT_ABS_MAX, STAT_SCALE, STAT_SCALE_INV = 0, 4, 8

_BITS_VIEW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _normalize_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = tuple(shape)
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in shape):
        raise ValueError(f"shape {shape}: every dimension must be an int")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    return shape


class Tensor:
    """A typed view of engine memory.

    Attributes:
        dtype: the element type (DType).
        shape: a tuple of ints; tensors are always C-contiguous.
        device: the Device that owns the memory.
        storage: the byte buffer (CuPy on cuda, NumPy on cpu and for pinned host memory),
            or None for a tensor from a simulated stack, which has a layout but no memory.
        offset: byte offset of element 0 within storage.
        name: what error messages and memory reports call it.
        kind: "device", "pinned" (page-locked host) or "host".
        stats: None, or a float32 Tensor of STATS_SLOTS floats holding abs_max, scale and
            scale_inv at STAT_ABS_MAX, STAT_SCALE and STAT_SCALE_INV.
    """

    __slots__ = ("dtype", "shape", "device", "storage", "offset", "name", "kind", "stats")

    def __init__(self, dtype, shape, device: Device, storage, offset: int = 0, name: str = "tensor",
                 kind: str = "device", stats: Tensor | None = None):  # fmt: skip
        self.dtype = _dtype(dtype)
        self.shape = _normalize_shape(shape)
        self.device = device
        self.storage = storage
        self.offset = int(offset)
        self.name = name
        self.kind = kind if device.is_cuda else "host"
        self.stats = stats
        if storage is not None and self.offset + self.nbytes > storage.nbytes:
            raise ValueError(
                f"tensor {name!r}: view of {self.nbytes} bytes at offset {self.offset} runs past the end "
                f"of its {storage.nbytes}-byte storage"
            )

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def nelem(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.nelem * self.dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_simulated(self) -> bool:
        return self.storage is None

    def __repr__(self) -> str:
        where = "simulated" if self.storage is None else self.kind
        return f"Tensor({self.name!r}, {self.dtype}, {self.shape}, {self.device.kind}, {where})"

    def _require_storage(self):
        if self.storage is None:
            raise ValueError(f"tensor {self.name!r} has no memory: it comes from a simulated stack")
        return self.storage

    @property
    def ptr(self) -> int:
        """The address of element 0 (device address, or host address for host tensors)."""
        storage = self._require_storage()
        if isinstance(storage, np.ndarray):
            return storage.ctypes.data + self.offset
        return storage.data.ptr + self.offset

    # ---- array views -------------------------------------------------------------------------
    def _bytes(self):
        storage = self._require_storage()
        return storage[self.offset : self.offset + self.nbytes]

    def _host_bytes(self) -> np.ndarray:
        if self.kind == "device":
            raise ValueError(f"tensor {self.name!r} is in device memory, not host memory")
        return self._bytes()

    def array(self):
        """A zero-copy typed array: NumPy for host memory, CuPy for device memory.

        Where CuPy lacks the type (older CuPy has no bf16; fp8 may be missing) the CuPy
        view holds the raw bits (uint16 or uint8). Writing to the array writes the tensor.
        """
        raw = self._bytes()
        if isinstance(raw, np.ndarray):
            return raw.view(self.dtype.np).reshape(self.shape)
        if self.dtype.is_fp8:  # CuPy 14 makes fp8 views but cannot compute on them (seen on the H200)
            return raw.view(np.uint8).reshape(self.shape)
        try:
            return raw.view(self.dtype.np).reshape(self.shape)
        except (TypeError, ValueError):
            return raw.view(_BITS_VIEW[self.dtype.itemsize]).reshape(self.shape)

    def cupy(self):
        """A zero-copy CuPy view of a device tensor (raw bits where CuPy lacks the type)."""
        if self.kind != "device":
            raise ValueError(f"tensor {self.name!r} is in host memory; cupy() needs a cuda device tensor")
        return self.array()

    def numpy(self) -> np.ndarray:
        """A host copy with the tensor's NumPy dtype (ml_dtypes for bf16 and fp8).

        For a device tensor this waits for the device's main stream first.
        """
        raw = self._bytes()
        if isinstance(raw, np.ndarray):
            out = raw.copy()
        else:
            out = np.empty(self.nbytes, np.uint8)
            dev = self.device
            with dev.activate():
                dev.stream.synchronize()
                dev.xp.cuda.runtime.memcpy(out.ctypes.data, self.ptr, self.nbytes, 4)
        return out.view(self.dtype.np).reshape(self.shape)

    def copy_from_numpy(self, array, stream=None) -> Tensor:
        """Write a host array into this tensor and wait for the copy. Shape must match;
        the values are converted to the tensor's dtype (ml_dtypes rounding)."""
        array = np.asarray(array)
        if tuple(array.shape) != self.shape:
            raise ValueError(f"tensor {self.name!r}: expected shape {self.shape}, got {tuple(array.shape)}")
        src = np.ascontiguousarray(array.astype(self.dtype.np, copy=False))
        raw = self._bytes()
        if isinstance(raw, np.ndarray):
            raw[...] = src.reshape(-1).view(np.uint8)
        else:
            dev = self.device
            with dev.activate():
                dev.xp.cuda.runtime.memcpyAsync(self.ptr, src.ctypes.data, self.nbytes, 4, dev._stream(stream).ptr)
                dev._stream(stream).synchronize()
        return self

    @classmethod
    def from_numpy(cls, array, device="cpu", name: str = "tensor", dtype=None, kind: str = "device") -> Tensor:
        """A new standalone tensor holding a copy of `array` (converted to `dtype` if given).

        Outside a step this is fine; inside one, take memory from a TensorAllocator instead.

        FP8 follows the engine's per-tensor current scaling, so that every consumer (matmul reads
        `scale_inv`) sees the values of `array`:
        - `array` of another dtype is quantized: stored = clamp(array * scale, ±fp8_max) rounded
          to nearest even, with abs_max = max|array|, scale = fp8_max / abs_max, scale_inv = 1 / scale
          (what `kernels.fp8.quantize_with_abs_max` writes). `t.numpy()` is then the stored, scaled
          values; `t.numpy() * t.fp8_stats()[2]` gives back `array` to FP8 precision.
        - `array` already of the FP8 dtype holds stored values: they are kept bit for bit with unit
          scales (abs_max = max|array|); `set_fp8_stats` may then give them another scale.
        """
        array = np.asarray(array)
        dt = _dtype(dtype if dtype is not None else array.dtype)
        dev = _get_device(device)
        t = cls.empty(dt, array.shape, dev, name=name, kind=kind)
        if not dt.is_fp8:
            return t.copy_from_numpy(array)
        values = array.astype(np.float32)
        amax = float(np.max(np.abs(values))) if array.size else 0.0
        if array.dtype == dt.np:
            t.copy_from_numpy(array)
            return t.set_fp8_stats(amax, 1.0, 1.0)
        stats = stats_values(amax, dt)
        with np.errstate(invalid="ignore", over="ignore"):
            t.copy_from_numpy(np.clip(values * np.float32(stats[1]), -dt.fp8_max, dt.fp8_max))
        return t.set_fp8_stats(*stats)

    @classmethod
    def empty(cls, dtype, shape, device="cpu", name: str = "tensor", kind: str = "device") -> Tensor:
        """A new standalone uninitialised tensor (FP8 types get a zeroed stats slot)."""
        dt = _dtype(dtype)
        dev = _get_device(device)
        shape = _normalize_shape(shape)
        storage = dev.raw_buffer(math.prod(shape) * dt.itemsize, pinned=(kind == "pinned"))
        stats = None
        if dt.is_fp8:
            stats = cls(FP32, (STATS_SLOTS,), dev, dev.raw_buffer(4 * STATS_SLOTS), name=f"{name}.stats")
            dev.fill_zero(stats)
        return cls(dt, shape, dev, storage, 0, name, kind, stats)

    # ---- views -------------------------------------------------------------------------------
    def _derive(self, dtype, shape, offset, name=None) -> Tensor:
        return Tensor(dtype, shape, self.device, self.storage, offset, name or self.name, self.kind, self.stats)

    def reshape(self, *shape) -> Tensor:
        """Same memory, new shape; one dimension may be -1."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if shape.count(-1) > 1:
            raise ValueError(f"tensor {self.name!r}: reshape to {shape} has more than one -1")
        if -1 in shape:
            rest = math.prod(s for s in shape if s != -1)
            if rest == 0 or self.nelem % rest:
                raise ValueError(f"tensor {self.name!r}: cannot reshape {self.shape} to {shape}")
            shape = tuple(self.nelem // rest if s == -1 else s for s in shape)
        if math.prod(shape) != self.nelem:
            raise ValueError(f"tensor {self.name!r}: cannot reshape {self.shape} ({self.nelem} elements) to {shape}")
        return self._derive(self.dtype, shape, self.offset)

    def view(self, dtype) -> Tensor:
        """Reinterpret the bytes as another dtype; the last dimension is rescaled."""
        dt = _dtype(dtype)
        if not self.shape:
            raise ValueError(f"tensor {self.name!r}: cannot view a 0-d tensor as {dt}")
        last = self.shape[-1] * self.dtype.itemsize
        if last % dt.itemsize:
            raise ValueError(
                f"tensor {self.name!r}: last dimension of {last} bytes is not a multiple of {dt} ({dt.itemsize} bytes)"
            )
        return self._derive(dt, self.shape[:-1] + (last // dt.itemsize,), self.offset)

    def rows(self, start: int, stop: int) -> Tensor:
        """Zero-copy slice [start, stop) along the first dimension."""
        if not self.shape:
            raise ValueError(f"tensor {self.name!r}: cannot slice a 0-d tensor")
        n = self.shape[0]
        if not (0 <= start <= stop <= n):
            raise ValueError(f"tensor {self.name!r}: rows [{start}, {stop}) out of range for first dimension {n}")
        row_bytes = self.nbytes // n if n else 0
        return self._derive(self.dtype, (stop - start,) + self.shape[1:], self.offset + start * row_bytes)

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            n = self.shape[0] if self.shape else 0
            i = int(index) + n if index < 0 else int(index)
            if not 0 <= i < n:
                raise IndexError(f"tensor {self.name!r}: index {index} out of range for first dimension {n}")
            return self.rows(i, i + 1).reshape(self.shape[1:])
        if isinstance(index, slice):
            start, stop, step = index.indices(self.shape[0])
            if step != 1:
                raise ValueError(f"tensor {self.name!r}: only unit-step row slices are views")
            return self.rows(start, max(start, stop))
        raise TypeError(f"tensor {self.name!r}: index with an int or a slice over the first dimension")

    def shard_view(self, i: int, n: int) -> Tensor:
        """Shard i of n equal parts along the first dimension (the seed's shard_view)."""
        rows = self.shape[0] if self.shape else 0
        if n <= 0 or rows % n:
            raise ValueError(f"tensor {self.name!r}: first dimension {rows} does not split into {n} shards")
        if not 0 <= i < n:
            raise ValueError(f"tensor {self.name!r}: shard {i} out of range for {n} shards")
        size = rows // n
        return self.rows(i * size, (i + 1) * size)

    def flat(self) -> Tensor:
        return self.reshape(self.nelem)

    # ---- FP8 stats ---------------------------------------------------------------------------
    def _stat(self, slot: int) -> Tensor:
        if self.stats is None:
            raise ValueError(
                f"tensor {self.name!r} ({self.dtype}) carries no FP8 stats; allocate it as fp8 or attach a stats slot"
            )
        return self.stats.rows(slot, slot + 1)

    def fp8_stats(self) -> np.ndarray:
        """A host copy of [abs_max, scale, scale_inv] (waits for the device)."""
        self._stat(0)
        return self.stats.numpy()[[STAT_ABS_MAX, STAT_SCALE, STAT_SCALE_INV]]

    def set_fp8_stats(self, abs_max: float, scale: float, scale_inv: float) -> Tensor:
        """Write the three stats fields (a synchronous copy: not for use inside a step)."""
        self._stat(0)
        values = np.zeros(STATS_SLOTS, np.float32)
        values[[STAT_ABS_MAX, STAT_SCALE, STAT_SCALE_INV]] = abs_max, scale, scale_inv
        self.stats.copy_from_numpy(values)
        return self

    @property
    def abs_max(self) -> Tensor:
        """The float32 slot holding max(|x|), as a 1-element device tensor."""
        return self._stat(STAT_ABS_MAX)

    @property
    def scale(self) -> Tensor:
        """The float32 slot holding the quantisation scale, fp8_max / abs_max."""
        return self._stat(STAT_SCALE)

    @property
    def scale_inv(self) -> Tensor:
        """The float32 slot holding abs_max / fp8_max, the dequantisation factor cuBLASLt reads."""
        return self._stat(STAT_SCALE_INV)

    def with_stats(self, stats: Tensor) -> Tensor:
        """This view with `stats` (fp32, STATS_SLOTS floats, 16-byte aligned) attached."""
        if stats.dtype != FP32 or stats.nelem != STATS_SLOTS:
            raise ValueError(
                f"tensor {self.name!r}: stats must be fp32 with {STATS_SLOTS} slots, got {stats.dtype} {stats.shape}"
            )
        if stats.storage is not None and stats.ptr % 16:
            raise ValueError(f"tensor {self.name!r}: stats slot {stats.name!r} is not 16-byte aligned")
        t = self._derive(self.dtype, self.shape, self.offset)
        t.stats = stats.reshape(STATS_SLOTS)
        return t

    # ---- misc --------------------------------------------------------------------------------
    def fill_zero(self, stream=None) -> Tensor:
        self._require_storage()
        self.device.fill_zero(self, stream)
        return self

    def __dlpack__(self, *args, **kwargs):
        return self.array().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self.array().__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.kind != "device":
            raise AttributeError(f"tensor {self.name!r} is not in device memory")
        typestr = self.dtype.np.str if self.dtype.np.kind in "fiu" else np.dtype(_BITS_VIEW[self.dtype.itemsize]).str
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False), "version": 3, "strides": None}


def stats_values(abs_max: float, dt: DType) -> tuple[float, float, float]:
    """The stats slots [abs_max, scale, scale_inv] for an FP8 dtype; an all-zero tensor
    gets unit scales so that nothing divides by zero (the kernels do the same)."""
    if abs_max > 0 and math.isfinite(abs_max):
        scale = np.float32(dt.fp8_max) / np.float32(abs_max)
        return abs_max, float(scale), float(np.float32(1.0) / scale)
    return abs_max, 1.0, 1.0
