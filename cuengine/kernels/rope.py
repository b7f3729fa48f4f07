"""Rotary position embedding on packed qkv, HF rotate-half form (raw_kernels/rope.cu).

qkv is (B, T, Hq + 2*Hkv, hs), or the same with the heads flattened into the last dimension: the
query heads, then the key heads, then the value heads. Query and key heads are rotated by the angle
t * inv_freq of their position t; value heads pass through. The table is built once on the host in
float64 and stored in fp16 (bf16 models, as the seed does) or fp32.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_aligned, check_vector_width, expect, overlaps, same_device
from ..dtypes import BF16, FP16, FP32
from ._build import ceil_div, grid_size, kernel_name, launch, write_twin_results

FAMILY = "rope"
FLOATS = (FP32, BF16, FP16)
TABLE_DTYPES = (FP32, FP16)
# rope.cu's ROPE_HEADS, ROPE_THREADS and ROPE_BLOCKS_PER_SM: heads per thread; a grid of one wave of
# resident blocks, each thread looping over its items (a second, partial wave would leave SMs idle)
_HEADS, _THREADS, _BLOCKS_PER_SM = 2, 128, 7


def rope_freqs(max_pos: int, head_size: int, theta: float, dtype=np.float32, scaling: dict | None = None) -> np.ndarray:
    """The RoPE table: (max_pos, head_size) with cos in [:hs/2] and sin in [hs/2:].

    inv_freq[i] = theta ** (-2i / hs) and angle[t, i] = t * inv_freq[i], computed in float64, then
    cast to `dtype` (float32, or float16 for bf16 models). `scaling` (a config's rope_scaling) of
    rope_type "llama3" rescales inv_freq as transformers' `_compute_llama3_parameters` does: the
    frequencies whose wavelength exceeds the original context / low_freq_factor are divided by
    `factor`, those shorter than original / high_freq_factor are kept, and those between are
    interpolated. NumPy only: upload it once with Tensor.from_numpy.
    """
    if head_size <= 0 or head_size % 2:
        raise ValueError(f"rope_freqs: head_size = {head_size} must be positive and even")
    if max_pos < 0:
        raise ValueError(f"rope_freqs: max_pos = {max_pos} must be non-negative")
    half = head_size // 2
    inv_freq = float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / head_size)
    if scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    angle = np.arange(max_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angle), np.sin(angle)], axis=1).astype(dtype)


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind != "llama3":
        raise ValueError(f"rope_freqs: scaling of rope_type {kind!r} is not implemented; only 'llama3' is")
    factor, lo, hi = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled)


# ---- NumPy twin ---------------------------------------------------------------------------
def rope_np(qkv: np.ndarray, freqs: np.ndarray, n_q_heads: int, n_kv_heads: int, inverse: bool = False):
    """Rotate the q and k heads of qkv (B, T, ...) by their positions; v heads unchanged.

    inverse=False is the forward (out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin); inverse=True the
    backward (rotation by -angle). fp32 math, rounded to qkv's dtype. Returns a new array.
    """
    B, T = qkv.shape[:2]
    hs = freqs.shape[1]
    half = hs // 2
    x = qkv.reshape(B, T, -1, hs).astype(np.float32)
    c = freqs[:T, :half].astype(np.float32)[None, :, None, :]
    s = freqs[:T, half:].astype(np.float32)[None, :, None, :]
    if inverse:
        s = -s
    nr = n_q_heads + n_kv_heads
    x1, x2 = x[:, :, :nr, :half], x[:, :, :nr, half:]
    y = x.copy()
    y[:, :, :nr, :half] = x1 * c - x2 * s
    y[:, :, :nr, half:] = x2 * c + x1 * s
    return y.astype(qkv.dtype).reshape(qkv.shape)


# ---- launchers ----------------------------------------------------------------------------
def _rope(what, names, out, inp, freqs, n_q_heads, n_kv_heads, abs_max, inverse, stream):
    out_name, inp_name = names
    expect(inp, f"{what} {inp_name}", FLOATS)
    expect(freqs, f"{what} freqs", TABLE_DTYPES, (None, None))
    max_pos, hs = freqs.shape
    H = n_q_heads + 2 * n_kv_heads
    if n_q_heads < 1 or n_kv_heads < 1:
        raise ValueError(f"{what}: n_q_heads = {n_q_heads} and n_kv_heads = {n_kv_heads} must be positive")
    if inp.ndim not in (3, 4) or inp.shape[2:] not in ((H * hs,), (H, hs)):
        raise ValueError(
            f"{what} {inp_name}: expected shape (B, T, {H * hs}) or (B, T, {H}, {hs}) for {n_q_heads} q and "
            f"{n_kv_heads} kv heads of size {hs}, got tensor {inp.name!r} {inp.shape} {inp.dtype}"
        )
    check_vector_width(what, "head size", hs, inp.dtype, vectors=2)  # each half is whole vectors
    B, T = inp.shape[:2]
    if T > max_pos:
        raise ValueError(f"{what} freqs: table has {max_pos} positions, but the sequence has T = {T}")
    expect(out, f"{what} {out_name}", inp.dtype, inp.shape)
    if abs_max is not None:
        expect(abs_max, f"{what} abs_max", FP32, (1,))
    dev = same_device(out, inp, freqs, abs_max)
    in_place = out.storage is inp.storage and out.offset == inp.offset
    if not in_place and overlaps(out, inp):
        raise ValueError(
            f"{what}: {out_name} {out.name!r} partly overlaps {inp_name} {inp.name!r}; use the same tensor or none"
        )
    if dev.is_cpu:
        y = rope_np(inp.array(), freqs.array(), n_q_heads, n_kv_heads, inverse)
        write_twin_results(((out, y),), abs_max, y)
        return
    if inp.nelem == 0:
        return
    check_aligned(what, out, inp)
    # a thread's item: a group of heads' 16-byte vectors of one half; in place without abs_max, the
    # groups of v heads are skipped
    visited = H if not in_place or abs_max is not None else n_q_heads + n_kv_heads
    total = B * T * ceil_div(visited, _HEADS) * (hs // 2 // (16 // inp.dtype.itemsize))
    blocks = grid_size(dev, total, _THREADS, _BLOCKS_PER_SM)
    heads = (np.int32(T), np.int32(n_q_heads), np.int32(n_kv_heads), np.int32(hs))
    args = (out, inp, freqs, abs_max, np.int64(B * T), *heads, np.int32(inverse), np.int32(not in_place))
    launch(FAMILY, kernel_name("rope", inp, freqs), blocks, _THREADS, args, dev, stream, dependent=True)


def rope_forward(out, inp, freqs, n_q_heads: int, n_kv_heads: int, abs_max=None, stream=None) -> None:
    """Apply RoPE to the q and k heads of packed qkv; v heads are copied (or left alone in place).

    Args:
        out: like inp, written (=); may be inp itself (in place), but not a partial overlap.
        inp: (B, T, Hq + 2*Hkv, hs) or (B, T, (Hq + 2*Hkv) * hs), fp32, bf16 or fp16.
        freqs: (max_pos, hs) fp32 or fp16 from rope_freqs, max_pos >= T; row t serves position t.
        n_q_heads, n_kv_heads: Hq and Hkv.
        abs_max: optional (1,) fp32; max-accumulates |out| over the whole tensor, v heads included.
    NumPy equivalent: rope_np(inp, freqs, n_q_heads, n_kv_heads).
    """
    _rope("rope_forward", ("out", "inp"), out, inp, freqs, n_q_heads, n_kv_heads, abs_max, False, stream)


def rope_backward(dinp, dout, freqs, n_q_heads: int, n_kv_heads: int, abs_max=None, stream=None) -> None:
    """The gradient of rope_forward: the inverse rotation of dout's q and k heads; v heads pass through.

    Args:
        dinp: like dout, written (=); may be dout itself (in place, as the seed does).
        dout: (B, T, Hq + 2*Hkv, hs) or (B, T, (Hq + 2*Hkv) * hs), fp32, bf16 or fp16.
        freqs, n_q_heads, n_kv_heads: as for rope_forward.
        abs_max: optional (1,) fp32; max-accumulates |dinp| over the whole tensor.
    NumPy equivalent: rope_np(dout, freqs, n_q_heads, n_kv_heads, inverse=True).
    """
    _rope("rope_backward", ("dinp", "dout"), dinp, dout, freqs, n_q_heads, n_kv_heads, abs_max, True, stream)
