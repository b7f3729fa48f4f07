"""Built-in optimizers beyond AdamW: TrainOptions(optimizer=...), adamw8bit's kernel against its
NumPy twin (same rounding, to the bit), its quantization error, memory, skipped steps,
checkpoints and bitwise-equal training across the recompute / graph flags.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICES, assert_bitwise
from test_model import FLAG_SETS, batch, make, run_steps, tiny

import cuengine as ce
from cuengine import cli
from cuengine.kernels import adamw, adamw8bit
from cuengine.model import LlamaModel, TrainOptions
from cuengine.model.adamw8bit import AdamW8bitState

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


@pytest.fixture(scope="module")
def baseline_8bit():
    out = {}
    for name, opts in {"bf16": {}, "fp8": {"matmul_dtype": "e4m3"}}.items():
        m, losses, norms = run_steps(tiny("tiny"), optimizer="adamw8bit", **opts)
        out[name] = losses, norms, {k: v.numpy() for k, v in m.weights.tensors.items()}
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "flags", FLAG_SETS[::2] + FLAG_SETS[-1:], ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items())
)
def test_adamw8bit_flags_bitwise(flags, precision, baseline_8bit):
    base_losses, base_norms, base_w = baseline_8bit[precision]
    extra = {"matmul_dtype": "e4m3"} if precision == "fp8" else {}
    m, losses, norms = run_steps(tiny("tiny"), optimizer="adamw8bit", **flags, **extra)
    assert losses == base_losses
    assert [n.tobytes() for n in norms] == [n.tobytes() for n in base_norms]
    for k, w in m.weights.tensors.items():
        assert_bitwise(w.numpy(), base_w[k], k)


@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3", "use_cuda_graphs": True}])
def test_adamw8bit_checkpoint_resume_is_bitwise(tmp_path, opts):
    cfg = tiny("tiny")
    a = make(cfg, optimizer="adamw8bit", **opts)
    for s in range(3):
        a.train_step(*batch(cfg, seed=s), lr=1e-3)
    a.save_checkpoint(tmp_path / "ckpt")
    want = [a.train_step(*batch(cfg, seed=s), lr=1e-3) for s in range(3, 6)]
    b = make(cfg, seed=99, optimizer="adamw8bit", **opts)
    b.load_checkpoint(tmp_path / "ckpt")
    got = [b.train_step(*batch(cfg, seed=s), lr=1e-3) for s in range(3, 6)]
    assert got == want
    for k, t in a.opt_state.state_tensors().items():
        assert_bitwise(b.opt_state.state_tensors()[k].numpy(), t.numpy(), k)
    c = make(cfg, **opts)  # AdamW: the 8-bit state is refused, nothing changes
    with pytest.raises(ValueError, match="does not match this model"):
        c.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3"}])
def test_gpu_adamw8bit_matches_cpu_and_flags_bitwise(opts):
    """cuda's first update from the same gradients is the twin's to the bit; the flags are bitwise on the GPU."""
    cfg = tiny("tiny-hs64")
    _, base, base_n = run_steps(cfg, device="cuda", optimizer="adamw8bit", **opts)
    for flags in FLAG_SETS:
        _, losses, norms = run_steps(cfg, device="cuda", optimizer="adamw8bit", **flags, **opts)
        assert losses == base and [n.tobytes() for n in norms] == [n.tobytes() for n in base_n], flags
    _, cpu, _ = run_steps(cfg, device="cpu", optimizer="adamw8bit", **opts)
    np.testing.assert_allclose(base, cpu, rtol=2e-2)
    assert "cuda" in DEVICES


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
