"""Decode attention over the KV cache and RoPE + cache append: twins against float64 and the training
attention/rope, cpu vs cuda over awkward lengths, head sizes and GQA groups, graph replay, and errors."""

import functools
import math

import kernel_emulator as emu
import numpy as np
import pytest
from conftest import assert_close, rng, tensors

import cuengine as ce
from cuengine.kernels.attention import attention_forward_numpy
from cuengine.kernels.decode_attention import (
    _counter_rows,
    decode_attention,
    decode_attention_np,
    decode_attention_scratch_shape,
    rope_kv_append,
    rope_kv_append_np,
)
from cuengine.kernels.rope import rope_forward, rope_freqs, rope_np


def make_case(b, hq, hkv, hs, max_seq, lengths, dtype, seed=0, max_batch=None):
    """Random qkv (b, Q) and caches (max_batch, Hkv, max_seq, hs); lengths (b,) int32."""
    r = rng(seed)
    np_dt = ce.dtype(dtype).np
    mb = max_batch or b
    qkv = r.standard_normal((b, (hq + 2 * hkv) * hs)).astype(np_dt)
    kc = (r.standard_normal((mb, hkv, max_seq, hs)) * 1.5).astype(np_dt)
    vc = r.standard_normal((mb, hkv, max_seq, hs)).astype(np_dt)
    return qkv, kc, vc, np.asarray(lengths, np.int32)


def ref64(qkv, kc, vc, lengths, hq, hkv):
    """softmax(K q / sqrt(hs)) V per row and q head, in float64 from the stored values."""
    b, hs = qkv.shape[0], kc.shape[-1]
    q = qkv.astype(np.float64).reshape(b, -1, hs)
    out = np.zeros((b, hq, hs))
    for i in range(b):
        n = int(lengths[i])
        for h in range(hq):
            g = h // (hq // hkv)
            s = kc[i, g, :n].astype(np.float64) @ q[i, h] / math.sqrt(hs)
            p = np.exp(s - s.max())
            out[i, h] = p @ vc[i, g, :n].astype(np.float64) / p.sum()
    return out.reshape(b, hq * hs)


def nan_scratch(shape, hs):
    """A scratch as a fresh allocation zeroed once would be after earlier use: counters at zero,
    partials full of leftovers (NaN here, so a partial read before it is written shows)."""
    scratch = np.full(shape, np.nan, np.float32)
    scratch[: _counter_rows(hs)] = 0
    return scratch


def run_attention(device, qkv, kc, vc, lengths, hq, hkv, split_rows=None, repeat=1):
    """decode_attention's output; split_rows caps the scratch's partial rows (split_rows // b splits). The
    scratch's partial rows start as NaN, its counter rows at zero; repeat runs the same call again."""
    b, hs, max_seq = qkv.shape[0], kc.shape[-1], kc.shape[2]
    shape = decode_attention_scratch_shape(b, hq, hs, max_seq)
    if split_rows is not None:
        shape = (_counter_rows(hs) + split_rows,) + shape[1:]
    t = tensors(device, qkv=qkv, kc=kc, vc=vc, lengths=lengths, scratch=nan_scratch(shape, hs))
    out = ce.Tensor.empty(qkv.dtype, (b, hq * hs), device, name="out")
    for _ in range(repeat):
        out.copy_from_numpy(np.full((b, hq * hs), 7, qkv.dtype))
        decode_attention(out, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, t["scratch"])
    return out.numpy()


# ---- cpu: the twins ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("hq,hkv,hs", [(4, 4, 16), (6, 2, 32), (8, 1, 6)])
def test_twin_matches_float64(dtype, hq, hkv, hs):
    lengths = [1, 37, 64, 100]
    qkv, kc, vc, ln = make_case(4, hq, hkv, hs, 100, lengths, dtype)
    got = decode_attention_np(qkv, kc, vc, ln, hq, hkv).astype(qkv.dtype)
    assert_close(got, ref64(qkv, kc, vc, ln, hq, hkv), dtype, "decode attention")
    # a length-1 row returns its one value row
    np.testing.assert_array_equal(got[0].reshape(hq, hs), vc[0, np.arange(hq) // (hq // hkv), 0])


def test_twin_equals_the_training_attention():
    """Row t of causal attention over a sequence = decode of row t's q over the cache of rows 0..t."""
    hq, hkv, hs, T = 6, 2, 16, 29
    x = rng(1).standard_normal((1, T, (hq + 2 * hkv) * hs)).astype(np.float32)
    att, _ = attention_forward_numpy(x, hq, hkv)
    heads = x[0].reshape(T, hq + 2 * hkv, hs)
    kc = np.ascontiguousarray(heads[:, hq : hq + hkv].transpose(1, 0, 2))[None]  # (1, Hkv, T, hs)
    vc = np.ascontiguousarray(heads[:, hq + hkv :].transpose(1, 0, 2))[None]
    for t in (0, 13, T - 1):
        got = decode_attention_np(x[0, t : t + 1], kc, vc, np.array([t + 1]), hq, hkv)
        np.testing.assert_allclose(got[0], att[0, t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rope_append_twin_equals_rope_np(dtype):
    """Rows at their own positions rotate bitwise as rope_np rotates those positions of a sequence."""
    hq, hkv, hs, T = 4, 2, 16, 20
    table = np.float16 if dtype == "bf16" else np.float32
    freqs = rope_freqs(32, hs, 1e4, table)
    seq = rng(2).standard_normal((1, T, (hq + 2 * hkv) * hs)).astype(ce.dtype(dtype).np)
    want = rope_np(seq, freqs, hq, hkv)[0]
    pos = np.array([19, 0, 7], np.int32)
    qkv = seq[0, pos].copy()
    kc = np.zeros((4, hkv, 24, hs), qkv.dtype)
    vc = np.zeros_like(kc)
    rope_kv_append_np(qkv, kc, vc, [3, 0, 1], pos, freqs, hq, hkv)
    np.testing.assert_array_equal(qkv, want[pos])
    heads = want[pos].reshape(3, hq + 2 * hkv, hs)
    for r, (s, p) in enumerate(zip([3, 0, 1], pos)):
        np.testing.assert_array_equal(kc[s, :, p], heads[r, hq : hq + hkv])
        np.testing.assert_array_equal(vc[s, :, p], heads[r, hq + hkv :])
    assert np.count_nonzero(kc) == 3 * hkv * hs  # nothing else written


# ---- launchers: both devices ------------------------------------------------------------------
def run_append(device, qkv, kc, vc, slots, pos, freqs, hq, hkv, rotate):
    t = tensors(device, qkv=qkv, kc=kc, vc=vc, slots=np.asarray(slots, np.int32), pos=np.asarray(pos, np.int32))
    f = ce.Tensor.from_numpy(freqs, device, name="freqs") if freqs is not None else None
    rope_kv_append(t["qkv"], t["kc"], t["vc"], t["slots"], t["pos"], f, hq, hkv, rotate=rotate)
    return t["qkv"].numpy(), t["kc"].numpy(), t["vc"].numpy()


@pytest.mark.parametrize("dtype,hs", [("fp32", 64), ("bf16", 128), ("bf16", 12), ("fp32", 6)])
@pytest.mark.parametrize("rotate", [True, False])
def test_rope_append_launcher(dev, dtype, hs, rotate):
    hq, hkv = 6, 2
    freqs = rope_freqs(50, hs, 1e6, np.float16 if dtype == "bf16" else np.float32)
    np_dt = ce.dtype(dtype).np
    qkv = rng(3).standard_normal((5, (hq + 2 * hkv) * hs)).astype(np_dt)
    kc = rng(4).standard_normal((6, hkv, 40, hs)).astype(np_dt)
    vc = rng(5).standard_normal((6, hkv, 40, hs)).astype(np_dt)
    slots, pos = [0, 1, 2, 5, 3], [0, 39, 17, 1, 17]
    got = run_append(dev, qkv, kc, vc, slots, pos, freqs if rotate else None, hq, hkv, rotate)
    want = [qkv.copy(), kc.copy(), vc.copy()]
    rope_kv_append_np(*want, slots, pos, freqs, hq, hkv, rotate)
    for name, g, w in zip(("qkv", "k_cache", "v_cache"), got, want):
        assert_close(g, w, dtype, name)
    if not rotate:
        np.testing.assert_array_equal(got[0], qkv)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "hq,hkv,hs,lengths,max_seq",
    [
        (14, 2, 64, [1, 65, 700, 1000], 1000),  # Qwen2.5-0.5B heads; a length of one position
        (12, 2, 128, [129, 2, 511], 600),  # Qwen2.5-1.5B heads
        (4, 4, 32, [127, 128, 300], 300),  # MHA, lengths around the 128-position chunk
        (16, 1, 48, [300, 1], 300),  # a group of 16: two tiles of 8 q heads
        (2, 1, 256, [90, 33], 100),  # the largest head size
        (6, 3, 10, [1, 20, 99], 99),  # an even head size without 16-byte vectors
    ],
)
def test_decode_attention_launcher(dev, dtype, hq, hkv, hs, lengths, max_seq):
    b = len(lengths)
    qkv, kc, vc, ln = make_case(b, hq, hkv, hs, max_seq, lengths, dtype, seed=hs, max_batch=b + 1)
    got = run_attention(dev, qkv, kc, vc, ln, hq, hkv, repeat=2)  # again: the counters came back to zero
    want = decode_attention_np(qkv, kc, vc, ln, hq, hkv).astype(qkv.dtype)
    assert_close(got, want, dtype, "decode_attention")
    assert_close(got, ref64(qkv, kc, vc, ln, hq, hkv), dtype, "decode_attention vs float64")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("split_rows", [3, 6, 300])  # 1 split, 2 splits, 40 splits (> 32: the combine kernel)
def test_split_counts(dev, dtype, split_rows):
    """One split (out written directly), a fused merge of two, and the combine kernel: same result.
    A 5120-position row of 128-position chunks has 40 splits when the scratch allows them."""
    qkv, kc, vc, ln = make_case(3, 8, 2, 64, 5120, [5120, 1, 300], dtype, seed=9)
    got = run_attention(dev, qkv, kc, vc, ln, 8, 2, split_rows=split_rows)
    assert_close(got, decode_attention_np(qkv, kc, vc, ln, 8, 2).astype(qkv.dtype), dtype, f"{split_rows} rows")


def test_captured_step_follows_device_positions(dev):
    """One captured append + attention replayed as positions move on: every step equals the twin."""
    hq, hkv, hs, b, max_seq = 4, 2, 64, 3, 160
    freqs = rope_freqs(max_seq, hs, 1e4)
    seq = rng(10).standard_normal((b, 12, (hq + 2 * hkv) * hs)).astype(np.float32)
    zeros = np.zeros((b, hkv, max_seq, hs), np.float32)
    t = tensors(dev, qkv=seq[:, 0].copy(), pos=np.zeros(b, np.int32), ln=np.ones(b, np.int32),
                slots=np.arange(b, dtype=np.int32), freqs=freqs, kc=zeros, vc=zeros)  # fmt: skip
    out = ce.Tensor.empty(ce.FP32, (b, hq * hs), dev, name="out")
    scratch = ce.Tensor.empty(
        ce.FP32, decode_attention_scratch_shape(b, hq, hs, max_seq), dev, name="scratch"
    ).fill_zero()

    def step():
        rope_kv_append(t["qkv"], t["kc"], t["vc"], t["slots"], t["pos"], t["freqs"], hq, hkv)
        decode_attention(out, t["qkv"], t["kc"], t["vc"], t["ln"], hq, hkv, scratch)

    start = np.array([124, 0, 130], np.int32)  # rows of one split, one crossing into two, and two (128 a split)
    t["pos"].copy_from_numpy(start)
    t["ln"].copy_from_numpy(start + 1)
    step()  # compile outside the capture
    graph = dev.capture(step)
    want = {"qkv": seq[:, 0].copy(), "kc": np.zeros((b, hkv, max_seq, hs), np.float32)}
    want["vc"] = np.zeros_like(want["kc"])
    rope_kv_append_np(want["qkv"], want["kc"], want["vc"], range(b), start, freqs, hq, hkv)
    for k in range(1, 6):
        pos = start + k
        t["qkv"].copy_from_numpy(seq[:, k])
        t["pos"].copy_from_numpy(pos)
        t["ln"].copy_from_numpy(pos + 1)
        graph.launch()
        q = seq[:, k].copy()
        rope_kv_append_np(q, want["kc"], want["vc"], range(b), pos, freqs, hq, hkv)
        assert_close(out.numpy(), decode_attention_np(q, want["kc"], want["vc"], pos + 1, hq, hkv), "fp32", f"step {k}")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "hq,hkv,hs,lengths,max_seq",
    [
        (14, 2, 64, [1, 70, 300], 320),  # new token in a first step, a later step, a later split
        (16, 1, 48, [129, 2], 200),  # two tiles of 8 q heads share the kv head that split 0 appends
        (6, 3, 10, [5, 99], 99),  # no 16-byte vectors
    ],
)
def test_fused_append_equals_append_then_attention(dev, dtype, hq, hkv, hs, lengths, max_seq):
    """decode_attention(freqs=) = rope_kv_append at lengths - 1, then decode_attention, bit for bit
    (out and both caches), and leaves qkv as it was."""
    b = len(lengths)
    qkv, kc, vc, ln = make_case(b, hq, hkv, hs, max_seq, lengths, dtype, seed=hs, max_batch=b + 1)
    table = np.float16 if dtype == "bf16" else np.float32
    freqs = rope_freqs(max_seq, hs, 1e4, table)
    scratch = nan_scratch(decode_attention_scratch_shape(b, hq, hs, max_seq), hs)
    runs = {}
    for fused in (False, True):
        t = tensors(dev, qkv=qkv, kc=kc, vc=vc, lengths=ln, freqs=freqs, scratch=scratch)
        out = ce.Tensor.empty(qkv.dtype, (b, hq * hs), dev, name="out")
        if fused:
            decode_attention(out, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, t["scratch"], freqs=t["freqs"])
            np.testing.assert_array_equal(t["qkv"].numpy().view(np.uint8), qkv.view(np.uint8))
        else:
            pos = ce.Tensor.from_numpy(ln - 1, dev, name="positions")
            slots = ce.Tensor.from_numpy(np.arange(b, dtype=np.int32), dev, name="slots")
            rope_kv_append(t["qkv"], t["kc"], t["vc"], slots, pos, t["freqs"], hq, hkv)
            decode_attention(out, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, t["scratch"])
        runs[fused] = [x.view(np.uint8) for x in (out.numpy(), t["kc"].numpy(), t["vc"].numpy())]
    for what, a, e in zip(("out", "k_cache", "v_cache"), runs[True], runs[False]):
        np.testing.assert_array_equal(a, e, err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_heads_per_block_do_not_change_a_bit(cuda, monkeypatch, dtype):
    """A block serves up to SMALL_BATCH_TILE_HEADS q heads of one kv head (small batches); each
    head's sums are its own, so any tiling (more, shorter blocks) gives the same results, with the
    fused append and across splits: the same bits in bf16 here, and within fp32's table in fp32,
    where each tiling is a kernel variant of its own whose multiply-adds the compiler may contract
    differently (seen on the H200: last-bit differences)."""
    from cuengine.kernels import decode_attention as da

    hq, hkv, hs, lengths, max_seq = 14, 2, 64, [16, 300], 320
    qkv, kc, vc, ln = make_case(2, hq, hkv, hs, max_seq, lengths, dtype, seed=4, max_batch=3)
    freqs = rope_freqs(max_seq, hs, 1e4, np.float16 if dtype == "bf16" else np.float32)
    scratch = nan_scratch(decode_attention_scratch_shape(2, hq, hs, max_seq), hs)
    runs = []
    for heads in (8, 2, 1):
        monkeypatch.setattr(da, "SMALL_BATCH_TILE_HEADS", heads)
        t = tensors(cuda, qkv=qkv, kc=kc, vc=vc, lengths=ln, freqs=freqs, scratch=scratch)
        out = ce.Tensor.empty(qkv.dtype, (2, hq * hs), cuda, name="out")
        decode_attention(out, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, t["scratch"], freqs=t["freqs"])
        runs.append([x.view(np.uint8) for x in (out.numpy(), t["kc"].numpy(), t["vc"].numpy())])
    for other in runs[1:]:
        for what, a, e in zip(("out", "k_cache", "v_cache"), other, runs[0]):
            if dtype == "fp32" and what == "out":
                assert_close(a.view(np.float32), e.view(np.float32), "fp32", what=what)
            else:
                np.testing.assert_array_equal(a, e, err_msg=what)


def test_tile_heads_by_batch():
    """Many one-head blocks while a batch's (row, q head) blocks fit one wave (4 per SM), blocks of up
    to 8 heads beyond: the 0.5B shape's 14 q heads over 2 kv heads on 132 SMs."""
    from cuengine.kernels.decode_attention import tile_heads

    assert [tile_heads(b, 14, 2, 132) for b in (1, 8, 37, 38, 64)] == [(7, 1)] * 3 + [(1, 7)] * 2
    assert tile_heads(1, 32, 2, 132) == (16, 1) and tile_heads(40, 32, 2, 132) == (2, 8)


# ---- errors -------------------------------------------------------------------------------------
def _z(shape, dtype=np.float32, name="t"):
    return ce.Tensor.from_numpy(np.zeros(shape, dtype), "cpu", name=name)


def _attn(out=(2, 64), qkv=(2, 128), cache=(3, 2, 10, 16), lengths=(1, 10), scratch=None, hq=4, hkv=2, dt=np.float32,
          out_dt=None, len_dt=np.int32, v_cache=None, freqs=None, freqs_dt=np.float32):  # fmt: skip
    """decode_attention on zero tensors: the defaults are valid (4 q, 2 kv heads of 16), overrides are not."""
    scratch = scratch or decode_attention_scratch_shape(2, hq, cache[-1], cache[2])
    ln = ce.Tensor.from_numpy(np.asarray(lengths, len_dt), "cpu", name="lengths")
    f = None if freqs is None else _z(freqs, freqs_dt, "freqs")
    decode_attention(_z(out, out_dt or dt, "out"), _z(qkv, dt, "qkv"), _z(cache, dt, "kc"),
                     _z(v_cache or cache, dt, "vc"), ln, hq, hkv, _z(scratch, name="scratch"), freqs=f)  # fmt: skip


@pytest.mark.parametrize(
    "over,match",
    [
        ({"dt": np.float16}, "qkv: expected dtype fp32/bf16"),
        ({"out_dt": ce.BF16.np}, "out: expected dtype fp32"),
        ({"out": (2, 48)}, r"out: expected shape \(2, 64\)"),
        ({"qkv": (2, 96)}, r"qkv: expected shape \(n, 128\) or \(n, 8, 16\)"),
        ({"cache": (3, 1, 10, 16)}, r"k_cache: expected shape \(\*, 2, \*, \*\)"),
        ({"v_cache": (3, 2, 9, 16)}, r"v_cache: expected shape \(3, 2, 10, 16\)"),
        ({"cache": (3, 2, 10, 15), "qkv": (2, 120), "out": (2, 60)}, "head size 15"),
        ({"cache": (3, 2, 10, 258), "qkv": (2, 2064), "out": (2, 1032)}, "at most 256"),
        ({"cache": (1, 2, 10, 16)}, "batch of 2 rows, but the cache 'kc' has 1 slots"),
        ({"lengths": (1, 0)}, r"length 0 is outside \[1, 10\]"),
        ({"lengths": (11, 1)}, r"length 11 is outside \[1, 10\]"),
        ({"len_dt": np.float32}, "lengths: expected dtype int32"),
        ({"lengths": (1, 2, 3)}, r"lengths: expected shape \(2\)"),
        ({"scratch": (9, 4, 18)}, "scratch: expected at least 10 rows"),
        ({"scratch": (8, 4, 16)}, r"scratch: expected shape \(\*, 4, 18\)"),
        ({"hq": 3, "hkv": 2}, "n_q_heads = 3 must be a positive multiple of n_kv_heads = 2"),
        ({"freqs": (10, 16), "freqs_dt": np.float16}, "freqs: expected dtype fp32"),
        ({"freqs": (10, 8)}, r"freqs: expected shape \(\*, 16\)"),
        ({"freqs": (9, 16)}, r"length 10 is outside \[1, 9\] \(the cache's max_seq = 10, rope table 9 positions\)"),
        (
            {"out": (65, 64), "qkv": (65, 128), "cache": (65, 2, 10, 16), "lengths": (1,) * 65, "scratch": (80, 4, 18)},
            "65 rows; the scratch keeps counters for at most 64",
        ),
    ],
)
def test_attention_errors(over, match):
    _attn()
    with pytest.raises(ValueError, match=match):
        _attn(**over)


def test_attention_refuses_out_overlapping_qkv():
    buf = _z((448,), name="buf")
    ln = ce.Tensor.from_numpy(np.ones(2, np.int32), "cpu", name="lengths")
    cache = _z((2, 2, 10, 16))
    qkv, out = buf.rows(0, 256).reshape(2, 128), buf.rows(128, 256).reshape(2, 64)
    with pytest.raises(ValueError, match="overlaps qkv"):
        decode_attention(out, qkv, cache, cache, ln, 4, 2, _z(decode_attention_scratch_shape(2, 4, 16, 10)))


def _append(qkv=(2, 128), cache=(3, 2, 10, 16), slots=(0, 1), pos=(0, 9), freqs=(12, 16), rotate=True, dt=np.float32,
            idx_dt=np.int32, freqs_dt=np.float32):  # fmt: skip
    """rope_kv_append on zero tensors: the defaults are valid (4 q, 2 kv heads of 16), overrides are not."""
    i = {k: ce.Tensor.from_numpy(np.asarray(v, idx_dt), "cpu", name=k) for k, v in (("slots", slots), ("pos", pos))}
    f = None if freqs is None else _z(freqs, freqs_dt, "freqs")
    rope_kv_append(_z(qkv, dt, "qkv"), _z(cache, dt, "kc"), _z(cache, dt, "vc"), i["slots"], i["pos"], f, 4, 2,
                   rotate=rotate)  # fmt: skip


@pytest.mark.parametrize(
    "over,match",
    [
        ({"dt": np.float16}, "qkv: expected dtype fp32/bf16"),
        ({"qkv": (2, 96)}, r"qkv: expected shape \(n, 128\)"),
        ({"slots": (0, 3)}, "slot 3 is outside the cache's 3 slots"),
        ({"slots": (-1, 0)}, "slot -1 is outside"),
        ({"pos": (0, 10), "freqs": (20, 16)}, r"position 10 is outside \[0, 10\)"),
        ({"pos": (0, 11), "freqs": (11, 16)}, r"position 11 is outside \[0, 10\)"),
        ({"pos": (0, 9), "freqs": (8, 16)}, r"position 9 is outside \[0, 8\) \(cache max_seq = 10, rope table 8"),
        ({"idx_dt": np.float32}, "slots: expected dtype int32"),
        ({"slots": (0,)}, r"slots: expected shape \(2\)"),
        ({"freqs": (12, 8)}, r"freqs: expected shape \(\*, 16\)"),
        ({"freqs_dt": ce.BF16.np}, "freqs: expected dtype fp32/fp16"),
        ({"freqs": None}, "freqs: expected a cuengine Tensor"),
    ],
)
def test_append_errors(over, match):
    _append()
    _append(freqs=None, rotate=False)  # no table needed to append only
    with pytest.raises(ValueError, match=match):
        _append(**over)


def test_append_refuses_a_bad_row_before_writing_anything():
    qkv = ce.Tensor.from_numpy(np.ones((2, 128), np.float32), "cpu", name="qkv")
    kc, vc = _z((3, 2, 10, 16), name="kc"), _z((3, 2, 10, 16), name="vc")
    i = {k: ce.Tensor.from_numpy(np.asarray(v, np.int32), "cpu", name=k) for k, v in (("s", (0, 1)), ("p", (3, 12)))}
    with pytest.raises(ValueError, match="position 12"):
        rope_kv_append(qkv, kc, vc, i["s"], i["p"], _z((20, 16)), 4, 2)
    assert not kc.numpy().any() and np.all(qkv.numpy() == 1)


def test_scratch_shape_serves_every_smaller_batch():
    big = decode_attention_scratch_shape(64, 14, 64, 32768)
    for b in (1, 2, 7, 64):
        assert decode_attention_scratch_shape(b, 14, 64, 32768)[0] <= big[0]
    assert _counter_rows(64) == 2  # 64 rows x Hq 64-bit counters in rows of Hq x 66 floats
    assert decode_attention_scratch_shape(1, 14, 64, 32768) == (2 + 256, 14, 66)  # 32768 / 128-position chunks
    assert decode_attention_scratch_shape(2, 14, 64, 32768) == (2 + 512, 14, 66)  # 2 rows x 256 (< 264 to fill SMs)
    assert decode_attention_scratch_shape(1, 2, 16, 100) == (8 + 1, 2, 18)  # never below 128 positions a split
    with pytest.raises(ValueError, match="must be positive"):
        decode_attention_scratch_shape(0, 14, 64, 100)


# ---- gpu ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,table", [("bf16", np.float16), ("fp32", np.float32)])
@pytest.mark.parametrize("hs", [64, 128])
def test_cuda_rotation_is_bitwise_rope_forward(cuda, dtype, table, hs):
    """Prefill-shaped rows 0..T-1 rotated by rope_kv_append equal rope_forward's bits."""
    hq, hkv, T = 14, 2, 301
    freqs = rope_freqs(512, hs, 1e6, table)
    x = rng(11).standard_normal((1, T, (hq + 2 * hkv) * hs)).astype(ce.dtype(dtype).np)
    t = tensors(cuda, x=x, f=freqs)
    rope_forward(t["x"], t["x"], t["f"], hq, hkv)
    zeros = np.zeros((1, hkv, 512, hs), x.dtype)
    got = run_append(cuda, x[0], zeros, zeros, np.zeros(T), np.arange(T), freqs, hq, hkv, True)
    want = t["x"].numpy()[0]
    np.testing.assert_array_equal(got[0].view(np.uint8), want.view(np.uint8))
    heads = want.reshape(T, hq + 2 * hkv, hs)
    np.testing.assert_array_equal(got[1][0, :, :T].transpose(1, 0, 2), heads[:, hq : hq + hkv])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "b,hq,hkv,hs,max_seq",
    [(1, 14, 2, 64, 32768), (2, 28, 4, 128, 32768), (64, 14, 2, 64, 1024), (8, 32, 8, 128, 4096)],
)
def test_cuda_long_and_wide(cuda, dtype, b, hq, hkv, hs, max_seq):
    """Full caches up to 32768 positions and batches up to 64 rows, against the twin."""
    lengths = rng(b).integers(1, max_seq + 1, b)
    lengths[0] = max_seq
    qkv, kc, vc, ln = make_case(b, hq, hkv, hs, max_seq, lengths, dtype, seed=b)
    got = run_attention(cuda, qkv, kc, vc, ln, hq, hkv)
    assert_close(got, decode_attention_np(qkv, kc, vc, ln, hq, hkv).astype(qkv.dtype), dtype, "decode_attention")


# ---- the kernels on the host (tests/kernel_emulator.py) ----------------------------------------
# decode_attention.cuh's arrival counters (64-bit atomics: the emulator runs blocks one after another, so
# plain read-modify-writes) and the dynamic shared memory, after the emulator's common.cuh. The
# persistent kernel's named barriers are never instantiated here.
_EMU_HELPERS = r"""
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { auto o = *p; *p = o + v; return o; }
inline unsigned long long atomicExch(unsigned long long* p, unsigned long long v) { auto o = *p; *p = v; return o; }
inline void named_barrier(int, int) { fail("named_barrier outside the persistent kernel"); }
"""
_EMU_REPLACE = {
    "decode_attention.cuh": {'#include "common.cuh"': '#include "common.cuh"' + _EMU_HELPERS},
    "decode_attention.cu": {
        "extern __shared__ float sm_wt[]; /* the fused merge's weights */": "float* sm_wt = (float*)g_smem;",
        "extern __shared__ float sm_w[];  // (S,)": "float* sm_w = (float*)g_smem;",
    },
}


@pytest.fixture(scope="module")
def attention_emu(tmp_path_factory):
    """A `launch` running decode_attention.cu's kernels on the host, or a skip without g++."""
    work = tmp_path_factory.mktemp("decode_attention_emu")
    for name, subs in _EMU_REPLACE.items():
        text = (emu.kernel_dir() / name).read_text()
        for old, new in subs.items():
            assert old in text, f"{name} no longer has {old[:40]!r}: update the emulation"
            text = text.replace(old, new)
        (work / name).write_text(text)
    names = [f"decode_attention_combine_{t}" for t in ("f32", "bf16")]
    names += [f"rope_kv_append_{t}_{f}_{v}" for t, f in (("f32", "f32"), ("bf16", "f16")) for v in ("vec", "scalar")]
    names += [f"decode_attention_split_bf16_{lay}_g{g}" for lay in ("v8", "gen") for g in (1, 2, 4, 8)]
    names += [f"decode_attention_split_f32_{lay}_g{g}" for lay in ("v16", "gen") for g in (1, 2, 4, 8)]
    mp = pytest.MonkeyPatch()
    mp.setattr(emu, "kernel_dir", lambda: work)
    try:
        return functools.partial(emu.launch, emu.or_skip(emu.build("decode_attention", names, work)))
    finally:
        mp.undo()


@pytest.mark.parametrize("merge", ["fused", "combine"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(
    "hq,hkv,hs,lengths,max_seq",
    [
        (14, 2, 64, [1, 70, 300], 320),  # new token in a first step, a later step, three splits
        (16, 1, 48, [129, 2], 200),  # two tiles of 8 q heads share the kv head that split 0 appends
        (6, 3, 10, [5, 99], 99),  # no 16-byte vectors
    ],
)
def test_emulated_fused_append_equals_append_then_attention(attention_emu, monkeypatch, dtype, hq, hkv, hs, lengths,
                                                            max_seq, merge):  # fmt: skip
    """The kernels on the host: decode_attention(freqs=) gives the bits of rope_kv_append then
    decode_attention (out and both caches; its first step of K and V is read before the wait and
    the appended position patched after it), the caches are the twin's, out is within the table of
    the twin's, and nothing outside the written tensors changes."""
    from cuengine.kernels import decode_attention as D

    monkeypatch.setattr(D, "launch", attention_emu)
    if merge == "combine":
        monkeypatch.setattr(D, "_FUSE_MAX_SPLITS", 1)
    b = len(lengths)
    qkv, kc, vc, ln = make_case(b, hq, hkv, hs, max_seq, lengths, dtype, seed=hs, max_batch=b + 1)
    table = np.float16 if dtype == "bf16" else np.float32
    freqs = rope_freqs(max_seq, hs, 1e4, table)
    scratch = nan_scratch(decode_attention_scratch_shape(b, hq, hs, max_seq), hs)
    t_dt = {"qkv": dtype, "kc": dtype, "vc": dtype, "lengths": "int32", "freqs": "fp16" if dtype == "bf16" else "fp32",
            "scratch": "fp32", "pos": "int32", "slots": "int32"}  # fmt: skip
    runs = {}
    for fused in (False, True):
        arrays = dict(qkv=qkv, kc=kc, vc=vc, lengths=ln, freqs=freqs, scratch=scratch, pos=ln - 1,
                      slots=np.arange(b, dtype=np.int32))  # fmt: skip
        t = {k: emu.tensor(v, t_dt[k], k) for k, v in arrays.items()}
        out = emu.tensor(np.full((b, hq * hs), 7, qkv.dtype), dtype, "out")
        if fused:
            decode_attention(out, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, t["scratch"], freqs=t["freqs"])
            np.testing.assert_array_equal(t["qkv"].numpy().view(np.uint8), qkv.view(np.uint8))
        else:
            rope_kv_append(t["qkv"], t["kc"], t["vc"], t["slots"], t["pos"], t["freqs"], hq, hkv)
            decode_attention(out, t["qkv"], t["kc"], t["vc"], t["lengths"], hq, hkv, t["scratch"])
        assert all(emu.margins_ok(x) for x in (out, *t.values()))
        runs[fused] = [x.numpy() for x in (out, t["kc"], t["vc"])]
    for what, a, e in zip(("out", "k_cache", "v_cache"), runs[True], runs[False]):
        np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8), err_msg=what)
    q, kc_np, vc_np = qkv.copy(), kc.copy(), vc.copy()
    rope_kv_append_np(q, kc_np, vc_np, np.arange(b), ln - 1, freqs, hq, hkv)
    for what, a, e in (("k_cache", runs[True][1], kc_np), ("v_cache", runs[True][2], vc_np)):
        np.testing.assert_array_equal(a.view(np.uint8), e.view(np.uint8), err_msg=f"{what} against the twin")
    want = decode_attention_np(q, kc_np, vc_np, ln, hq, hkv).astype(qkv.dtype)
    assert_close(runs[True][0], want, dtype, "out against the twin")
