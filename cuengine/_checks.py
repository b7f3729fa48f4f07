"""Boundary checks shared by every launcher: clear ValueErrors naming the tensor."""

from __future__ import annotations

from .dtypes import dtype as _dtype
from .tensor import Tensor


def expect(t, what: str, dtype=None, shape=None, device=None, simulated_ok: bool = False) -> Tensor:
    """Check that `t` is a Tensor with the given dtype(s), shape and device.

    `dtype` may be one type or a tuple of allowed types; `shape` may contain None
    for "any size here". Raises ValueError naming `what`, the tensor and both
    the expected and the seen dtype and shape. A tensor of a simulated stack (layout,
    no memory) is refused unless `simulated_ok`: code that sizes a stack by running
    itself checks its layouts the same way and launches nothing.
    """
    if not isinstance(t, Tensor):
        raise ValueError(f"{what}: expected a cuengine Tensor, got {type(t).__name__}")
    if t.storage is None and not simulated_ok:
        raise ValueError(f"{what}: tensor {t.name!r} has no memory (simulated stack)")
    if dtype is not None:
        allowed = tuple(_dtype(d) for d in (dtype if isinstance(dtype, (tuple, list)) else (dtype,)))
        if t.dtype not in allowed:
            names = "/".join(d.name for d in allowed)
            raise ValueError(f"{what}: expected dtype {names}, got tensor {t.name!r} {t.dtype} {t.shape}")
    if shape is not None:
        shape = tuple(shape)
        if len(shape) != t.ndim or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{what}: expected shape {want}, got tensor {t.name!r} {t.shape} {t.dtype}")
    if device is not None and t.device is not device:
        raise ValueError(f"{what}: tensor {t.name!r} is on {t.device}, expected {device}")
    return t


def same_device(*tensors) -> object:
    """The device shared by all non-None tensors; ValueError if they differ."""
    devs = [t.device for t in tensors if t is not None]
    for t in tensors:
        if t is not None and t.device is not devs[0]:
            raise ValueError(f"tensor {t.name!r} is on {t.device}, but {tensors[0].name!r} is on {devs[0]}")
        if t is not None and t.kind != "device" and devs[0].is_cuda:
            raise ValueError(f"tensor {t.name!r} is in host memory; kernels need device tensors")
    return devs[0]


VECTOR_BYTES = 16  # the kernels' vector loads and stores, and cuBLASLt's row alignment


def overlaps(a, b) -> bool:
    """True when tensors a and b (None allowed: never) share a byte of the same storage."""
    if a is None or b is None or a.storage is not b.storage:
        return False
    return a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def is_aligned(*tensors, nbytes: int = VECTOR_BYTES) -> bool:
    """True when every tensor given (None skipped) starts at a multiple of `nbytes`; launchers
    with a `_scalar` kernel variant pick the vectorised one on it."""
    return all(t is None or t.ptr % nbytes == 0 for t in tensors)


def check_aligned(what: str, *tensors, nbytes: int = VECTOR_BYTES) -> None:
    """ValueError naming the first device tensor (None and cpu ones skipped: the NumPy twins have
    no alignment rule) whose address is not a multiple of `nbytes`, for kernels without a scalar variant."""
    for t in tensors:
        if t is not None and t.device.is_cuda and t.ptr % nbytes:
            raise ValueError(
                f"{what}: tensor {t.name!r} {t.dtype} {t.shape} at device address {t.ptr:#x} is not {nbytes}-byte "
                "aligned (a view that starts inside a 16-byte vector)"
            )


def check_vector_width(what: str, label: str, size: int, dtype, vectors: int = 1) -> None:
    """ValueError unless `size` (a row length) is a multiple of `vectors` 16-byte vectors of `dtype`."""
    n = vectors * (VECTOR_BYTES // _dtype(dtype).itemsize)
    if size % n:
        raise ValueError(f"{what}: {label} = {size} must be a multiple of {n} for 16-byte {_dtype(dtype)} vectors")
