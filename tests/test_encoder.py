"""Token embedding: gather forward and the deterministic scatter-add backward, cpu and cuda."""

import kernel_emulator as emu
import numpy as np
import pytest
from conftest import ROWS, assert_bitwise, assert_close, check_op, rng, tensors

import cuengine as ce
from cuengine.kernels import encoder as E
from cuengine.kernels._build import kernel_dir
from cuengine.kernels.encoder import (
    encoder_backward,
    encoder_backward_np,
    encoder_backward_plan,
    encoder_backward_sum,
    encoder_forward,
    encoder_forward_np,
    encoder_scratch_shape,
)


def make(n, v, c, dout_dtype="fp32", dwte_dtype="fp32", seed=0):
    """tokens (1, n) drawn from a small vocabulary part so that ids repeat; dout, dwte in their dtypes."""
    r = rng(seed)
    tokens = r.integers(0, min(v, 50), (1, n)).astype(np.int32)  # many repeats
    tokens[0, ::7] = r.integers(0, v, tokens[0, ::7].shape)  # and a spread over the vocabulary
    dout = r.standard_normal((1, n, c)).astype(ce.dtype(dout_dtype).np)
    dwte = r.standard_normal((v, c)).astype(ce.dtype(dwte_dtype).np)
    return tokens, dout, dwte


def backward(dev, dwte, dout, tokens, scratch_fill=0):
    t = tensors(dev, dwte=dwte, dout=dout, tokens=tokens)
    shape = encoder_scratch_shape(*tokens.shape, dout.shape[-1])
    scratch = ce.Tensor.from_numpy(np.full(shape, scratch_fill, np.int32), dev)
    encoder_backward(t["dwte"], t["dout"], t["tokens"], scratch)
    return t["dwte"].numpy()


# ---- cpu: the twins against independent formulas ------------------------------------------------
def test_forward_twin_is_a_gather():
    tokens, _, wte = make(37, 300, 16)
    out = encoder_forward_np(tokens, wte)
    for i, tok in enumerate(tokens[0]):
        np.testing.assert_array_equal(out[0, i], wte[tok])


def test_forward_twin_owned_ranges_sum_to_the_whole_lookup():
    """Ranks owning [0, lo) and [lo, V*C) of the flat table (lo inside a row): each lookup keeps only
    its own elements, and the two add up to the whole one (what a ZeRO forward's reduce-scatter does)."""
    tokens, _, wte = make(53, 300, 16)
    lo = 41 * 16 + 8  # row 41 is split between the ranks
    tokens[0, :3] = 41
    first, second = (encoder_forward_np(tokens, wte, owned) for owned in ((0, lo), (lo, 300 * 16)))
    np.testing.assert_array_equal(first + second, encoder_forward_np(tokens, wte))
    np.testing.assert_array_equal(first[0, 0], np.r_[wte[41, :8], np.zeros(8, np.float32)])
    np.testing.assert_array_equal(second[0, 0], np.r_[np.zeros(8, np.float32), wte[41, 8:]])
    assert (first[0, tokens[0] >= 42] == 0).all() and (second[0, tokens[0] < 41] == 0).all()


@pytest.mark.parametrize("dwte_dtype", ["fp32", "bf16"])
def test_backward_twin_matches_float64(dwte_dtype):
    tokens, dout, dwte = make(199, 300, 16, dwte_dtype=dwte_dtype)
    want = dwte.astype(np.float64)
    np.add.at(want, tokens.reshape(-1), dout.reshape(-1, 16).astype(np.float64))
    assert_close(encoder_backward_np(dwte, dout, tokens), want, dwte_dtype, "dwte")


def test_backward_twin_sums_in_kernel_order():
    """A run of 6 positions: lanes get positions 0,4 / 1,5 / 2 / 3, added as ((p0 + p1) + p2) + p3."""
    vals = np.array([1e8, 1.0, -1e8, 3.0, 1.0, 0.5], np.float32)[:, None]  # order-sensitive in fp32
    got = encoder_backward_np(np.zeros((2, 1), np.float32), vals[None], np.ones((1, 6), np.int32))
    f = np.float32
    p = [f(f(1e8) + f(1.0)), f(f(1.0) + f(0.5)), f(-1e8), f(3.0)]
    assert got[1, 0] == f(f(f(p[0] + p[1]) + p[2]) + p[3]) and got[0, 0] == 0


def test_invalid_ids_are_skipped_and_give_zero_rows():
    tokens = np.array([[3, -1, 5, 9, 3]], np.int32)
    wte = np.arange(1, 41, dtype=np.float32).reshape(5, 8)
    out = encoder_forward_np(tokens, wte)
    np.testing.assert_array_equal(out[0, [1, 2, 3]], 0)
    np.testing.assert_array_equal(out[0, 0], wte[3])
    dout = np.ones((1, 5, 8), np.float32)
    dw = encoder_backward_np(np.zeros((5, 8), np.float32), dout, tokens)
    np.testing.assert_array_equal(dw[3], 2)
    assert dw.sum() == 16


# ---- launchers: both devices -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_forward(dev, dtype):
    tokens, _, wte = make(2 * 37, 300, 64, dwte_dtype=dtype)
    tokens = tokens.reshape(2, 37)
    tokens[1, 3] = 300  # out of range: a zero row, no out-of-bounds read
    t = tensors(dev, tokens=tokens, wte=wte, out=np.full((2, 37, 64), 7, ce.dtype(dtype).np))
    encoder_forward(t["out"], t["tokens"], t["wte"])
    np.testing.assert_array_equal(t["out"].numpy(), encoder_forward_np(tokens, wte))
    owned = (150 * 64 + 32, 250 * 64)  # a row split at a 16-byte boundary: its upper half is owned
    encoder_forward(t["out"], t["tokens"], t["wte"], owned=owned)
    np.testing.assert_array_equal(t["out"].numpy(), encoder_forward_np(tokens, wte, owned))
    assert 0 < np.count_nonzero(t["out"].numpy()) < t["out"].nelem


@pytest.mark.parametrize("dwte_dtype,dout_dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
def test_backward_accumulates(dev, dwte_dtype, dout_dtype):
    tokens, dout, dwte = make(2 * 19, 300, 32, dout_dtype, dwte_dtype, seed=1)
    tokens, dout = tokens.reshape(2, 19), dout.reshape(2, 19, 32)
    t = tensors(dev, dwte=dwte, dout=dout, tokens=tokens)
    scratch = ce.Tensor.empty(ce.INT32, encoder_scratch_shape(2, 19, 32), dev, name="scratch")
    encoder_backward(t["dwte"], t["dout"], t["tokens"], scratch)
    once = encoder_backward_np(dwte, dout, tokens)
    np.testing.assert_array_equal(t["dwte"].numpy(), once)  # the twin mirrors the kernel's order: same bits
    encoder_backward(t["dwte"], t["dout"], t["tokens"], scratch)
    np.testing.assert_array_equal(t["dwte"].numpy(), encoder_backward_np(once, dout, tokens))


def test_backward_plan_on_a_side_stream_then_sum(dev):
    """The model's form: the token plan on its own stream as soon as the tokens are there, the sum on
    the main stream behind an event, twice over one scratch (the second plan waits for the first sum):
    the bits of the one-call backward, on cpu and cuda; on cuda also from a graph that forks and joins."""
    tokens, dout, dwte = make(3 * 41, 300, 64, "bf16", "fp32", seed=4)
    tokens, dout = tokens.reshape(3, 41), dout.reshape(3, 41, 64)
    t = tensors(dev, dwte=dwte, dout=dout, tokens=tokens)
    scratch = ce.Tensor.empty(ce.INT32, encoder_scratch_shape(3, 41, 64), dev, name="scratch")
    side, fork, join = dev.new_stream(), dev.event(), dev.event()

    def step():
        side.wait(fork.record())
        encoder_backward_plan(scratch, t["tokens"], *dwte.shape, stream=side)
        side.record(join)
        dev.stream.wait(join)
        encoder_backward_sum(t["dwte"], t["dout"], t["tokens"], scratch)

    step()
    step()
    once = encoder_backward_np(dwte, dout, tokens)
    twice = encoder_backward_np(once, dout, tokens)
    np.testing.assert_array_equal(t["dwte"].numpy(), twice)
    graph = dev.capture(step)
    graph.launch()
    np.testing.assert_array_equal(t["dwte"].numpy(), encoder_backward_np(twice, dout, tokens))


def test_backward_sum_refuses_a_scratch_without_its_plan_on_cpu():
    """On cpu the plan records the tokens it was made for: a sum without a plan, or after a plan for
    other tokens, is refused and dwte is left as it was."""
    tokens, dout, dwte = make(40, 300, 16, seed=6)
    t = tensors("cpu", dwte=dwte, dout=dout, tokens=tokens)
    scratch = ce.Tensor.from_numpy(np.zeros(encoder_scratch_shape(1, 40, 16), np.int32), "cpu", name="scratch")
    with pytest.raises(ValueError, match="no plan for these tokens"):
        encoder_backward_sum(t["dwte"], t["dout"], t["tokens"], scratch)
    other = ce.Tensor.from_numpy(tokens[:, ::-1].copy(), "cpu")
    encoder_backward_plan(scratch, other, *dwte.shape)
    with pytest.raises(ValueError, match="no plan for these tokens"):
        encoder_backward_sum(t["dwte"], t["dout"], t["tokens"], scratch)
    np.testing.assert_array_equal(t["dwte"].numpy(), dwte)
    encoder_backward_plan(scratch, t["tokens"], *dwte.shape)
    encoder_backward_sum(t["dwte"], t["dout"], t["tokens"], scratch)
    np.testing.assert_array_equal(t["dwte"].numpy(), encoder_backward_np(dwte, dout, tokens))


def test_backward_skips_invalid_ids_without_touching_memory(dev):
    """dwte is a view between two guard rows; ids -1 and V must change neither."""
    v, c = 20, 16
    full = rng(2).standard_normal((v + 2, c)).astype(np.float32)
    buf = ce.Tensor.from_numpy(full, dev, name="buf")
    dwte = buf[1 : v + 1]
    tokens = np.array([[0, -1, v, v - 1, 5, -7, v + 100, 5]], np.int32)
    dout = rng(3).standard_normal((1, 8, c)).astype(np.float32)
    t = tensors(dev, dout=dout, tokens=tokens)
    scratch = ce.Tensor.empty(ce.INT32, encoder_scratch_shape(1, 8, c), dev, name="scratch")
    encoder_backward(dwte, t["dout"], t["tokens"], scratch)
    got = buf.numpy()
    np.testing.assert_array_equal(got[[0, -1]], full[[0, -1]])
    np.testing.assert_array_equal(got[1:-1], encoder_backward_np(full[1:-1], dout, tokens))


def test_scratch_shape():
    """8 counters, 4N hash slots of 8 ints (zeroed per call), the hot queue (N // 7 + 1), 2 ints per
    queued token, the item lists (queue + 2N // 128 + 1 tiles), a mark per position, then 16-byte aligned, a C-float
    partial row per tile."""

    def want(n, c):
        q, t = n // 7 + 1, 2 * n // 128 + 1
        lists = 8 + 32 * n + 4 * q + t + n  # ... + a mark per position
        return (-(-lists // 4) * 4 + t * c,)

    assert encoder_scratch_shape(1, 1, 8) == want(1, 8) == (56,)
    assert encoder_scratch_shape(8, 1024, 896) == want(8192, 896) == (275160 + 129 * 896,)
    assert encoder_scratch_shape(1, 2049, 4) == want(2049, 4)
    assert encoder_scratch_shape(4, 8192, 896) == encoder_scratch_shape(32768, 1, 896)  # only B * T matters


# ---- the backward kernels on the host (tests/kernel_emulator.py) ----------------------------------
# encoder.cu's warp votes, matches and int shuffles, bit counts, 32- and 64-bit integer atomics (the
# emulator runs blocks one after another: plain read-modify-writes, and fences are no-ops), loads
# through L2 (plain), float4 and the dependent-launch calls (no-ops), after common.cuh.
_EMU_HELPERS = r"""
struct alignas(16) int4 { int x, y, z, w; };
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline unsigned __ballot_sync(unsigned, int p) {
    WarpU& w = g_wu[threadIdx.x >> 5]; int l = lane_();
    w.u[l] = p != 0; wbar(); unsigned r = 0; for (int i = 0; i < 32; ++i) r |= w.u[i] << i; wbar(); return r;
}
inline int __shfl_sync(unsigned, int v, int src) {
    WarpU& w = g_wu[threadIdx.x >> 5]; int l = lane_();
    w.u[l] = (unsigned)v; wbar(); int r = (int)w.u[src & 31]; wbar(); return r;
}
inline int __shfl_up_sync(unsigned, int v, int d) {
    WarpU& w = g_wu[threadIdx.x >> 5]; int l = lane_();
    w.u[l] = (unsigned)v; wbar(); int r = l >= d ? (int)w.u[l - d] : v; wbar(); return r;
}
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int atomicCAS(int* p, int cmp, int v) { int o = *p; if (o == cmp) *p = v; return o; }
inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
using u64 = unsigned long long;
inline u64 atomicCAS(u64* p, u64 cmp, u64 v) { u64 o = *p; if (o == cmp) *p = v; return o; }
inline u64 atomicAdd(u64* p, u64 v) { u64 o = *p; *p = o + v; return o; }
#define __noinline__
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline unsigned __match_any_sync(unsigned, int v) {
    WarpU& w = g_wu[threadIdx.x >> 5]; int l = lane_();
    w.u[l] = (unsigned)v; wbar(); unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= (unsigned)(w.u[i] == (unsigned)v) << i;
    wbar(); return r;
}
"""


@pytest.fixture(scope="module")
def enc_lib(tmp_path_factory):
    src_dir = tmp_path_factory.mktemp("encoder_src")
    inc = '#include "common.cuh"'
    (src_dir / "encoder.cu").write_text((kernel_dir() / "encoder.cu").read_text().replace(inc, inc + _EMU_HELPERS))
    names = ["encoder_backward_clear", "encoder_backward_count", "encoder_backward_mark"] + [
        f"encoder_backward_sum_{g}_{d}" for g in ("f32", "bf16") for d in ("f32", "bf16")
    ]
    mp = pytest.MonkeyPatch()
    mp.setattr(emu, "kernel_dir", lambda: src_dir)
    try:
        return emu.or_skip(emu.build("encoder", names, tmp_path_factory.mktemp("encoder_emu")))
    finally:
        mp.undo()


def _emulated_backward(lib, monkeypatch, dwte, dout, tokens, fill=-7):
    """encoder_backward through its launcher with the kernels emulated; dwte after it, and whether
    nothing was written outside dwte and scratch."""
    calls = []

    def launch(family, name, grid, block, args, device, stream=None, shared_mem=0, dependent=False):
        calls.append(name)
        emu.launch(lib, family, name, grid, block, args, device, stream, shared_mem)

    monkeypatch.setattr(E, "launch", launch)
    t = {k: emu.tensor(v, v.dtype, k) for k, v in (("dwte", dwte), ("dout", dout), ("tokens", tokens))}
    shape = encoder_scratch_shape(*tokens.shape, dout.shape[-1])
    t["scratch"] = emu.tensor(np.full(shape, fill, np.int32), "int32", "scratch")
    encoder_backward(t["dwte"], t["dout"], t["tokens"], t["scratch"])
    assert calls[:3] == ["encoder_backward_clear", "encoder_backward_count", "encoder_backward_mark"], calls
    assert len(calls) == 4 and calls[3].startswith("encoder_backward_sum_"), calls
    return t["dwte"].numpy(), all(emu.margins_ok(x) for x in t.values())


@pytest.mark.parametrize("resident", [4, 1])
@pytest.mark.parametrize(
    "dwte_dtype,dout_dtype,c", [("bf16", "bf16", 1040), ("fp32", "fp32", 24), ("fp32", "bf16", 8), ("bf16", "fp32", 12)]
)
def test_emulated_backward_equals_the_twin(enc_lib, monkeypatch, dwte_dtype, dout_dtype, c, resident):
    """Tokens with 1..13 positions (inline: 1..6, hot: 7..13, each at several offsets), invalid ids,
    C over more than one 128-vector hot block (1040 bf16 = 130 vectors) and under one warp: the
    kernels' bits are the twin's, and nothing outside dwte and scratch is written. With one stream
    block per (emulated) SM, each stream thread takes its pairs in more than one round at 1040."""
    monkeypatch.setattr(E, "_RESIDENT", resident)
    r = rng(31)
    v = 40
    tokens = np.concatenate([np.full(n, 3 * n) for n in range(1, 14)] + [[-1, v, 0, 1, 2, v + 9]])
    tokens = r.permutation(tokens).astype(np.int32)[None]
    dout = r.standard_normal((1, tokens.size, c)).astype(ce.dtype(dout_dtype).np)
    dwte = r.standard_normal((v, c)).astype(ce.dtype(dwte_dtype).np)
    got, clean = _emulated_backward(enc_lib, monkeypatch, dwte, dout, tokens)
    np.testing.assert_array_equal(got.view(np.uint8), encoder_backward_np(dwte, dout, tokens).view(np.uint8))
    assert clean


def test_emulated_backward_spread_ids_and_signed_zeros(enc_lib, monkeypatch):
    """Ids spread over a large vocabulary (hash probing, several stream blocks), and -0.0 rows: the
    twin adds 0.f + d, so a -0.0 dwte plus a -0.0 dout gives +0.0."""
    r = rng(32)
    n, v, c = 300, 5000, 16
    tokens = r.integers(0, v - 10, (2, n // 2)).astype(np.int32)
    tokens[0, :3], tokens[1, 7] = v - 2, v - 1  # 3 positions (the few path), 1 position
    dout = r.standard_normal((2, n // 2, c)).astype(np.float32)
    dwte = r.standard_normal((v, c)).astype(np.float32)
    dout[0, :3], dout[1, 7], dwte[v - 2 :] = -0.0, -0.0, -0.0
    got, clean = _emulated_backward(enc_lib, monkeypatch, dwte, dout, tokens)
    want = encoder_backward_np(dwte, dout, tokens)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert clean and not np.signbit(got[v - 2 :]).any()


def test_emulated_backward_warp_groups(enc_lib, monkeypatch):
    """Ids repeated within a warp (the count kernel's lanes with one id take one atomic and ranks by
    lane): a run of 100 of one id over whole warps, an id on every other lane, an id in two lanes of
    many warps (5 inline positions spread, then hot), and singletons between them."""
    r = rng(33)
    run = np.full(100, 5)
    alt = np.where(np.arange(64) % 2 == 0, 9, 100 + np.arange(64))
    pairs = np.where(np.arange(96) % 16 < 2, 7, 300 + np.arange(96))
    tokens = np.concatenate([[1, 2, 3], run, alt, pairs, [5, 9, 7]]).astype(np.int32)[None]
    dout = r.standard_normal((1, tokens.size, 24)).astype(np.float32)
    dwte = r.standard_normal((400, 24)).astype(np.float32)
    got, clean = _emulated_backward(enc_lib, monkeypatch, dwte, dout, tokens)
    np.testing.assert_array_equal(got.view(np.uint8), encoder_backward_np(dwte, dout, tokens).view(np.uint8))
    assert clean


def _skewed_tokens(r, v):
    """Tokens for the big-token paths with _ROWS = 8: one id at 90 spread positions (11-12 tiles of
    width 32 out of 352, some empty), a run of 40 consecutive positions of one id (clustered: a single
    full tile), ids with 9..20 positions (2-3 tiles of width 160..320), medium ids (7, 8), few and single
    ones, and invalid ids."""
    parts = [np.full(90, 5), np.full(9, 6), np.full(13, 7), np.full(20, 8), np.full(7, 9), np.full(8, 10)]
    parts += [np.full(3, 11), [12, 13, 14, -1, v, v + 3, -5]]
    spread = r.permutation(np.concatenate(parts))
    n = spread.size + 40
    at = 100  # the clustered run sits between spread positions
    return np.concatenate([spread[:at], np.full(40, 15), spread[at:]]).astype(np.int32)[None], n


@pytest.mark.parametrize(
    "dwte_dtype,dout_dtype,c", [("bf16", "bf16", 1040), ("fp32", "fp32", 24), ("fp32", "bf16", 8), ("bf16", "fp32", 12)]
)
def test_emulated_big_tokens_by_tiles(enc_lib, monkeypatch, dwte_dtype, dout_dtype, c):
    """With _ROWS = 8 every token with more than 8 positions is summed by position tiles: tile partials
    in the scratch, the last tile's block adding them (with 2 channel chunks at 1040 bf16); the bits are
    the twin's and nothing outside dwte and scratch is written."""
    monkeypatch.setattr(E, "_ROWS", 8)
    r = rng(34)
    v = 40
    tokens, n = _skewed_tokens(r, v)
    assert tokens.size == n and E._tile_width(90, n) == 32 and E._tile_width(40, n) == 64
    dout = r.standard_normal((1, n, c)).astype(ce.dtype(dout_dtype).np)
    dwte = r.standard_normal((v, c)).astype(ce.dtype(dwte_dtype).np)
    got, clean = _emulated_backward(enc_lib, monkeypatch, dwte, dout, tokens)
    np.testing.assert_array_equal(got.view(np.uint8), encoder_backward_np(dwte, dout, tokens).view(np.uint8))
    assert clean


def test_emulated_random_distributions(enc_lib, monkeypatch):
    """Random sizes, vocabularies, Zipf / uniform-with-invalid / single-id tokens, _ROWS from _INLINE
    up and both hot-block settings, one or two channel chunks: the kernels' bits are the twin's."""
    r = np.random.default_rng(7)
    shapes = [(8, "fp32", "bf16"), (1040, "bf16", "bf16"), (12, "bf16", "fp32"), (520, "fp32", "fp32")]
    for case in range(6):
        monkeypatch.setattr(E, "_ROWS", int(r.choice([6, 7, 8, 16])))
        monkeypatch.setattr(E, "_HOT_PER_SM", case % 2)
        n, v = int(r.integers(1, 400)), int(r.integers(2, 60))
        tokens = [np.minimum(r.zipf(1.3, n) - 2, v + 1), r.integers(-2, v + 2, n), np.full(n, r.integers(0, v))]
        tokens = tokens[case % 3].astype(np.int32)[None]
        c, dwte_dtype, dout_dtype = shapes[int(r.integers(0, 4))]
        dout = r.standard_normal((1, n, c)).astype(ce.dtype(dout_dtype).np)
        dwte = r.standard_normal((v, c)).astype(ce.dtype(dwte_dtype).np)
        got, clean = _emulated_backward(enc_lib, monkeypatch, dwte, dout, tokens)
        want = encoder_backward_np(dwte, dout, tokens)
        assert clean and np.array_equal(got.view(np.uint8), want.view(np.uint8)), (case, E._ROWS, n, v, c)


def test_sorting_network_sorts():
    """The few path sorts a token's inline positions (kept in arrival order, which the emulator's
    one-block-at-a-time run never scrambles) with encoder.cu's comparators: by the 0-1 principle
    they sort every input if they sort all 2^6 inputs of zeros and ones."""
    import re

    src = (kernel_dir() / "encoder.cu").read_text()
    pairs = [(int(a), int(b)) for a, b in re.findall(r"sort2\(q\[(\d)\], q\[(\d)\]\)", src)]
    assert len(pairs) == 12, pairs
    for bits in range(64):
        q = [bits >> i & 1 for i in range(6)]
        for a, b in pairs:
            q[a], q[b] = min(q[a], q[b]), max(q[a], q[b])
        assert q == sorted(q), (bits, q)


# ---- errors --------------------------------------------------------------------------------------
def _t(shape, dtype=np.float32):
    return ce.Tensor.from_numpy(np.zeros(shape, dtype), "cpu", name="t")


I32, BF = np.int32, ce.BF16.np


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: encoder_forward(_t((2, 3, 8)), _t((2, 3)), _t((10, 8))), "tokens: expected dtype int32"),
        (lambda: encoder_forward(_t((2, 3, 8)), _t((2, 3), I32), _t((10, 8), I32)), "wte: expected dtype fp32/bf16"),
        (lambda: encoder_forward(_t((2, 4, 8)), _t((2, 3), I32), _t((10, 8))), r"out: expected shape \(2, 3, 8\)"),
        (lambda: encoder_forward(_t((2, 3, 8), BF), _t((2, 3), I32), _t((10, 8))), "out: expected dtype fp32"),
        (lambda: encoder_forward(_t((2, 3, 6)), _t((2, 3), I32), _t((10, 6))), "C = 6 must be a multiple of 4"),
        (lambda: encoder_forward(_t((2, 3, 8)), _t((2, 3), I32), _t(80)), r"wte: expected shape \(\*, \*\)"),
        (lambda: encoder_forward(_t((2, 3, 8)), _t((2, 3), I32), _t((10, 8)), owned=(2, 40)), "owned must be"),
        (lambda: encoder_forward(_t((2, 3, 8)), _t((2, 3), I32), _t((10, 8)), owned=(40, 84)), "owned must be"),
        (lambda: encoder_forward(_t((2, 3, 8)), _t((2, 3), I32), _t((10, 8)), owned=(40, 36)), "owned must be"),
        (lambda: encoder_backward(_t((10, 8)), _t((2, 3, 8)), _t((2, 3), I32), _t(7, I32)), "scratch: expected shape"),
        (  # one int short: the table's 4N slots are part of the size
            lambda: encoder_backward(
                _t((10, 8)), _t((2, 3, 8)), _t((2, 3), I32), _t(encoder_scratch_shape(2, 3, 8)[0] - 1, I32)
            ),
            "scratch: expected shape",
        ),
        (
            lambda: encoder_backward(_t((10, 8)), _t((2, 3, 8)), _t((2, 3), I32), _t(105)),
            "scratch: expected dtype int32",
        ),
        (lambda: encoder_backward(_t((10, 8)), _t((2, 3, 9)), _t((2, 3), I32), _t(105, I32)), "dout: expected shape"),
        (lambda: encoder_backward_plan(_t(7, I32), _t((2, 3), I32), 10, 8), "plan scratch: expected shape"),
        (lambda: encoder_backward_plan(_t(105, I32), _t((2, 3)), 10, 8), "plan tokens: expected dtype int32"),
        (lambda: encoder_backward_sum(_t((10, 8)), _t((2, 3, 8)), _t((2, 3), I32), _t(7, I32)), "scratch: expected"),
        (
            lambda: encoder_backward(
                _t((10, 12), BF), _t((2, 3, 12), BF), _t((2, 3), I32), _t(encoder_scratch_shape(2, 3, 12), I32)
            ),
            "C = 12 must",
        ),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_backward_refuses_more_vectors_than_32_bit_pair_indices(monkeypatch):
    """The sum indexes (position, vector) pairs in 32 bits: past the limit the call is refused before
    anything is written (the limit lowered here; the real one is 2^31 - 1 vectors)."""
    monkeypatch.setattr(E, "_MAX_PAIRS", 11)
    dwte = _t((10, 8))
    dout = ce.Tensor.from_numpy(np.ones((2, 3, 8), np.float32), "cpu")
    with pytest.raises(ValueError, match="12 16-byte vectors of dout; at most 11"):
        encoder_backward(dwte, dout, _t((2, 3), I32), _t(encoder_scratch_shape(2, 3, 8), I32))
    assert not dwte.numpy().any()
    monkeypatch.setattr(E, "_MAX_PAIRS", 12)
    encoder_backward(dwte, dout, _t((2, 3), I32), _t(encoder_scratch_shape(2, 3, 8), I32))
    assert dwte.numpy()[0].tolist() == [6.0] * 8  # at the limit: accepted


# ---- gpu: determinism, capture, and cuda against the twin ----------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["dwte", "scratch"])
def test_cuda_rejects_a_misaligned_view(cuda, which):
    """The hash-table kernels read dwte rows and scratch slots as 16-byte vectors: a view starting
    inside one is refused with the tensor's name, not read across its start."""
    n = encoder_scratch_shape(1, 6, 8)[0]
    flat_dwte = ce.Tensor.from_numpy(np.zeros(81, np.float32), cuda, name="dwte")
    flat_scratch = ce.Tensor.from_numpy(np.zeros(n + 1, np.int32), cuda, name="scratch")
    dout = ce.Tensor.from_numpy(np.zeros((1, 6, 8), np.float32), cuda, name="dout")
    tokens = ce.Tensor.from_numpy(np.zeros((1, 6), np.int32), cuda, name="tokens")
    shift = {"dwte": 1 if which == "dwte" else 0, "scratch": 1 if which == "scratch" else 0}  # 4 bytes in
    dwte = flat_dwte.rows(shift["dwte"], shift["dwte"] + 80).reshape(10, 8)
    scratch = flat_scratch.rows(shift["scratch"], shift["scratch"] + n)
    with pytest.raises(ValueError, match=f"{which}.* is not 16-byte aligned"):
        encoder_backward(dwte, dout, tokens, scratch)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dwte_dtype,dout_dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("fp32", "bf16")])
def test_cuda_matches_cpu(rows, dwte_dtype, dout_dtype):
    tokens, dout, dwte = make(rows, 1000, 896, dout_dtype, dwte_dtype, seed=rows)
    ins, scratch = {"dout": dout, "tokens": tokens}, {"scratch": ("int32", encoder_scratch_shape(1, rows, 896))}
    cpu, gpu = check_op(encoder_backward, ins, {"dwte": dwte}, scratch=scratch, repeat=True)
    assert_bitwise(gpu["dwte"], cpu["dwte"], "dwte")  # the twin mirrors the sum order
    cpu, gpu = check_op(encoder_forward, {"tokens": tokens, "wte": dwte}, {"out": np.zeros((1, rows, 896), dwte.dtype)})
    assert_bitwise(gpu["out"], cpu["out"], "out")


@pytest.mark.gpu
@pytest.mark.parametrize("v", [200, 50257, 151936, 262144])
@pytest.mark.parametrize("skew", ["one_token", "few_tokens", "spread"])
def test_cuda_deterministic(v, skew):
    """Bitwise-equal dwte across runs, with scratch garbage in between, on heavily repeated tokens."""
    n, c = 8 * 1024, 256
    r = rng(11)
    tokens = {"one_token": np.full(n, v - 1), "few_tokens": r.integers(0, 3, n), "spread": r.integers(0, v, n)}[skew]
    tokens = tokens.astype(np.int32).reshape(8, 1024)
    dout = r.standard_normal((8, 1024, c)).astype(ce.BF16.np)
    dwte = np.zeros((v, c), ce.BF16.np)
    runs = [backward(ce.device("cuda"), dwte, dout, tokens, scratch_fill=f) for f in (0, -1, 7)]
    for other in runs[1:]:
        np.testing.assert_array_equal(other.view(np.uint8), runs[0].view(np.uint8))
    np.testing.assert_array_equal(runs[0].view(np.uint8), encoder_backward_np(dwte, dout, tokens).view(np.uint8))


@pytest.mark.gpu
def test_cuda_backward_captures_into_a_graph(cuda):
    tokens, dout, dwte = make(1128, 50257, 896, "bf16", "fp32", seed=5)
    t = tensors(cuda, dwte=np.zeros_like(dwte), dout=dout, tokens=tokens)
    scratch = ce.Tensor.empty(ce.INT32, encoder_scratch_shape(1, 1128, 896), cuda, name="scratch")
    warm = ce.Tensor.empty(ce.FP32, dwte.shape, cuda, name="warm")  # loads the kernels before capturing
    encoder_backward(warm, t["dout"], t["tokens"], scratch)
    graph = cuda.capture(lambda: encoder_backward(t["dwte"], t["dout"], t["tokens"], scratch))
    assert not t["dwte"].numpy().any()  # captured, not run
    graph.launch()
    graph.launch()
    once = encoder_backward_np(np.zeros_like(dwte), dout, tokens)
    np.testing.assert_array_equal(t["dwte"].numpy(), encoder_backward_np(once, dout, tokens))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dwte_dtype,dout_dtype,c", [("bf16", "bf16", 1040), ("fp32", "fp32", 520), ("fp32", "bf16", 8)]
)
def test_cuda_every_run_length_and_offset(dwte_dtype, dout_dtype, c):
    """Tokens with 1..13 positions: one (the position's warp), 2..6 (summed by the first one's warp
    from the hash slot's positions) and 7..13 (hot: a whole block scans the tokens); C spans more than
    one 128-vector hot block with a partial last one (1040 bf16 = 130 vectors, 520 fp32 = 130) and
    less than one warp (8)."""
    r = rng(21)
    v = 40
    tokens = np.concatenate([np.full(n, 2 * n + 1) for n in range(1, 14)] + [[-1, v, 0, 0]])
    tokens = r.permutation(tokens).astype(np.int32)[None]  # positions interleave; runs stay by key
    dout = r.standard_normal((1, tokens.size, c)).astype(ce.dtype(dout_dtype).np)
    dwte = r.standard_normal((v, c)).astype(ce.dtype(dwte_dtype).np)
    gpu = backward(ce.device("cuda"), dwte, dout, tokens, scratch_fill=3)
    np.testing.assert_array_equal(gpu.view(np.uint8), encoder_backward_np(dwte, dout, tokens).view(np.uint8))


def _byte_corpus(n):
    """The first n bytes of the default training corpus (vocabulary 256): one byte (the space) is a
    quarter of them."""
    from cuengine import data

    return data.stdlib_tokens(data.stdlib_files()[0])[:n].astype(np.int32)


def _distribution(name):
    """(tokens (n,), V) of one named distribution: uniform over a 151936 vocabulary, Zipf, the byte
    corpus, one id everywhere, a run of 1024 of one id among uniform ones (a padded sequence), and
    ids outside [0, V) among skewed ones."""
    r, vq = rng(41), 151936
    if name == "uniform":
        return r.integers(0, vq, 32768), vq
    if name == "zipf":
        return np.minimum(r.zipf(1.2, 32768) - 1, vq - 1), vq
    if name.startswith("bytes"):
        return _byte_corpus(int(name[5:])), 256
    if name.startswith("one_id"):
        return np.full(int(name[6:]), 7), vq
    if name == "run":
        tokens = r.integers(0, vq, 32768)
        tokens[5000:6024] = 3
        return tokens, vq
    tokens = np.minimum(r.zipf(1.1, 8192) - 1, 299)  # "invalid": 300 ids, 15% of the positions outside
    bad = r.random(8192)
    tokens[bad < 0.1] = -1
    tokens[bad > 0.95] = 300 + np.arange(8192)[bad > 0.95] % 5
    return tokens, 300


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dist,dwte_dtype,dout_dtype",
    [
        ("bytes32768", "bf16", "bf16"),
        ("bytes32768", "fp32", "fp32"),  # 224 fp32 vectors a row: two channel chunks per tile
        ("bytes32768", "fp32", "bf16"),
        ("bytes8192", "bf16", "bf16"),
        ("one_id8192", "bf16", "bf16"),
        ("one_id32768", "fp32", "bf16"),
        ("zipf", "bf16", "bf16"),
        ("uniform", "bf16", "bf16"),
        ("run", "bf16", "bf16"),
        ("invalid", "fp32", "fp32"),
    ],
)
def test_cuda_skewed_ids_match_the_twin(dist, dwte_dtype, dout_dtype):
    """The distributions the hot path is for (big ids cut into position tiles, their partials added by
    the last tile's block), C = 896: cuda's dwte is the twin's bit for bit, from scratch garbage."""
    tokens, v = _distribution(dist)
    tokens = tokens.astype(np.int32)[None]
    r = rng(42)
    dout = (r.standard_normal((1, tokens.size, 896)) * 1e-2).astype(ce.dtype(dout_dtype).np)
    dwte = np.zeros((v, 896), ce.dtype(dwte_dtype).np)
    touched = np.unique(tokens[(tokens >= 0) & (tokens < v)])
    dwte[touched] = r.standard_normal((touched.size, 896))  # the rows that are added to (the rest stay 0)
    gpu = backward(ce.device("cuda"), dwte, dout, tokens, scratch_fill=-3)
    np.testing.assert_array_equal(gpu.view(np.uint8), encoder_backward_np(dwte, dout, tokens).view(np.uint8))
