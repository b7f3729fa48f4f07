"""Built-in optimizers beyond AdamW: TrainOptions(optimizer=...), adamw8bit's kernel against its
NumPy twin (same rounding, to the bit), its quantization error, memory, skipped steps,
checkpoints and bitwise-equal training across the recompute / graph flags.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_bitwise
from test_model import FLAG_SETS, batch, make, run_steps, tiny

import cuengine as ce
from cuengine import cli
from cuengine.kernels import _build, adamw, adamw8bit, muon, norm
from cuengine.model import LlamaModel, TrainOptions
from cuengine.model.adamw8bit import AdamW8bitState
from cuengine.model.muon import lr_scale, newton_schulz_reference

N = 1000  # four blocks, the last partial


def test_optimizer_option_is_validated_at_construction():
    assert TrainOptions().optimizer == "adamw"
    assert TrainOptions(optimizer="adamw8bit").optimizer == "adamw8bit"
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainOptions(optimizer="sgd")


def test_dynamic_maps_are_bitsandbytes():
    s, u = adamw8bit.dynamic_map(True), adamw8bit.dynamic_map(False)
    assert s.size == u.size == 256 and np.all(np.diff(s) > 0) and np.all(np.diff(u) > 0)
    assert s[127] == 0 and s[-1] == 1 and u[0] == 0 and u[-1] == 1
    assert np.isclose(s[128], 1e-6 * 0.55) and np.isclose(u[1], 1e-6 * (0.1 + 0.55) / 2)


def test_quantization_keeps_small_values_over_decades():
    """Within a block spanning 5 decades, no value above 1e-5 of the abs-max is zeroed (a linear
    int8 code zeroes everything below 1/254 of it), and the relative error stays bounded over the
    top 3 decades, where most of the update's weight is."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-5, 0, 4096)).astype(np.float32)
    for signed, vals in ((True, x), (False, x * x)):
        codes, amax = adamw8bit.quantize_reference(vals, signed)
        back = adamw8bit.dequantize_reference(codes, amax, signed)
        rel_size = np.abs(vals) / np.repeat(amax, 256)[: vals.size]
        assert np.all(back[rel_size > 1e-5] != 0)
        top = rel_size > 1e-3
        rel = np.abs(back - vals)[top] / np.abs(vals)[top]
        assert np.median(rel) < 0.05 and rel.max() < 0.3, (signed, np.median(rel), rel.max())


def _state(dev, pdtype, gdtype, n=N, seed=0):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32) * 0.1
    m = rng.standard_normal(n).astype(np.float32) * 1e-3
    v = (rng.standard_normal(n).astype(np.float32) * 1e-3) ** 2
    qm, am = adamw8bit.quantize_reference(m, True)
    qv, av = adamw8bit.quantize_reference(v, False)
    arrays = {"param": p.astype(ce.dtype(pdtype).np), "qm": qm, "qv": qv, "absmax_m": am, "absmax_v": av,
              "grad": (rng.standard_normal(n) * 1e-2).astype(ce.dtype(gdtype).np), "qmaps": adamw8bit.make_qmaps(),
              "hparams": adamw.make_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, 3),
              "scale": np.array([0.7], np.float32)}  # fmt: skip
    return {k: ce.Tensor.from_numpy(a, dev, name=k) for k, a in arrays.items()}, arrays


def _run(t, wd=True, seed=5):
    adamw8bit.adamw8bit_update(t["param"], t["grad"], t["qm"], t["qv"], t["absmax_m"], t["absmax_v"], t["qmaps"],
                               t["hparams"], t["scale"], wd, seed)  # fmt: skip


@pytest.mark.parametrize("pdtype,gdtype", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16")])
def test_kernel_matches_twin_bitwise(dev, pdtype, gdtype):
    t, a = _state(dev, pdtype, gdtype)
    _run(t)
    want = adamw8bit.adamw8bit_reference(a["param"], a["grad"], a["qm"], a["qv"], a["absmax_m"], a["absmax_v"],
                                         a["hparams"], a["scale"][0], True, 5)  # fmt: skip
    for name, w in zip(("param", "qm", "qv", "absmax_m", "absmax_v"), want):
        assert_bitwise(t[name].numpy(), w, name)
    assert not np.array_equal(t["param"].numpy(), a["param"])


@pytest.mark.parametrize("pdtype", ["fp32", "bf16"])
def test_update_is_adamw_on_dequantized_moments(pdtype):
    """The twin's update is adamw_reference's on the dequantized moments, the bf16 param rounded
    with the same draws; the new codes are those of the fp32 moments."""
    _, a = _state("cpu", pdtype, "fp32")
    p8, qm, qv, am, av = adamw8bit.adamw8bit_reference(a["param"], a["grad"], a["qm"], a["qv"], a["absmax_m"],
                                                       a["absmax_v"], a["hparams"], 0.7, True, 5)  # fmt: skip
    m = adamw8bit.dequantize_reference(a["qm"], a["absmax_m"], True)
    v = adamw8bit.dequantize_reference(a["qv"], a["absmax_v"], False)
    p, m2, v2 = adamw.adamw_reference(a["param"], a["grad"], m, v, a["hparams"], 0.7, True, 5)
    assert_bitwise(p8, p, "param")
    assert_bitwise(qm, adamw8bit.quantize_reference(m2, True)[0], "qm")
    assert_bitwise(av, adamw8bit.quantize_reference(v2, False)[1], "absmax_v")


def test_nan_clip_scale_writes_nothing(dev):
    t, a = _state(dev, "bf16", "bf16")
    t["scale"].copy_from_numpy(np.array([np.nan], np.float32))
    _run(t)
    for name in ("param", "qm", "qv", "absmax_m", "absmax_v"):
        assert_bitwise(t[name].numpy(), a[name], name)


def test_wrong_state_shapes_are_refused():
    t, _ = _state("cpu", "fp32", "fp32")
    t["absmax_m"] = ce.Tensor.from_numpy(np.zeros(3, np.float32), "cpu", name="absmax_m")
    with pytest.raises(ValueError, match="absmax_m"):
        _run(t)
    t, _ = _state("cpu", "fp32", "fp32")
    t["qv"] = ce.Tensor.from_numpy(np.zeros(N - 1, np.uint8), "cpu", name="qv")
    with pytest.raises(ValueError, match="qv"):
        _run(t)


MULTI_SIZES = [1000, 37, 0, 256, 8192 + 300]  # tails, below one block, empty (skipped), two launch blocks


def _multi_tensors(dev, pdtype="bf16", gdtype="bf16"):
    ts = [_state(dev, pdtype, gdtype, n, seed=k) for k, n in enumerate(MULTI_SIZES)]
    table = ce.Tensor.from_numpy(np.zeros(adamw8bit.multi_tensor_table_shape(MULTI_SIZES), np.uint8), dev, "table")
    return ts, table


def _table(table, ts, decays=None, seeds=None):
    roles = ("param", "grad", "qm", "qv", "absmax_m", "absmax_v")
    decays = [k % 2 == 0 for k in range(len(ts))] if decays is None else decays
    seeds = [5 + 7919 * k for k in range(len(ts))] if seeds is None else seeds
    return adamw8bit.AdamW8bitTable(table, *([t[r] for t, _ in ts] for r in roles), decays, seeds)


@pytest.mark.parametrize("pdtype,gdtype", [("bf16", "bf16"), ("fp32", "bf16")])
def test_multi_tensor_update_is_the_per_tensor_twin(pdtype, gdtype):
    """adamw8bit_update_multi's twin: every tensor as adamw8bit_reference with its own seed and decay flag."""
    ts, table = _multi_tensors("cpu", pdtype, gdtype)
    tab = _table(table, ts)
    assert len(tab.entries) == len(MULTI_SIZES) - 1 and tab.chunks == 1 + 1 + 1 + 2
    t0 = ts[0][0]
    adamw8bit.adamw8bit_update_multi(tab, t0["qmaps"], t0["hparams"], t0["scale"])
    for k, (t, a) in enumerate(ts):
        want = adamw8bit.adamw8bit_reference(a["param"], a["grad"], a["qm"], a["qv"], a["absmax_m"], a["absmax_v"],
                                             a["hparams"], a["scale"][0], k % 2 == 0, 5 + 7919 * k)  # fmt: skip
        for name, w in zip(("param", "qm", "qv", "absmax_m", "absmax_v"), want):
            assert_bitwise(t[name].numpy(), w, f"{name}{k}")


def test_multi_tensor_table_refuses_bad_input():
    ts, table = _multi_tensors("cpu")
    with pytest.raises(ValueError, match="no tensors"):
        adamw8bit.AdamW8bitTable(table, [], [], [], [], [], [], [], [])
    with pytest.raises(ValueError, match="seeds has 4 entries, params has 5"):
        _table(table, ts, seeds=[1, 2, 3, 4])
    mixed, _ = _multi_tensors("cpu", "fp32")
    with pytest.raises(ValueError, match="one dtype per role"):
        _table(table, ts[:1] + mixed[1:])
    bad = dict(ts[1][0], absmax_v=ce.Tensor.from_numpy(np.zeros(2, np.float32), "cpu", name="absmax_v"))
    with pytest.raises(ValueError, match="absmax_v"):
        _table(table, [ts[0], (bad, ts[1][1]), *ts[2:]])
    small = ce.Tensor.from_numpy(np.zeros(table.nelem - 1, np.uint8), "cpu", name="table")
    with pytest.raises(ValueError, match="table"):
        _table(small, ts)


# ---- adamw8bit_multi's quantization (quantize_bucket: a bucket table and one comparison) at its edges ----
def _edge_values() -> np.ndarray:
    """fp32 values in [-1, 1] where a bucketed search could pick another code than the binary search:
    every midpoint of both maps and its neighbours, both ends of every bucket, the clamps, zeros,
    subnormals; each of them and its square root, with both signs."""
    q = adamw8bit.make_qmaps()
    mids = np.concatenate([q[256:511], q[768:1023]])
    t = np.arange(adamw8bit._BFIRST, adamw8bit._BFIRST + adamw8bit.BUCKET_HALF + 1, dtype=np.uint32)
    edges = (t << adamw8bit.BUCKET_SHIFT).view(np.float32)
    up, down = np.float32(2), np.float32(-2)
    v = np.concatenate([mids, np.nextafter(mids, up), np.nextafter(mids, down), edges, np.nextafter(edges, down),
                        np.float32([0, 1e-30, 1e-45, 2**-23, 0.99999994])]).astype(np.float32)  # fmt: skip
    v = np.abs(v[np.abs(v) <= 1])
    v = np.concatenate([v, np.sqrt(v)])
    return np.concatenate([v, -v, np.float32([-0.0])]).astype(np.float32)


def _bucket_search(x: np.ndarray, signed: bool) -> np.ndarray:
    """quantize_bucket of adamw8bit.cu in NumPy: the bucket's count, plus one comparison."""
    q = adamw8bit.make_qmaps()
    mids = q[256:512] if signed else q[768:1024]
    b = adamw8bit.make_buckets()[(0 if signed else 2) * adamw8bit.BUCKET_HALF :]
    ax = np.fmax(np.fmin(np.abs(x), np.float32(1)), np.float32(2.0**-23))
    j = (ax.view(np.uint32) >> adamw8bit.BUCKET_SHIFT).astype(np.int64) - adamw8bit._BFIRST
    j += np.where(x >= 0, 0, adamw8bit.BUCKET_HALF)
    lo = b[j].astype(np.int64)
    return (lo + (mids[lo] < x)).astype(np.uint8)


@pytest.mark.parametrize("signed", [True, False])
def test_bucket_table_gives_the_binary_search_codes(signed):
    """make_buckets: the bucket's count plus one comparison is the number of midpoints below x (0 for NaN)."""
    q = adamw8bit.make_qmaps()
    mids = q[256:511] if signed else q[768:1023]
    x = np.concatenate([_edge_values(), np.random.default_rng(0).uniform(-1, 1, 100000).astype(np.float32),
                        np.float32([np.inf, -np.inf, 3.0, -3.0, np.nan, -np.nan])])  # fmt: skip
    want = np.searchsorted(mids, x, side="left").astype(np.uint8)
    want[np.isnan(x)] = 0  # the kernels' binary search: every comparison with a NaN is false
    np.testing.assert_array_equal(_bucket_search(x, signed), want)
    src = (_build.kernel_dir() / "adamw8bit.cu").read_text()
    for name, value in (("BSHIFT", adamw8bit.BUCKET_SHIFT), ("BFIRST", f"({adamw8bit._BFIRST >> 7} << 7)"),
                        ("BHALF", adamw8bit.BUCKET_HALF), ("BBYTES", adamw8bit.BUCKET_BYTES)):  # fmt: skip
        assert f"#define {name} {value}" in src, name


@pytest.fixture(scope="module")
def a8_emu(tmp_path_factory):
    """(kernel_emulator, its launch) for adamw8bit.cu on the host."""
    import kernel_emulator as emu

    return emu, emu.or_skip(emu.adamw8bit_launcher(tmp_path_factory.mktemp("adamw8bit_edges")))


def _edge_moments():
    """Gradients (with beta1 = beta2 = 0 and a unit abs-max per block, m / absmax is the gradient and v / absmax
    its square, exactly) over the edge values, and a tensor of NaNs and infinities."""
    g = _edge_values()
    g = np.insert(g, np.arange(0, g.size, 255), np.float32(1))  # a 1 leads every block of 256
    rng = np.random.default_rng(3)
    bad = rng.uniform(-1, 1, 700).astype(np.float32)
    bad[[0, 5, 300, 301, 600]] = [np.nan, np.inf, -np.inf, np.nan, -np.nan]
    return [g, bad]


def _check_edges(make, pdtype, aligned, margins_ok=None):
    """The multi-tensor kernel against the per-tensor one (and the twin where all is finite) on the edge
    moments; `make(array, dtype, name, shift)` puts an array on the device `shift` bytes off 16-byte alignment."""
    grads = _edge_moments()
    hp = adamw.make_hparams(1e-2, 0.0, 0.0, 1e-8, 0.1, 1)
    shared = {"qmaps": make(adamw8bit.make_qmaps(), "fp32", "qmaps", 0), "hparams": make(hp, "fp32", "hp", 0),
              "scale": make(np.float32([1]), "fp32", "scale", 0)}  # fmt: skip
    roles = ("param", "grad", "qm", "qv", "absmax_m", "absmax_v")
    arrays = []
    for k, g in enumerate(grads):
        rng = np.random.default_rng(k)
        qm, am = adamw8bit.quantize_reference(rng.standard_normal(g.size).astype(np.float32), True)
        qv, av = adamw8bit.quantize_reference(rng.random(g.size).astype(np.float32), False)
        p = (rng.standard_normal(g.size) * 0.1).astype(ce.dtype(pdtype).np)
        arrays.append({"param": p, "grad": g, "qm": qm, "qv": qv, "absmax_m": am, "absmax_v": av})

    def tensors(shift):  # shift: bytes off 16-byte alignment for param, grad and the codes
        dt = {"param": pdtype, "grad": "fp32", "qm": "u8", "qv": "u8"}
        return [{r: make(a[r], dt.get(r, "fp32"), f"{r}{k}", shift if r in dt else 0) for r in roles}
                for k, a in enumerate(arrays)]  # fmt: skip

    single, multi = tensors(0), tensors(0 if aligned else 4)
    for k, t in enumerate(single):
        adamw8bit.adamw8bit_update(*(t[r] for r in roles), shared["qmaps"], shared["hparams"], shared["scale"],
                                   k == 0, 7 + k)  # fmt: skip
    table = make(np.zeros(adamw8bit.multi_tensor_table_shape([g.size for g in grads]), np.uint8), "u8", "table", 0)
    tab = adamw8bit.AdamW8bitTable(table, *([t[r] for t in multi] for r in roles), [True, False], [7, 8])
    records = np.frombuffer(table.numpy()[: 2 * adamw8bit._RECORD.itemsize].tobytes(), adamw8bit._RECORD)
    assert [bool(r["vec"]) for r in records] == [aligned] * 2
    adamw8bit.adamw8bit_update_multi(tab, shared["qmaps"], shared["hparams"], shared["scale"])
    for k, (s, m, a) in enumerate(zip(single, multi, arrays)):
        want = adamw8bit.adamw8bit_reference(*(a[r] for r in roles), hp, np.float32(1), k == 0, 7 + k)
        for r, w in zip(("param", "qm", "qv", "absmax_m", "absmax_v"), want):
            assert margins_ok is None or margins_ok(m[r]), f"{r}{k}: written out of bounds"
            assert_bitwise(m[r].numpy(), s[r].numpy(), f"{r}{k}")
            if k == 0:
                assert_bitwise(m[r].numpy(), w, f"twin {r}{k}")
    assert len(np.unique(multi[0]["qm"].numpy())) == 256 and len(np.unique(multi[0]["qv"].numpy())) > 200


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("pdtype", ["bf16", "fp32"])
def test_emulated_multi_quantization_edges_are_the_per_tensor_codes(a8_emu, monkeypatch, pdtype, aligned):
    """The multi-tensor kernel (bucket search; rows as 16-byte words, or element by element when the
    tensors are not aligned) writes the codes, abs-maxes and params of the per-tensor kernel (binary
    search) at every midpoint, bucket end, zero, NaN and infinity, and the twin's where all is finite."""
    emu, launch = a8_emu
    monkeypatch.setattr(_build, "launch", launch)
    _check_edges(lambda a, dt, name, shift: emu.tensor(a, dt, name, pad=4096 + shift), pdtype, aligned, emu.margins_ok)


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("pdtype", ["bf16", "fp32"])
def test_multi_quantization_edges_are_the_per_tensor_codes_on_gpu(pdtype, aligned):
    """As the emulated test, on the GPU (its rcp/sqrt/division fast paths and its min/max)."""

    def make(a, dt, name, shift):
        a = np.asarray(a).astype(ce.dtype(dt).np).reshape(-1)
        k = shift // a.itemsize
        t = ce.Tensor.from_numpy(np.concatenate([np.zeros(k, a.dtype), a]), "cuda", name=name)
        return t.rows(k, k + a.size)

    _check_edges(make, pdtype, aligned)


def _count_updates(monkeypatch):
    """{"multi": calls of adamw8bit_update_multi, "single": calls of adamw8bit_update not made by it,
    "norm_multi" / "norm_single": calls of the multi-tensor and the per-tensor global norm}."""
    seen = {"multi": 0, "single": 0, "inside": False, "norm_multi": 0, "norm_single": 0}

    def counting(f, key):
        def counted(*a, **kw):
            seen[key] += 1
            f(*a, **kw)

        return counted

    monkeypatch.setattr(adamw, "global_norm_squared_multi", counting(adamw.global_norm_squared_multi, "norm_multi"))
    monkeypatch.setattr(norm, "global_norm_squared", counting(norm.global_norm_squared, "norm_single"))
    multi, single = adamw8bit.adamw8bit_update_multi, adamw8bit.adamw8bit_update

    def count_multi(*a, **kw):
        seen["multi"] += 1
        seen["inside"] = True
        try:
            multi(*a, **kw)
        finally:
            seen["inside"] = False

    def count_single(*a, **kw):
        seen["single"] += not seen["inside"]
        single(*a, **kw)

    monkeypatch.setattr(adamw8bit, "adamw8bit_update_multi", count_multi)
    monkeypatch.setattr(adamw8bit, "adamw8bit_update", count_single)
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3", "use_cuda_graphs": True}])
def test_model_multi_tensor_update_is_bitwise_the_per_tensor_one(monkeypatch, opts, device):
    """Three steps of the one-GPU model: the multi-tensor update (one call per step; the emulator test
    checks that a call is one launch) leaves the weights, codes and abs-maxes of one launch per tensor."""
    cfg = tiny("tiny")
    seen = _count_updates(monkeypatch)
    a = make(cfg, device, optimizer="adamw8bit", **opts)
    b = make(cfg, device, optimizer="adamw8bit", **opts)
    assert a.opt_state.multi_tensor
    b.opt_state.multi_tensor = False
    k = len(b.opt_state.specs)
    graphs = opts.get("use_cuda_graphs", False) and device == "cuda"
    for s in range(3):
        multi, single, norm_multi = seen["multi"], seen["single"], seen["norm_multi"]
        la = a.train_step(*batch(cfg, seed=s), lr=1e-3)
        # one multi-tensor call, no per-tensor one, for the update and for the global norm; a step
        # replayed from its CUDA graph calls nothing
        assert seen["single"] == single and seen["multi"] - multi in ((0, 1) if graphs else (1,))
        assert seen["norm_single"] == 0 and seen["norm_multi"] - norm_multi == seen["multi"] - multi
        multi = seen["multi"]
        lb = b.train_step(*batch(cfg, seed=s), lr=1e-3)
        assert seen["multi"] == multi and seen["single"] - single in ((0, k) if graphs else (k,)) and la == lb
    assert seen["multi"] >= 1
    for k, w in a.weights.tensors.items():
        assert_bitwise(w.numpy(), b.weights.tensors[k].numpy(), k)
    for k, t in a.opt_state.state_tensors().items():
        assert_bitwise(t.numpy(), b.opt_state.state_tensors()[k].numpy(), k)


@pytest.mark.gpu
@pytest.mark.parametrize("pdtype,gdtype", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")])
@pytest.mark.parametrize("scale", [0.7, np.nan])
def test_multi_tensor_kernel_equals_per_tensor_kernels_on_gpu(pdtype, gdtype, scale):
    """On the GPU: one adamw8bit_multi launch gives the bits of one adamw8bit launch per tensor and of the twin."""
    ts, table = _multi_tensors("cuda", pdtype, gdtype)
    single, _ = _multi_tensors("cuda", pdtype, gdtype)
    for t, _ in (*ts, *single):
        t["scale"].copy_from_numpy(np.array([scale], np.float32))
    adamw8bit.adamw8bit_update_multi(_table(table, ts), ts[0][0]["qmaps"], ts[0][0]["hparams"], ts[0][0]["scale"])
    for k, (t, _) in enumerate(single):
        _run(t, wd=k % 2 == 0, seed=5 + 7919 * k)
    for k, ((m, a), (t, _)) in enumerate(zip(ts, single)):
        want = adamw8bit.adamw8bit_reference(a["param"], a["grad"], a["qm"], a["qv"], a["absmax_m"], a["absmax_v"],
                                             a["hparams"], np.float32(scale), k % 2 == 0, 5 + 7919 * k)  # fmt: skip
        for name, w in zip(("param", "qm", "qv", "absmax_m", "absmax_v"), want):
            assert_bitwise(m[name].numpy(), t[name].numpy(), f"{name}{k}")
            assert_bitwise(m[name].numpy(), w, f"twin {name}{k}")


def test_optimizer_memory_is_over_3x_smaller():
    cfg = tiny("tiny", hidden_size=256, head_size=64, intermediate_size=512)
    fp32 = make(cfg).memory_report().by_context["Optimizer"][0]
    q8 = make(cfg, optimizer="adamw8bit").memory_report().by_context["Optimizer"][0]
    assert isinstance(make(cfg, optimizer="adamw8bit").opt_state, AdamW8bitState)
    assert fp32 >= 3 * q8, (fp32, q8)


def test_adamw8bit_trains_close_to_adamw():
    cfg = tiny("tiny")
    x, y = batch(cfg, seed=42)
    final = {}
    for opt in ("adamw", "adamw8bit"):
        m = make(cfg, optimizer=opt)
        losses = [m.train_step(x, y, lr=3e-3) for _ in range(30)]
        assert losses[-1] < 0.7 * losses[0], (opt, losses[0], losses[-1])
        final[opt] = losses[-1]
    assert abs(final["adamw8bit"] - final["adamw"]) < 0.05 * final["adamw"], final


NEW_OPTIMIZERS = ["adamw8bit", "muon"]
PRECISIONS = {"bf16": {}, "fp8": {"matmul_dtype": "e4m3"}}


@pytest.fixture(scope="module")
def baselines():
    out = {}
    for opt in NEW_OPTIMIZERS:
        for name, opts in PRECISIONS.items():
            m, losses, norms = run_steps(tiny("tiny"), optimizer=opt, **opts)
            out[opt, name] = losses, norms, {k: v.numpy() for k, v in m.weights.tensors.items()}
    return out


@pytest.mark.parametrize("optimizer", NEW_OPTIMIZERS)
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize(
    "flags", FLAG_SETS[::2] + [FLAG_SETS[9]], ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items())
)
def test_flags_bitwise(flags, precision, optimizer, baselines):
    """Recompute, offload, chunking and CUDA-graph flags give the baseline's losses, norms and weights bitwise."""
    base_losses, base_norms, base_w = baselines[optimizer, precision]
    m, losses, norms = run_steps(tiny("tiny"), optimizer=optimizer, **flags, **PRECISIONS[precision])
    assert losses == base_losses
    assert [n.tobytes() for n in norms] == [n.tobytes() for n in base_norms]
    for k, w in m.weights.tensors.items():
        assert_bitwise(w.numpy(), base_w[k], k)


@pytest.mark.parametrize("optimizer", NEW_OPTIMIZERS)
@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3", "use_cuda_graphs": True}])
def test_checkpoint_resume_is_bitwise(tmp_path, opts, optimizer):
    cfg = tiny("tiny")
    a = make(cfg, optimizer=optimizer, **opts)
    for s in range(3):
        a.train_step(*batch(cfg, seed=s), lr=1e-3)
    a.save_checkpoint(tmp_path / "ckpt")
    want = [a.train_step(*batch(cfg, seed=s), lr=1e-3) for s in range(3, 6)]
    b = make(cfg, seed=99, optimizer=optimizer, **opts)
    b.load_checkpoint(tmp_path / "ckpt")
    got = [b.train_step(*batch(cfg, seed=s), lr=1e-3) for s in range(3, 6)]
    assert got == want
    for k, t in a.opt_state.state_tensors().items():
        assert_bitwise(b.opt_state.state_tensors()[k].numpy(), t.numpy(), k)
    c = make(cfg, **opts)  # AdamW: another optimizer's state is refused, nothing changes
    with pytest.raises(ValueError, match="does not match this model"):
        c.load_checkpoint(tmp_path / "ckpt")


# ---- muon -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (32, 256)])
def test_newton_schulz_is_near_the_svd_orthogonalization(shape):
    """5 quintic steps leave the singular values in roughly [0.7, 1.2] (the method's known band, not
    exactly 1); so X is within that of U Vᵀ. The bf16 pipeline of matmuls and kernels (cpu twin)
    follows the float64 method."""
    g = np.random.default_rng(1).standard_normal(shape)
    x = newton_schulz_reference(g)
    s = np.linalg.svd(x, compute_uv=False)
    assert s.min() > 0.65 and s.max() < 1.2, (s.min(), s.max())
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    uv = u @ vt
    assert np.linalg.norm(x - uv) < 0.35 * np.linalg.norm(uv)
    assert not np.allclose(x, uv, atol=0.05)  # approximate, as the method is
    m = make(tiny("tiny", hidden_size=256, head_size=64, intermediate_size=256), optimizer="muon")
    st = m.opt_state
    gt = st.g.rows(0, g.size).reshape(*shape)
    gt.copy_from_numpy(g.astype(np.float32))
    xt = st.x.rows(0, g.size).reshape(*shape)
    st.orthogonalize(xt, gt)
    got = xt.numpy().astype(np.float64)
    assert np.linalg.norm(got - x) < 0.03 * np.linalg.norm(x)


def test_muon_update_matches_numpy():
    """One step on an fp32 model: each HF view of a block matrix (q, k, v, gate and up separately)
    moves by lr (wd W + 0.2 sqrt(max(r, c)) NS(u)), u = g + mu g (Nesterov from a zero buffer), with
    NS the state's own bf16 Newton–Schulz (the float64 method is compared in the test above; on a
    rank-32 gradient, bf16 noise in the near-null directions is where they differ); the rest is AdamW."""
    cfg = tiny("tiny-llama", dtype="fp32")
    m = make(cfg, optimizer="muon", grad_clip=0.0, weight_decay=0.1, beta1=0.8, beta2=0.9, eps=1e-6)
    x, y = batch(cfg)
    p0 = {k: v.numpy().copy() for k, v in m.parameters().items()}
    m.forward(x)
    m.backward(x, y)
    g = {k: v.numpy().copy() for k, v in m.gradients().items()}
    m.update(lr=1e-2)
    p1 = {k: v.numpy() for k, v in m.parameters().items()}
    st, f32 = m.opt_state, np.float32
    mats = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
            "down_proj.weight")  # fmt: skip
    seen = 0
    for k, gk in g.items():
        if k.endswith(mats):
            shape = gk.shape
            gt = st.g.rows(0, gk.size).reshape(*shape)
            gt.copy_from_numpy(gk + f32(0.95) * gk)
            xt = st.x.rows(0, gk.size).reshape(*shape)
            st.orthogonalize(xt, gt)
            o = xt.numpy().astype(f32)
            want = p0[k] - f32(1e-2) * (f32(0.1) * p0[k] + f32(lr_scale(*shape)) * o)
            np.testing.assert_allclose(p1[k], want, rtol=1e-6, atol=1e-7, err_msg=k)
            seen += 1
        else:
            gk = gk.astype(np.float64)
            decay = 0.0 if ("norm" in k or k.endswith("bias")) else 0.1
            want = p0[k] - 1e-2 * (gk / (np.abs(gk) + 1e-6) + decay * p0[k])
            np.testing.assert_allclose(p1[k], want, rtol=1e-4, atol=2e-5, err_msg=k)
    assert seen == 7 * cfg.num_layers


def test_muon_lr_scale_is_moonlights():
    assert lr_scale(896, 4864) == pytest.approx(0.2 * 4864**0.5)
    assert lr_scale(64, 16) == lr_scale(16, 64) == pytest.approx(1.6)


def test_muon_trains_and_nan_clip_scale_writes_nothing():
    cfg = tiny("tiny")
    x, y = batch(cfg, seed=42)
    m = make(cfg, optimizer="muon")
    losses = [m.train_step(x, y, lr=3e-3) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0]
    m.forward(x)
    m.backward(x, y)
    before = {k: t.numpy().copy() for k, t in (*m.weights.tensors.items(), *m.opt_state.state_tensors().items())}
    next(iter(m.grads.values())).array()[0, 0] = np.inf
    m.update(lr=3e-3)
    for k, t in (*m.weights.tensors.items(), *m.opt_state.state_tensors().items()):
        assert_bitwise(t.numpy(), before[k], k)


def test_muon_state_is_momentum_for_matrices_and_moments_for_the_rest():
    m = make(tiny("tiny"), optimizer="muon", muon_momentum=0.9)
    keys = set(m.opt_state.state_tensors())
    assert "buf.layers.0.qkv_w" in keys and "m.layers.0.qkv_w" not in keys
    assert {"m.wte", "v.wte", "m.layers.1.ln2_w", "m.layers.0.qkv_b"} <= keys
    with pytest.raises(ValueError, match="muon_momentum"):
        TrainOptions(muon_momentum=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3"}])
@pytest.mark.parametrize("optimizer", NEW_OPTIMIZERS)
def test_gpu_flags_bitwise_and_close_to_cpu(opts, optimizer):
    """The flags are bitwise on the GPU; the losses follow the cpu's."""
    cfg = tiny("tiny-hs64")
    _, base, base_n = run_steps(cfg, device="cuda", optimizer=optimizer, **opts)
    for flags in FLAG_SETS:
        _, losses, norms = run_steps(cfg, device="cuda", optimizer=optimizer, **flags, **opts)
        assert losses == base and [n.tobytes() for n in norms] == [n.tobytes() for n in base_n], flags
    _, cpu, _ = run_steps(cfg, device="cpu", optimizer=optimizer, **opts)
    np.testing.assert_allclose(base, cpu, rtol=2e-2)


def test_cli_optimizer_reaches_the_model(tmp_path, monkeypatch, capsys):
    seen = []
    init = LlamaModel.__init__

    def spy(self, cfg, opts=None, *args, **kwargs):
        seen.append(opts.optimizer)
        init(self, cfg, opts, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "__init__", spy)
    fast = ["--device", "cpu", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--sample-tokens", "0"]
    assert cli.main(["train", *fast, "--steps", "1", "--optimizer", "adamw8bit", "--out", str(tmp_path / "run")]) == 0
    assert seen and set(seen) == {"adamw8bit"}
    assert cli.main(["train", *fast, "--steps", "1", "--optimizer", "sgd", "--out", str(tmp_path / "r2")]) != 0
    assert "optimizer must be one of" in capsys.readouterr().err


def test_bench_reports_update_time_and_optimizer_memory():
    from cuengine.bench_train import bench_train_step

    cfg = tiny("tiny")
    r = bench_train_step(cfg, TrainOptions(optimizer="adamw8bit"), ce.device("cpu"), 2, 16, steps=1, warmup=1)
    assert r["update_ms"] > 0 and r["report"].by_context["Optimizer"][0] > 0


@pytest.mark.gpu
def test_gpu_200_steps_of_the_embedded_corpus(tmp_path):
    """`cuengine train`'s default model and corpus, 200 steps each: adamw8bit's loss (mean of the last
    20 steps) within 1% of AdamW's; Muon's printed for the benchmark table and below AdamW's start."""
    import json

    final = {}
    for opt in ("adamw", "adamw8bit", "muon"):
        out = tmp_path / opt
        assert cli.main(["train", "--device", "cuda", "--steps", "200", "--optimizer", opt, "--eval-every", "0",
                         "--sample-tokens", "0", "--out", str(out)]) == 0  # fmt: skip
        losses = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
        final[opt] = float(np.mean(losses[-20:]))
        assert final[opt] < 0.8 * losses[0], (opt, losses[0], final[opt])
    print("loss after 200 steps:", final)
    assert abs(final["adamw8bit"] - final["adamw"]) <= 0.01 * final["adamw"], final


@pytest.mark.parametrize("pdtype", ["fp32", "bf16"])
def test_muon_kernels_match_their_twins(dev, pdtype):
    """Each Muon kernel against the NumPy twin on the cpu, bitwise (elementwise fp32 with the same
    rounding points); on the cpu this checks the formulas against NumPy written out here."""
    rng = np.random.default_rng(3)
    n, f32, bf = 1000, np.float32, ce.dtype("bf16").np
    buf0 = rng.standard_normal(n).astype(f32)
    grad0 = rng.standard_normal(n).astype(ce.dtype(pdtype).np)
    hp = adamw.make_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, 7)
    hp[6] = 0.95
    t = {"buf": buf0, "out": np.zeros(n, f32), "grad": grad0, "hp": hp, "gs": np.array([0.5], f32),
         "x": rng.standard_normal(n).astype(bf), "y": rng.standard_normal(n).astype(bf), "z": np.zeros(n, bf),
         "res": np.array([3.0, 1.0], f32), "p": (rng.standard_normal(n) * 0.1).astype(ce.dtype(pdtype).np)}  # fmt: skip
    d = {k: ce.Tensor.from_numpy(a, dev, name=k) for k, a in t.items()}
    muon.muon_momentum(d["buf"], d["out"], d["grad"], d["hp"], d["gs"])
    g = grad0.astype(f32) * f32(0.5)
    b = f32(0.95) * buf0 + g
    assert_bitwise(d["buf"].numpy(), b, "buf")
    assert_bitwise(d["out"].numpy(), g + f32(0.95) * b, "out")
    muon.muon_normalize(d["z"], d["out"], d["res"])
    assert_bitwise(d["z"].numpy(), ((g + f32(0.95) * b) / (f32(3.0) + f32(1e-7))).astype(bf), "normalize")
    muon.muon_axpby(d["x"], d["x"], d["y"], 3.4445, -4.775)
    want_x = (f32(3.4445) * t["x"].astype(f32) + f32(-4.775) * t["y"].astype(f32)).astype(bf)
    assert_bitwise(d["x"].numpy(), want_x, "axpby")
    muon.muon_apply(d["p"], d["x"], d["hp"], d["gs"], 1.6, 11, 256)
    p = t["p"].astype(f32)
    p = p - f32(1e-2) * (f32(0.1) * p + f32(1.6) * want_x.astype(f32))
    want_p = adamw.stochastic_round_bf16(p, adamw.sr_bits(11, 7, 0, np.arange(256, 256 + n))) if pdtype == "bf16" else p
    assert_bitwise(d["p"].numpy(), want_p, "apply")
    d["gs"].copy_from_numpy(np.array([np.nan], f32))
    before = d["p"].numpy().copy(), d["buf"].numpy().copy()
    muon.muon_momentum(d["buf"], d["out"], d["grad"], d["hp"], d["gs"])
    muon.muon_apply(d["p"], d["x"], d["hp"], d["gs"], 1.6, 11, 256)
    assert_bitwise(d["p"].numpy(), before[0], "skipped apply")
    assert_bitwise(d["buf"].numpy(), before[1], "skipped momentum")
