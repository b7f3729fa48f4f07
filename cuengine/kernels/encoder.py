"""Token embedding: forward gather and deterministic backward scatter-add (raw_kernels/encoder.cu).

The backward must give the same bits on every run, so it never adds into dwte with float atomics:
it sorts the positions by token (a stable device radix sort whose scratch the caller provides) and
sums each token's rows in a fixed order. The NumPy twin sums in exactly that order, so cpu and
cuda agree bit for bit.
"""

from __future__ import annotations

import numpy as np

from .._checks import check_aligned, check_vector_width, expect, same_device
from ..dtypes import BF16, FP16, FP32, INT32
from ._build import ceil_div, grid_size, kernel_name, launch

FAMILY = "encoder"
FLOATS = (FP32, BF16, FP16)

_RADIX_BITS = 9  # matches encoder.cu
_SORT_THREADS = 1 << _RADIX_BITS  # one thread per digit value
_SORT_TILE = 2048  # SORT_THREADS * SORT_ITEMS
_SCAN_THREADS = 1024
_PARTIALS = 4  # partial sums per run and channel (PARTIALS in encoder.cu); the twin mirrors their order
_SUM_SLOTS = 4  # sorted slots per sum block (SUM_SLOTS)
_SUM_VECS = 128  # 16-byte vectors of channels per sum block (SUM_VECS)


# ---- NumPy twins --------------------------------------------------------------------------
def encoder_forward_np(tokens: np.ndarray, wte: np.ndarray, owned: tuple[int, int] | None = None) -> np.ndarray:
    """out[..., :] = wte[tokens[...], :]; ids outside [0, V) give zero rows, and with `owned` =
    (lo, hi) every element of wte outside the flat range [lo, hi) reads as zero.

    tokens: (...,) integer ids; wte: (V, C). Returns (..., C) in wte's dtype.
    """
    V, C = wte.shape
    tok = np.asarray(tokens).astype(np.int64)
    valid = (tok >= 0) & (tok < V)
    out = wte[np.where(valid, tok, 0)]
    out[~valid] = 0
    if owned is not None:
        flat = tok[..., None] * C + np.arange(C)
        out[(flat < owned[0]) | (flat >= owned[1])] = 0
    return out


def encoder_backward_np(dwte: np.ndarray, dout: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """dwte + the sum of dout's rows per token, in the kernel's summation order.

    For each token, its positions in ascending order are dealt round-robin to 4 partial sums
    (position k of the run goes to partial k % 4), each summed in order in fp32; the partials are
    added in order and the total is added to dwte once, then rounded to dwte's dtype. Ids outside
    [0, V) are skipped. dwte: (V, C); dout: (..., C); tokens: (...,). Returns a new (V, C) array.
    NumPy equivalent up to fp32 summation order: `np.add.at(dwte, tokens, dout)`.
    """
    V, C = dwte.shape
    d = np.asarray(dout).reshape(-1, C).astype(np.float32)
    tok = np.asarray(tokens).reshape(-1).astype(np.int64)
    pos = np.nonzero((tok >= 0) & (tok < V))[0]
    order = pos[np.argsort(tok[pos], kind="stable")]  # by token, then by position
    out = np.array(dwte, copy=True)
    if order.size == 0:
        return out
    keys = tok[order]
    starts = np.r_[True, keys[1:] != keys[:-1]]
    run = np.cumsum(starts) - 1  # which run each sorted slot belongs to
    first = np.nonzero(starts)[0]
    rank = np.arange(order.size) - first[run]
    part = np.zeros((_PARTIALS, first.size, C), np.float32)
    lane, step = rank % _PARTIALS, rank // _PARTIALS
    by_step = np.argsort(step, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(step))]
    for s in range(bounds.size - 1):
        idx = by_step[bounds[s] : bounds[s + 1]]  # (lane, run) pairs are distinct within one step
        part[lane[idx], run[idx]] += d[order[idx]]
    total = part[0]
    for w in range(1, _PARTIALS):
        total = total + part[w]
    rows = keys[first]
    out[rows] = (out[rows].astype(np.float32) + total).astype(out.dtype)
    return out


# ---- sizes --------------------------------------------------------------------------------
def _sort_passes(V: int) -> int:
    return max(1, ceil_div(V.bit_length(), _RADIX_BITS))  # keys are 0..V (V marks an invalid id)


def encoder_scratch_shape(B: int, T: int, C: int | None = None) -> tuple[int]:
    """Shape of the int32 scratch encoder_backward needs for (B, T) tokens.

    Holds the sorted positions (twice, ping-pong), their keys, and a (512, tiles) digit histogram
    with tiles = ceil(B*T / 2048). It does not depend on C, which is accepted so that callers can
    size every scratch buffer from (B, T, C).
    """
    n = B * T
    return (3 * n + _SORT_THREADS * max(1, ceil_div(n, _SORT_TILE)),)


# ---- launchers ----------------------------------------------------------------------------
def encoder_forward(out, tokens, wte, stream=None, owned: tuple[int, int] | None = None) -> None:
    """Embedding lookup: out[b, t, :] = wte[tokens[b, t], :].

    Args:
        out: (B, T, C) (any leading dims matching tokens), same dtype as wte; written (=).
        tokens: (B, T) int32 ids. Ids outside [0, V) give zero rows (the model validates ids first).
        wte: (V, C) fp32, bf16 or fp16; C a multiple of 16 bytes' worth of elements.
        owned: (lo, hi), or None for all of wte: elements of wte outside the flat range [lo, hi)
            read as zero (a rank's shard of a ZeRO embedding; summing every rank's lookup then gives
            the whole one). lo and hi are multiples of 16 bytes' worth of elements.
    NumPy equivalent: `out = wte[tokens]`.
    """
    expect(wte, "encoder_forward wte", FLOATS, (None, None))
    V, C = wte.shape
    expect(tokens, "encoder_forward tokens", INT32)
    expect(out, "encoder_forward out", wte.dtype, tokens.shape + (C,))
    dev = same_device(out, tokens, wte)
    check_vector_width("encoder_forward", "C", C, wte.dtype)
    lo, hi = (0, V * C) if owned is None else (int(owned[0]), int(owned[1]))
    vec = 16 // wte.dtype.itemsize
    if not 0 <= lo <= hi <= V * C or lo % vec or hi % vec:
        raise ValueError(f"encoder_forward: owned must be (lo, hi) with 0 <= lo <= hi <= {V * C} (V * C), "
                         f"both multiples of {vec} elements, got {owned!r}")  # fmt: skip
    if dev.is_cpu:
        out.array()[...] = encoder_forward_np(tokens.array(), wte.array(), owned)
        return
    N = tokens.nelem
    if N == 0:
        return
    check_aligned("encoder_forward", out, wte)
    blocks = grid_size(dev, N * C // vec, 256)
    args = (out, tokens, wte, np.int64(N), np.int32(C), np.int32(V), np.int64(lo), np.int64(hi))
    launch(FAMILY, kernel_name("encoder_forward", wte), blocks, 256, args, dev, stream)


def encoder_backward(dwte, dout, tokens, scratch, stream=None) -> None:
    """Embedding gradient, deterministic: dwte[v, :] += sum of dout[b, t, :] over tokens[b, t] == v.

    Args:
        dwte: (V, C) fp32, bf16 or fp16; accumulated (+=), rounded once per touched row.
        dout: (B, T, C) fp32, bf16 or fp16 (any leading dims matching tokens).
        tokens: (B, T) int32. Ids outside [0, V) are skipped (the model validates ids first).
        scratch: int32 of shape encoder_scratch_shape(B, T); overwritten.
    Same bits on every run and on cpu and cuda (the twin mirrors the summation order).
    Capturable: a fixed sequence of 3 * ceil(bits(V) / 9) + 1 kernels, no host sync.
    NumPy equivalent up to fp32 summation order: `np.add.at(dwte, tokens, dout)`.
    """
    expect(dwte, "encoder_backward dwte", FLOATS, (None, None))
    V, C = dwte.shape
    expect(tokens, "encoder_backward tokens", INT32)
    expect(dout, "encoder_backward dout", FLOATS, tokens.shape + (C,))
    N = tokens.nelem
    expect(scratch, "encoder_backward scratch", INT32, encoder_scratch_shape(N, 1))
    dev = same_device(dwte, dout, tokens, scratch)
    check_vector_width("encoder_backward", "C", C, dout.dtype)
    if dev.is_cpu:
        dwte.array()[...] = encoder_backward_np(dwte.array(), dout.array(), tokens.array())
        return
    if N == 0:
        return
    check_aligned("encoder_backward", dout)
    tiles = ceil_div(N, _SORT_TILE)
    flat = scratch.flat()
    bufs = (flat.rows(0, N), flat.rows(N, 2 * N))
    keys, hist = flat.rows(2 * N, 3 * N), flat.rows(3 * N, 3 * N + _SORT_THREADS * tiles)
    src = None  # the first pass starts from positions 0..N-1
    for p in range(_sort_passes(V)):
        dst, shift = bufs[p % 2], np.int32(_RADIX_BITS * p)
        args = (hist, tokens, src, np.int32(N), np.int32(V), shift, np.int32(tiles))
        launch(FAMILY, "encoder_sort_histogram", tiles, _SORT_THREADS, args, dev, stream)
        args = (hist, np.int32(_SORT_THREADS * tiles))
        launch(FAMILY, "encoder_sort_scan", 1, _SCAN_THREADS, args, dev, stream)
        args = (dst, keys, hist, tokens, src, np.int32(N), np.int32(V), shift, np.int32(tiles))
        launch(FAMILY, "encoder_sort_scatter", tiles, _SORT_THREADS, args, dev, stream)
        src = dst
    chunk = _SUM_VECS * (16 // dout.dtype.itemsize)  # channels per block
    name = kernel_name("encoder_backward_sum", dwte, dout)
    args = (dwte, dout, src, keys, np.int32(N), np.int32(V), np.int32(C))
    grid = (ceil_div(N, _SUM_SLOTS), ceil_div(C, chunk))
    launch(FAMILY, name, grid, _SUM_SLOTS * _SUM_VECS, args, dev, stream)
