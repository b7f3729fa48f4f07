"""Decode attention over the KV cache, and the RoPE + cache append before it (raw_kernels/decode_attention.cu).

Layouts (the inference contract): qkv rows are packed [q heads | k heads | v heads] of hs each; a
per-layer cache `k_cache`/`v_cache` is (max_batch, Hkv, max_seq, hs) in the model dtype (fp32 or bf16);
row i of a decode batch is cache slot i. `positions` and `lengths` live on the device, so one captured
graph serves every step: the kernels read them there and size their work from them.

decode_attention is flash-decoding: the positions [0, lengths[i]) are cut into up to S chunks (S fixed
at launch from the batch, the kv heads and the SM count, so that one sequence fills the GPU); a block per
(split, kv head, row) serves all q heads of its kv head, so K and V are read once; partial softmax
states go to an fp32 scratch and are merged in a fixed order, rounding once. Up to _FUSE_MAX_SPLITS
splits, the last split block of each (row, kv head) merges them itself (one launch per layer, what a
short-context decode step wants); beyond, a combine kernel spreads the merge over (row, q head) blocks.
A row that fits one chunk is written by its only block either way. Chunks are at least _MIN_CHUNK
positions: a block walks its chunk with the next step's K and V in flight during the current step's
math, so a few hundred positions cost one block little, while every extra split adds partials to merge
(on the H200 a merge of 9 splits cost more than the attention itself at 64-position chunks).
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import expect, overlaps, same_device
from ..dtypes import BF16, FP16, FP32, INT32
from ._build import ceil_div, launch

FAMILY = "decode_attention"
FLOATS = (FP32, BF16)
TABLE_DTYPES = (FP32, FP16)
MAX_HEAD_SIZE = 256
_SUFFIX = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
_MIN_CHUNK = 128  # fewest positions per split (MIN_CHUNK in decode_attention.cu)
_BLOCKS_PER_SM = 4  # split blocks per SM that "fills the GPU"
_H200_SMS = 132  # the scratch is sized for this many SMs; a larger GPU gets fewer splits than it could use
_THREADS = 128  # NW * 32 in decode_attention.cu
# q heads per block while the batch's (row, q head) blocks fit one wave (see tile_heads); bench_decode
# --tile-heads compares. One head per block: a 0.5B batch-1 step on the H200 took 0.634 ms/token
# against 0.739 with blocks of 7 heads (prompt 16; 0.816 against 0.943 at 512).
SMALL_BATCH_TILE_HEADS = 1
_MAX_TILE_HEADS = 8  # q heads per block at most (GM <= 8)
_MAX_ROWS = 64  # rows the scratch keeps arrival counters for (the decode batch limit)
_FUSE_MAX_SPLITS = 32  # the last split block merges at most this many partials per head itself


# ---- NumPy twins --------------------------------------------------------------------------
def rope_kv_append_np(qkv, k_cache, v_cache, slots, positions, freqs, n_q_heads: int, n_kv_heads: int,
                      rotate: bool = True) -> None:  # fmt: skip
    """In place on NumPy arrays: rotate row r's q and k heads at positions[r] (rope_np's formula), then
    k_cache[slots[r], :, positions[r]] = its k heads and v_cache[...] = its v heads.

    qkv (n, (Hq + 2*Hkv) * hs) or (n, Hq + 2*Hkv, hs); caches (max_batch, Hkv, max_seq, hs); slots and
    positions (n,); freqs (max_pos, hs) [cos | sin] (unused when rotate is False).
    """
    n = qkv.shape[0]
    hs = k_cache.shape[-1]
    half = hs // 2
    x = qkv.reshape(n, n_q_heads + 2 * n_kv_heads, hs)
    nr = n_q_heads + n_kv_heads
    pos = np.asarray(positions, np.int64)
    if rotate and n:
        xf = x[:, :nr].astype(np.float32)
        c = freqs[pos, :half].astype(np.float32)[:, None, :]
        s = freqs[pos, half:].astype(np.float32)[:, None, :]
        x1, x2 = xf[..., :half], xf[..., half:]
        y = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
        x[:, :nr] = y.astype(x.dtype)
    sl = np.asarray(slots, np.int64)
    k_cache[sl, :, pos] = x[:, n_q_heads:nr]
    v_cache[sl, :, pos] = x[:, nr:]


def decode_attention_np(qkv, k_cache, v_cache, lengths, n_q_heads: int, n_kv_heads: int) -> np.ndarray:
    """(b, Hq*hs) fp32: row i's q heads attend to positions [0, lengths[i]) of cache slot i (GQA).

    Per row and head, in float32 like attention_forward_numpy: s = (K q) / sqrt(hs),
    out = softmax(s) V; the caller rounds once to the model dtype.
    """
    b = qkv.shape[0]
    hs = k_cache.shape[-1]
    group = n_q_heads // n_kv_heads
    scale = np.float32(1.0 / math.sqrt(hs))
    q = qkv.reshape(b, -1, hs)[:, :n_q_heads].astype(np.float32)
    out = np.zeros((b, n_q_heads, hs), np.float32)
    for i in range(b):
        n = int(lengths[i])
        k = k_cache[i, :, :n].astype(np.float32)  # (Hkv, n, hs)
        v = v_cache[i, :, :n].astype(np.float32)
        for h in range(n_q_heads):
            s = (k[h // group] @ q[i, h]) * scale
            p = np.exp(s - s.max())
            out[i, h] = (p @ v[h // group]) / p.sum()
    return out.reshape(b, n_q_heads * hs)


# ---- sizes --------------------------------------------------------------------------------
def _splits(b: int, max_seq: int, blocks_per_split: int, n_sms: int) -> int:
    """Splits per (row, kv head) so that b * blocks_per_split * S blocks fill n_sms SMs, each split at
    least _MIN_CHUNK positions of a full cache."""
    want = ceil_div(_BLOCKS_PER_SM * n_sms, b * blocks_per_split)
    return max(1, min(want, ceil_div(max_seq, _MIN_CHUNK)))


def tile_heads(b: int, n_q_heads: int, n_kv_heads: int, n_sms: int) -> tuple[int, int]:
    """(tiles per kv head, q heads per tile): SMALL_BATCH_TILE_HEADS heads per block while b * Hq
    blocks fit one wave of _BLOCKS_PER_SM per SM, so a small batch gets many short blocks; beyond, up
    to 8 heads per block (_MAX_TILE_HEADS), each reading a K/V position once for all of them, since a
    big batch fills the GPU anyway and every tile re-reads the row's K and V. The results do not
    depend on it beyond the compiler's contraction of each kernel variant."""
    group = n_q_heads // n_kv_heads
    heads = SMALL_BATCH_TILE_HEADS if b * n_q_heads <= _BLOCKS_PER_SM * n_sms else _MAX_TILE_HEADS
    tiles = ceil_div(group, heads)
    return tiles, ceil_div(group, tiles)


def _counter_rows(head_size: int) -> int:
    """Leading scratch rows holding the 64-bit arrival counters: one per (row, q head) for _MAX_ROWS rows."""
    return ceil_div(2 * _MAX_ROWS, head_size + 2)


def decode_attention_scratch_shape(b: int, n_q_heads: int, head_size: int, max_seq: int) -> tuple[int, int, int]:
    """Shape (P, Hq, hs + 2) of the fp32 scratch decode_attention needs for batches of up to b rows.

    The leading _counter_rows(hs) rows hold arrival counters, which must be zero before the first
    launch (zero the whole scratch once after allocating it; every launch leaves them at zero), the
    rest partial states (o, m, l) per q head: enough for every batch size 1..b at the split count it gets on an
    H200, so one scratch sized for the largest batch serves all smaller ones, and the counters sit at
    the same place for all of them.
    """
    if b < 1 or n_q_heads < 1 or head_size < 1 or max_seq < 1:
        raise ValueError(
            f"decode_attention_scratch_shape: b = {b}, n_q_heads = {n_q_heads}, head_size = {head_size} and "
            f"max_seq = {max_seq} must be positive"
        )
    rows = max(bb * _splits(bb, max_seq, 1, _H200_SMS) for bb in range(1, b + 1))
    return (_counter_rows(head_size) + rows, n_q_heads, head_size + 2)


# ---- checks -------------------------------------------------------------------------------
def _check_heads(what, n_q_heads, n_kv_heads):
    if n_q_heads < 1 or n_kv_heads < 1 or n_q_heads % n_kv_heads:
        raise ValueError(f"{what}: n_q_heads = {n_q_heads} must be a positive multiple of n_kv_heads = {n_kv_heads}")


def _check_caches(what, k_cache, v_cache, dtype, n_kv_heads):
    """(max_batch, max_seq, hs) after checking both caches."""
    expect(k_cache, f"{what} k_cache", dtype, (None, n_kv_heads, None, None))
    max_batch, _, max_seq, hs = k_cache.shape
    expect(v_cache, f"{what} v_cache", dtype, k_cache.shape)
    if hs % 2 or hs > MAX_HEAD_SIZE:
        raise ValueError(
            f"{what}: head size {hs} (the caches' last dimension) must be even and at most {MAX_HEAD_SIZE}"
        )
    return max_batch, max_seq, hs


def _check_qkv(what, qkv, n, n_q_heads, n_kv_heads, hs):
    H = n_q_heads + 2 * n_kv_heads
    if qkv.ndim not in (2, 3) or qkv.shape[1:] not in ((H * hs,), (H, hs)) or (n is not None and qkv.shape[0] != n):
        rows = "n" if n is None else str(n)
        raise ValueError(
            f"{what} qkv: expected shape ({rows}, {H * hs}) or ({rows}, {H}, {hs}) for {n_q_heads} q and "
            f"{n_kv_heads} kv heads of size {hs}, got tensor {qkv.name!r} {qkv.shape} {qkv.dtype}"
        )


def _check_aligned(dev, *tensors, nbytes: int = 16) -> None:
    if dev.is_cuda:
        for t in tensors:
            if t.ptr % nbytes:
                raise ValueError(f"tensor {t.name!r}: device address {t.ptr:#x} is not {nbytes}-byte aligned")


# ---- launchers ----------------------------------------------------------------------------
def rope_kv_append(qkv, k_cache, v_cache, slots, positions, freqs, n_q_heads: int, n_kv_heads: int,
                   rotate: bool = True, stream=None) -> None:  # fmt: skip
    """RoPE at each row's own position (in place), then append its k and v heads to the cache.

    Args:
        qkv: (n, (Hq + 2*Hkv) * hs) or (n, Hq + 2*Hkv, hs), fp32 or bf16; its q and k heads are rotated
            in place (=) when rotate, bitwise as rope_forward rotates position positions[r].
        k_cache, v_cache: (max_batch, Hkv, max_seq, hs), qkv's dtype; [slots[r], :, positions[r], :] is
            written (=) with row r's k heads (rotated) and v heads.
        slots, positions: (n,) int32 on the device: row r's cache slot and position. Decode: slots 0..b-1;
            prefill of one prompt: all equal, positions 0..n-1. Rows outside the cache (or past the table
            when rotating) are skipped on the device; on cpu they raise before anything is written.
        freqs: (max_pos, hs) fp32 or fp16 from rope_freqs; may be None when rotate is False.
        rotate: False only appends (prefill, after rope_forward already rotated the prompt).
    NumPy equivalent: rope_kv_append_np.
    """
    what = "rope_kv_append"
    _check_heads(what, n_q_heads, n_kv_heads)
    expect(qkv, f"{what} qkv", FLOATS)
    max_batch, max_seq, hs = _check_caches(what, k_cache, v_cache, qkv.dtype, n_kv_heads)
    _check_qkv(what, qkv, None, n_q_heads, n_kv_heads, hs)
    n = qkv.shape[0]
    expect(slots, f"{what} slots", INT32, (n,))
    expect(positions, f"{what} positions", INT32, (n,))
    if rotate or freqs is not None:
        expect(freqs, f"{what} freqs", TABLE_DTYPES, (None, hs))
    max_pos = freqs.shape[0] if freqs is not None else 0
    dev = same_device(qkv, k_cache, v_cache, slots, positions, freqs)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if overlaps(t, qkv):
            raise ValueError(f"{what}: {name} {t.name!r} overlaps qkv {qkv.name!r}")
    if dev.is_cpu:
        sl, pos = slots.array(), positions.array()
        bad = (sl < 0) | (sl >= max_batch)
        if bad.any():
            raise ValueError(f"{what} slots: slot {sl[bad][0]} is outside the cache's {max_batch} slots")
        limit = min(max_seq, max_pos) if rotate else max_seq
        bad = (pos < 0) | (pos >= limit)
        if bad.any():
            raise ValueError(
                f"{what} positions: position {pos[bad][0]} is outside [0, {limit}) (cache max_seq = {max_seq}"
                + (f", rope table {max_pos} positions)" if rotate else ")")
            )
        rope_kv_append_np(qkv.array(), k_cache.array(), v_cache.array(), sl, pos,
                          freqs.array() if rotate else None, n_q_heads, n_kv_heads, rotate)  # fmt: skip
        return
    if n == 0:
        return
    vn = 16 // qkv.dtype.itemsize
    vec = hs % (2 * vn) == 0
    if vec:
        _check_aligned(dev, qkv, k_cache, v_cache)
    table = freqs if freqs is not None else qkv  # an unused pointer when not rotating
    tsuf = _SUFFIX[freqs.dtype.name] if freqs is not None else "f32"
    name = f"rope_kv_append_{_SUFFIX[qkv.dtype.name]}_{tsuf}_{'vec' if vec else 'scalar'}"
    args = (qkv, k_cache, v_cache, slots, positions, table, np.int32(n_q_heads), np.int32(n_kv_heads), np.int32(hs),
            np.int32(max_batch), np.int32(max_seq), np.int32(max_pos), np.int32(rotate))  # fmt: skip
    launch(FAMILY, name, n, 128, args, dev, stream, dependent=True)


def _layout(dtype, hs: int) -> str:
    """Which split kernel serves head size hs: 16-byte vectors with LP lanes per position where they fit."""
    vn = 16 // dtype.itemsize
    if hs % vn == 0 and hs // vn <= 32:
        return f"v{max(8, 1 << (hs // vn - 1).bit_length())}"
    if hs % vn == 0 and hs // vn <= 64:
        return "v32x2"  # fp32 beyond hs 128
    return "gen"


def decode_attention(out, qkv, k_cache, v_cache, lengths, n_q_heads: int, n_kv_heads: int, scratch, freqs=None,
                     stream=None) -> None:  # fmt: skip
    """Attention of one new token per row over the cache: out = softmax(q Kᵀ / sqrt(hs)) V, GQA.

    With `freqs`, rope_kv_append runs inside it (one launch fewer per decode layer): row i's q and k
    heads are rotated at position lengths[i] - 1 and its k and v written to cache slot i there before
    the attention reads them; qkv itself is left as it is.

    Args:
        out: (b, Hq*hs), qkv's dtype; written (=), rounded once. Must not overlap qkv.
        qkv: (b, (Hq + 2*Hkv) * hs) or (b, Hq + 2*Hkv, hs), fp32 or bf16; the q heads are read (rotated
            already, e.g. by rope_kv_append), or with `freqs` the q, k and v heads of the new token.
        k_cache, v_cache: (max_batch, Hkv, max_seq, hs), qkv's dtype, max_batch >= b; row i reads slot i.
        lengths: (b,) int32 on the device, each in [1, max_seq]: row i attends to positions [0, lengths[i]).
            Checked on cpu; on the device a length is clamped to [0, max_seq] and 0 gives zeros.
            Under a dependent launch the kernel reads lengths (and, with freqs, the cached K and V below
            lengths[i] - 1) before waiting for the kernel before it: whatever wrote them must have
            finished before that kernel started (in a decode step: earlier steps, the prefill, host copies;
            each step begins with the embedding's ordinary launch).
        n_q_heads, n_kv_heads: Hq and Hkv, Hq a multiple of Hkv. hs: any even size up to 256 (64 and 128 fast).
        scratch: fp32 (P, Hq, hs + 2) from decode_attention_scratch_shape(b', Hq, hs, max_seq) for any
            b' >= b (b <= 64), zeroed once after allocation (its arrival counters; each launch leaves
            them at zero, the partials are overwritten); must not be used by two launches that may run
            at the same time (the counters are per (row, kv head)).
        freqs: None, or the (max_pos, hs) [cos | sin] table of rope_kv_append in the table dtype of the
            model dtype (fp16 for bf16, fp32 for fp32); lengths[i] - 1 < max_pos.
    NumPy equivalent: decode_attention_np(...), rounded to out's dtype; with freqs, after
    rope_kv_append_np(copy of qkv, k_cache, v_cache, arange(b), lengths - 1, freqs, ...).
    """
    what = "decode_attention"
    _check_heads(what, n_q_heads, n_kv_heads)
    expect(qkv, f"{what} qkv", FLOATS)
    max_batch, max_seq, hs = _check_caches(what, k_cache, v_cache, qkv.dtype, n_kv_heads)
    _check_qkv(what, qkv, None, n_q_heads, n_kv_heads, hs)
    b = qkv.shape[0]
    if b > max_batch:
        raise ValueError(f"{what}: batch of {b} rows, but the cache {k_cache.name!r} has {max_batch} slots")
    expect(out, f"{what} out", qkv.dtype, (b, n_q_heads * hs))
    expect(lengths, f"{what} lengths", INT32, (b,))
    expect(scratch, f"{what} scratch", FP32, (None, n_q_heads, hs + 2))
    counter_rows = _counter_rows(hs)
    if scratch.shape[0] < counter_rows + b:
        raise ValueError(
            f"{what} scratch: expected at least {counter_rows + b} rows, as decode_attention_scratch_shape({b}, "
            f"{n_q_heads}, {hs}, {max_seq}) = {decode_attention_scratch_shape(b, n_q_heads, hs, max_seq)}, got "
            f"tensor {scratch.name!r} {scratch.shape}"
        )
    if b > _MAX_ROWS:
        raise ValueError(f"{what}: {b} rows; the scratch keeps counters for at most {_MAX_ROWS}")
    if freqs is not None:
        expect(freqs, f"{what} freqs", FP16 if qkv.dtype == BF16 else FP32, (None, hs))
    max_pos = 0 if freqs is None else freqs.shape[0]
    dev = same_device(out, qkv, k_cache, v_cache, lengths, scratch, freqs)
    if overlaps(out, qkv):
        raise ValueError(f"{what}: out {out.name!r} overlaps qkv {qkv.name!r}")
    if dev.is_cpu:
        ln = lengths.array()
        limit = max_seq if freqs is None else min(max_seq, max_pos)
        bad = (ln < 1) | (ln > limit)
        if bad.any():
            raise ValueError(
                f"{what} lengths: length {ln[bad][0]} is outside [1, {limit}] (the cache's max_seq = {max_seq}"
                + (f", rope table {max_pos} positions)" if freqs is not None else ")")
            )
        q = qkv.array()
        if freqs is not None:
            q = q.copy()
            rope_kv_append_np(q, k_cache.array(), v_cache.array(), np.arange(b), ln - 1, freqs.array(), n_q_heads,
                              n_kv_heads)  # fmt: skip
        o = decode_attention_np(q, k_cache.array(), v_cache.array(), ln, n_q_heads, n_kv_heads)
        out.array()[...] = o.reshape(out.shape).astype(out.dtype.np)
        return
    if b == 0:
        return
    layout = _layout(qkv.dtype, hs)
    _check_aligned(dev, qkv, k_cache, v_cache, nbytes=2 * qkv.dtype.itemsize if layout == "gen" else 16)
    tiles, heads = tile_heads(b, n_q_heads, n_kv_heads, dev.num_sms)
    gm = 1 << (heads - 1).bit_length()
    S = min(_splits(b, max_seq, n_kv_heads * tiles, dev.num_sms), (scratch.shape[0] - counter_rows) // b)
    fused = S <= _FUSE_MAX_SPLITS
    part_offset = np.int64(counter_rows * n_q_heads * (hs + 2))
    suf = _SUFFIX[qkv.dtype.name]
    scale_log2 = np.float32(math.log2(math.e) / math.sqrt(hs))
    args = (scratch, out, qkv, k_cache, v_cache, lengths, np.int32(n_q_heads), np.int32(n_kv_heads), np.int32(hs),
            np.int32(max_seq), np.int32(S), np.int32(tiles), np.int32(heads), scale_log2, part_offset,
            np.int32(fused), freqs, np.int32(max_pos))  # fmt: skip
    name = f"decode_attention_split_{suf}_{layout}_g{gm}"
    smem = 4 * heads * S if fused else 0  # the fused merge's weights
    launch(FAMILY, name, (S, n_kv_heads * tiles, b), _THREADS, args, dev, stream, shared_mem=smem, dependent=True)
    if not fused:
        args = (out, scratch, lengths, np.int32(n_q_heads), np.int32(hs), np.int32(max_seq), np.int32(S), part_offset)
        launch(FAMILY, f"decode_attention_combine_{suf}", b * n_q_heads, 128, args, dev, stream, shared_mem=4 * S,
               dependent=True)  # fmt: skip
