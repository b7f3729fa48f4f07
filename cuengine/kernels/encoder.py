"""Token embedding: forward gather and deterministic backward scatter-add (raw_kernels/encoder.cu).

The backward must give the same bits on every run, so it never adds into dwte with float atomics:
it counts each token's positions in a hash table (scratch the caller provides) and sums each token's
rows in a fixed order, by position, without sorting the batch. The NumPy twin sums in exactly that
order, so cpu and cuda agree bit for bit.
"""

from __future__ import annotations

import zlib

import numpy as np

from .._checks import check_aligned, check_vector_width, expect, same_device
from ..dtypes import BF16, FP16, FP32, INT32
from ._build import ceil_div, grid_size, kernel_name, launch

FAMILY = "encoder"
FLOATS = (FP32, BF16, FP16)

_PARTIALS = 4  # partial sums per token and channel (PARTIALS in encoder.cu); the twin mirrors their order
_INLINE = 6  # positions a hash slot keeps (INLINE); a token with more is "hot", summed by a whole block
_SLOT_INTS = 8  # key, count, INLINE positions (SLOT_INTS)
_HEAD_INTS = 8  # counters before the table (HEAD_INTS)
_SLOTS = 4  # hash slots per position (the kernels take the table size H): at most a quarter full, short probe
# chains (32768 uniform ids: the slowest insert 5-6 chained atomics, 14-16 at 2; H200 clear + count 11.5 us, 16.0)
_SUM_THREADS = 512  # SUM_THREADS: 16 warps
_HOT_VECS = 128  # 16-byte vectors per hot block (HOT_VECS)
_TILE_ALIGN = 32  # TILE_ALIGN: a big token's tile width is a multiple of it
_ROWS = 128  # a hot token with more positions is "big": summed by position tiles of about this many of them
# (at least _INLINE: a token with at most _INLINE positions is always summed by the stream role)
_HOT_PER_SM = 0  # blocks per SM that only take hot units (every block takes them after its stream slice)
_MAX_PAIRS = 2**31 - 1  # the sum's stream role indexes (position, 16-byte vector) pairs in 32 bits
_STREAM_PAIRS = 32  # (position, vector) pairs per stream-role thread at most (STREAM_PAIRS)
_RESIDENT = 4  # stream-role blocks per SM: two waves of __launch_bounds__(SUM_THREADS, 2)
# (the H200: 60.4 us at the bench shape, 65.5 with 2, 77.2 with 1: shorter slices even out the tail)


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


def _tile_width(k, n: int):
    """Positions per tile of a big token (k > _ROWS positions out of n): about _ROWS of its positions
    each where they are spread evenly, a multiple of _TILE_ALIGN (tile_width in encoder.cu)."""
    return _TILE_ALIGN * -(-n * _ROWS // (_TILE_ALIGN * k))


def _sum4(rows: np.ndarray, group: np.ndarray, rank: np.ndarray, groups: int) -> np.ndarray:
    """sum4 of each group's rows, (groups, C) fp32: the row of rank r (ranks distinct within a group,
    ascending = the order of summation) goes to partial r % 4, each partial summed in order in fp32
    from 0; the result is ((p0 + p1) + p2) + p3."""
    part = np.zeros((_PARTIALS, groups, rows.shape[1]), np.float32)
    lane, step = rank % _PARTIALS, rank // _PARTIALS
    by_step = np.argsort(step, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(step))]
    for s in range(bounds.size - 1):
        idx = by_step[bounds[s] : bounds[s + 1]]  # (lane, group) pairs are distinct within one step
        part[lane[idx], group[idx]] += rows[idx]
    total = part[0]
    for w in range(1, _PARTIALS):
        total = total + part[w]
    return total


def encoder_backward_np(dwte: np.ndarray, dout: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """dwte + the sum of dout's rows per token, in the kernel's summation order.

    sum4(rows): rows dealt in order to 4 partial sums (the k-th to partial k % 4), each summed in order
    in fp32 from 0, then ((p0 + p1) + p2) + p3. A token with at most _ROWS positions adds sum4(its rows
    by position); a "big" token (more) splits the positions [0, N) into tiles of _tile_width(k, N) and
    adds sum4 over its non-empty tiles, in tile order (tile t to partial t % 4), of sum4(the tile's
    rows). The total is added to dwte once, then rounded to dwte's dtype. Ids outside [0, V) are
    skipped. dwte: (V, C); dout: (..., C); tokens: (...,). Returns a new (V, C) array.
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
    run = np.cumsum(starts) - 1  # which token's run each sorted position belongs to
    first = np.nonzero(starts)[0]
    k = np.diff(np.r_[first, order.size])[run]
    n = tok.size
    tile = order // np.where(k > _ROWS, _tile_width(np.maximum(k, 1), n), n)  # 0 for a token of <= _ROWS
    seg_starts = starts | np.r_[False, tile[1:] != tile[:-1]]
    seg = np.cumsum(seg_starts) - 1  # which (token, tile) each sorted position belongs to
    seg_first = np.nonzero(seg_starts)[0]
    tiles = _sum4(d[order], seg, np.arange(order.size) - seg_first[seg], seg_first.size)
    # one tile's sum4 s is the token's total: ((0 + s) + 0) + 0 == s, since no sum4 is -0.0
    total = _sum4(tiles, run[seg_first], tile[seg_first], first.size)
    rows = keys[first]
    out[rows] = (out[rows].astype(np.float32) + total).astype(out.dtype)
    return out


# ---- sizes --------------------------------------------------------------------------------
def _layout(n: int, c: int) -> dict[str, int]:
    """Offsets (ints) of the scratch's parts for n positions and C = c: the counters and a table of
    _SLOTS * n slots (at most n tokens: a quarter full at most) are zeroed per call; then the hot queue
    (at most n // 7 tokens have more than INLINE positions), 2 ints per queued token (first tile, tiles done),
    the item lists (medium tokens, then tiles: fewer than 2n / _ROWS, since a big token has
    ceil(n / _tile_width(k, n)) <= ceil(k / _ROWS) < 2k / _ROWS of them), a mark per position (its part in
    the sum's stream role), and an fp32 row of c per tile, 16-byte aligned."""
    slots = _SLOTS * n
    zeroed = _HEAD_INTS + slots * _SLOT_INTS
    qcap, tcap = n // (_INLINE + 1) + 1, 2 * n // _ROWS + 1
    hot = zeroed
    qinfo = hot + qcap
    items = qinfo + 2 * qcap
    marks = items + qcap + tcap
    partials = -(-(marks + n) // 4) * 4
    return dict(slots=slots, zeroed=zeroed, qcap=qcap, tcap=tcap, hot=hot, qinfo=qinfo, items=items, marks=marks,
                partials=partials, total=partials + tcap * c)  # fmt: skip


def encoder_scratch_shape(B: int, T: int, C: int) -> tuple[int]:
    """Shape of the int32 scratch encoder_backward needs for (B, T) tokens and C channels.

    Holds 8 counters, a hash table of 4 * B * T slots of 8 ints (a token, its count and its first 6
    positions; a quarter full at most, which keeps the count's probe chains short), the plan of the
    tokens with more positions (0.6 ints per position), a mark per position, and an fp32 partial row of
    C per tile of the big tokens (2 * B * T / 128 rows at most): about 33.6 + C / 64 ints per position
    (6.3 MB at B * T = 32768, C = 896).
    """
    return (_layout(B * T, C)["total"],)


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
        scratch: int32 of shape encoder_scratch_shape(B, T, C); overwritten.
    Same bits on every run and on cpu and cuda (the twin mirrors the summation order).
    Capturable: 4 kernels (the last three programmatic dependent launches), no host sync. It is
    encoder_backward_plan then encoder_backward_sum on one stream; a caller that has the tokens
    before dout (the model, at the start of its backward) runs the plan early on another stream.
    NumPy equivalent up to fp32 summation order: `np.add.at(dwte, tokens, dout)`.
    """
    dev = _check_backward(dwte, dout, tokens, scratch)  # before the plan writes anything
    encoder_backward_plan(scratch, tokens, *dwte.shape, stream)
    _sum(dev, dwte, dout, tokens, scratch, stream)


def encoder_backward_plan(scratch, tokens, V: int, C: int, stream=None) -> None:
    """The half of encoder_backward that reads only the tokens: clear the scratch's hash table, count
    each id's positions into it, plan the ids seen more than 6 times and mark each position's part in
    the sum (3 kernels, the last two programmatic dependent launches). It needs nothing from the
    backward, so it can run as soon as the tokens are on the device, off the backward's critical path.

    Args:
        scratch: int32 of shape encoder_scratch_shape(B, T, C); overwritten.
        tokens: (B, T) int32, the tokens encoder_backward_sum will be given.
        V, C: dwte's shape (ids outside [0, V) are skipped; the scratch holds a partial row of C per
            tile of a big id).
    On cpu the twin in encoder_backward_sum needs no plan; the plan records the tokens' count and checksum
    in the scratch instead, so that a sum without its plan (or given other tokens) is refused there.
    """
    expect(tokens, "encoder_backward_plan tokens", INT32)
    N = tokens.nelem
    expect(scratch, "encoder_backward_plan scratch", INT32, encoder_scratch_shape(N, 1, C))
    dev = same_device(tokens, scratch)
    check_aligned("encoder_backward_plan", scratch)
    if dev.is_cpu:
        scratch.array()[:2] = _plan_mark(tokens)
        return
    if N == 0:
        return
    lay, part = _parts(scratch, N, C)
    n4 = lay["zeroed"] // 4  # _HEAD_INTS and _SLOT_INTS are multiples of 4
    args = (part["flat"], np.int64(n4))
    launch(FAMILY, "encoder_backward_clear", min(ceil_div(n4, 1024), 4 * dev.num_sms), 256, args, dev, stream)
    n_, v_, h_, rows, qcap = (np.int32(x) for x in (N, V, lay["slots"], _ROWS, lay["qcap"]))
    args = (part["flat"], part["hot"], part["qinfo"], part["items"], tokens, n_, v_, h_, rows, qcap)
    launch(FAMILY, "encoder_backward_count", ceil_div(N, 256), 256, args, dev, stream, dependent=True)
    args = (part["flat"], part["marks"], tokens, n_, v_, h_)
    launch(FAMILY, "encoder_backward_mark", ceil_div(N, 256), 256, args, dev, stream, dependent=True)


def encoder_backward_sum(dwte, dout, tokens, scratch, stream=None) -> None:
    """The half of encoder_backward that reads dout: dwte[v, :] += the sum of v's rows of dout, in the
    twin's order (one kernel, a programmatic dependent launch). `scratch` must hold the plan that
    encoder_backward_plan made for these tokens, after it in stream order (or behind an event); arguments
    as encoder_backward's. On cpu a scratch without that plan raises ValueError (on cuda it is not
    checked: that would need a host sync).
    """
    _sum(_check_backward(dwte, dout, tokens, scratch), dwte, dout, tokens, scratch, stream)


def _sum(dev, dwte, dout, tokens, scratch, stream) -> None:
    """encoder_backward_sum after its checks."""
    C, N = dwte.shape[1], tokens.nelem
    if dev.is_cpu:
        if not np.array_equal(scratch.array()[:2], _plan_mark(tokens)):
            raise ValueError("encoder_backward_sum: scratch holds no plan for these tokens; run "
                             "encoder_backward_plan(scratch, tokens, V, C) first")  # fmt: skip
        dwte.array()[...] = encoder_backward_np(dwte.array(), dout.array(), tokens.array())
        return
    if N == 0:
        return
    lay, part = _parts(scratch, N, C)
    pairs = N * (C // (16 // dout.dtype.itemsize))  # (position, 16-byte vector of dout) pairs
    # at most _STREAM_PAIRS pairs per thread (the kernel keeps a bit per pair), at least _RESIDENT blocks per SM
    stream_blocks = min(max(dev.num_sms * _RESIDENT, ceil_div(pairs, _SUM_THREADS * _STREAM_PAIRS)),
                        ceil_div(pairs, _SUM_THREADS))  # fmt: skip
    per_block = ceil_div(ceil_div(pairs, stream_blocks), _SUM_THREADS) * _SUM_THREADS
    stream_blocks = ceil_div(pairs, per_block)
    ychunks = ceil_div(C * dout.dtype.itemsize // 16, _HOT_VECS)
    hot_blocks = min(_HOT_PER_SM * dev.num_sms, (lay["qcap"] + lay["tcap"]) * ychunks)
    name = kernel_name("encoder_backward_sum", dwte, dout)
    args = (dwte, dout, tokens, part["flat"], part["marks"], part["hot"], part["qinfo"], part["items"],
            part["partials"], np.int32(N), np.int32(C), np.int32(_ROWS), np.int32(lay["qcap"]),
            np.int32(hot_blocks), np.int32(ychunks), np.int32(per_block))  # fmt: skip
    launch(FAMILY, name, hot_blocks + stream_blocks, _SUM_THREADS, args, dev, stream, dependent=True)


def _check_backward(dwte, dout, tokens, scratch):
    """encoder_backward's argument checks; returns the device."""
    expect(dwte, "encoder_backward dwte", FLOATS, (None, None))
    C = dwte.shape[1]
    expect(tokens, "encoder_backward tokens", INT32)
    expect(dout, "encoder_backward dout", FLOATS, tokens.shape + (C,))
    expect(scratch, "encoder_backward scratch", INT32, encoder_scratch_shape(tokens.nelem, 1, C))
    dev = same_device(dwte, dout, tokens, scratch)
    check_vector_width("encoder_backward", "C", C, dout.dtype)
    check_aligned("encoder_backward", dout, dwte, scratch)
    pairs = tokens.nelem * (C // (16 // dout.dtype.itemsize))
    if pairs > _MAX_PAIRS:
        raise ValueError(f"encoder_backward: B*T = {tokens.nelem} positions of {C} channels are {pairs} 16-byte "
                         f"vectors of dout; at most {_MAX_PAIRS} are supported")  # fmt: skip
    return dev


def _plan_mark(tokens) -> np.ndarray:
    """What the cpu plan records: the token count and a CRC-32 of the ids, as two int32."""
    ids = np.ascontiguousarray(tokens.array())
    return np.array([ids.size, zlib.crc32(ids.tobytes())], np.uint32).view(np.int32)


def _parts(scratch, N: int, C: int):
    """The scratch's layout for N positions and C channels, and its parts as views: the whole (flat),
    the hot queue, its per-id info, the item lists, the marks and the tile partials."""
    lay = _layout(N, C)
    flat = scratch.flat()
    bounds = {"hot": ("hot", "qinfo"), "qinfo": ("qinfo", "items"), "items": ("items", "marks"),
              "marks": ("marks", "partials"), "partials": ("partials", "total")}  # fmt: skip
    return lay, {"flat": flat, **{k: flat.rows(lay[a], lay[b]) for k, (a, b) in bounds.items()}}
