"""What a research user comparing against PyTorch relies on, each tested so that it fails when broken.

- The loss is the mean over the valid targets (not -1), and so is its gradient; with accumulation
  the denominator is the whole batch's count (`valid_tokens`), and graph replays see each batch's.
- A non-finite gradient norm updates nothing (weights, moments, step): train_step raises, or counts
  the skip with `skip_nonfinite_steps`; `update` alone skips on the device.
- Mutations the model tests once let through: the QKV bias dropped (random biases in test_model),
  FP8 turned off (FP8 output differs from BF16, and the block GEMMs get FP8 operands), the optimizer
  pinned at step 1 (three AdamW steps against NumPy), z-loss not passed (the model's loss and
  gradients with z-loss against the reference, and `--z-loss` reaching the options).
- Memory flags save the buffers they claim; FP8 logits of a padded batch ignore the padding.
- The float64 reference's backward agrees with finite differences of its forward.
- GPU: the option flags are bitwise for FP8 too; the same seed gives the same bits; a resumed run
  gives the uninterrupted run's losses bitwise.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import reference_model as ref
from conftest import DEVICES, TOL, assert_bitwise
from test_model import FLAG_SETS, B, T, assert_grads_close, batch, make, randomize, run_steps, tiny, valid

import cuengine as ce
from cuengine import cli
from cuengine.kernels import adamw
from cuengine.model import LlamaModel
from cuengine.model.options import memory_preset


def snapshot(m):
    """Host copies of the weights and both moments."""
    out = {f"w.{k}": v.numpy().copy() for k, v in m.weights.tensors.items()}
    out.update({f"m.{k}": v.numpy().copy() for k, v in m.opt_state.m.items()})
    out.update({f"v.{k}": v.numpy().copy() for k, v in m.opt_state.v.items()})
    return out


def assert_unchanged(m, snap):
    for k, v in snapshot(m).items():
        assert_bitwise(v, snap[k], k)


# ---- loss over valid targets ----------------------------------------------------------------
def test_loss_is_the_mean_over_valid_targets():
    """Half the targets ignored: train_step and validate report the mean over the other half (as
    PyTorch's cross_entropy), not a loss diluted by the padding."""
    cfg = tiny("tiny", dtype="fp32")
    m = randomize(make(cfg))
    x, y = batch(cfg, seed=4)
    y[:, T // 2 :] = -1
    want, _, _ = ref.loss_and_grads(cfg, m.weights.host_arrays(), x, y, with_grads=False)
    assert abs(m.validate(x, y) - want) <= TOL["fp32"][0] * want
    assert abs(m.train_step(x, y, lr=1e-3) - want) <= TOL["fp32"][0] * want
    assert want > 4.0  # about log(256): a mean over B*T would be half of it


def test_loss_matches_torch_cross_entropy():
    torch = pytest.importorskip("torch")
    cfg = tiny("tiny", dtype="fp32")
    m = randomize(make(cfg))
    x, y = batch(cfg, seed=8)
    y[1, 5:] = -1
    logits = torch.from_numpy(m.logits(x).reshape(B * T, -1).astype(np.float64))
    want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y.reshape(-1).astype(np.int64)), ignore_index=-1)
    assert abs(m.validate(x, y) - float(want)) <= TOL["fp32"][0] * float(want)


def test_every_target_ignored_is_refused():
    cfg = tiny("tiny")
    m = make(cfg)
    x, y = batch(cfg)
    y[...] = -1
    snap = snapshot(m)
    with pytest.raises(ValueError, match="every target is -1"):
        m.train_step(x, y, lr=1e-3)
    with pytest.raises(ValueError, match="every target is -1"):
        m.validate(x, y)
    assert_unchanged(m, snap)
    assert m.step == 0


@pytest.mark.parametrize("bad", [5, 0, 2.5, True])
def test_valid_tokens_below_this_micro_batch_is_refused(bad):
    cfg = tiny("tiny")
    m = make(cfg)
    x, y = batch(cfg)
    m.forward(x)
    with pytest.raises(ValueError, match="valid_tokens"):
        m.backward(x, y, valid_tokens=bad)


@pytest.mark.parametrize("dev", DEVICES)
def test_graph_replays_see_each_batch_valid_count(dev):
    """The 1/N weight is read on the device: a captured backward replayed on batches with other
    numbers of valid targets gives the eager gradients bitwise."""
    cfg = tiny("tiny-hs64" if dev == "cuda" else "tiny")
    eager, graphs = make(cfg, device=dev), make(cfg, device=dev, use_cuda_graphs=True)
    for s, cut in enumerate((16, 3, 11, 7)):
        x, y = batch(cfg, seed=20 + s)
        y[0, cut:] = -1
        losses = [mm.train_step(x, y, lr=1e-3) for mm in (eager, graphs)]
        assert losses[0] == losses[1]
        for k, g in eager.gradients().items():
            assert_bitwise(graphs.gradients()[k].numpy(), g.numpy(), k)
    assert ("backward", True) in graphs._graphs


@pytest.mark.parametrize("dev", DEVICES)
def test_classifier_reads_d_loss_from_the_device(dev):
    """d_loss as a (1,) device Tensor gives the float's dlogits bitwise; a wrong one is refused."""
    from cuengine.kernels import classifier

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((37, 300)).astype(np.float32)
    targets = rng.integers(-1, 300, 37).astype(np.int32)
    out = {}
    for how in ("float", "tensor"):
        t = {k: ce.Tensor.from_numpy(a, dev, name=k) for k, a in
             (("logits", logits), ("losses", np.zeros(37, np.float32)), ("lse", np.zeros(37, np.float32)),
              ("targets", targets))}  # fmt: skip
        d = 1 / 29 if how == "float" else ce.Tensor.from_numpy(np.array([1 / 29], np.float32), dev, name="d_loss")
        classifier.fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], d)
        out[how] = t["logits"].numpy()
    assert_bitwise(out["tensor"], out["float"], "dlogits")
    bad = ce.Tensor.from_numpy(np.zeros(2, np.float32), dev, name="d_loss")
    with pytest.raises(ValueError, match="d_loss: expected shape \\(1\\)"):
        classifier.fused_classifier(t["logits"], t["losses"], t["lse"], t["targets"], bad)


def test_workspace_passes_are_checked():
    from cuengine.kernels.attention import workspace_shape

    cpu = ce.device("cpu")
    assert workspace_shape(2, 16, 4, 2, 16, "raw", device=cpu, passes=("forward",)) == (0,)
    assert workspace_shape(2, 16, 4, 2, 16, "raw", device=cpu, passes=("backward",))[0] >= 2 * 4 * 16 * 4
    with pytest.raises(ValueError, match="passes must name"):
        workspace_shape(2, 16, 4, 2, 16, "raw", device=cpu, passes=("bwd",))


@pytest.mark.parametrize("lr,n,msg", [(float("nan"), 5, "lr must be a finite"), (1e-3, 0, "valid_tokens must be"),
                                      (1e-3, 2.0, "valid_tokens must be")])  # fmt: skip
def test_finish_step_checks_its_arguments(lr, n, msg):
    cfg = tiny("tiny")
    m = make(cfg)
    x, y = batch(cfg)
    m.forward(x)
    m.backward(x, y)
    snap = snapshot(m)
    with pytest.raises(ValueError, match=msg):
        m.finish_step(lr, n)
    assert_unchanged(m, snap)
    assert m.step == 0


# ---- guarded updates ------------------------------------------------------------------------
def poison_gradient(m, name="down_w", layer=0):
    """Make block `layer`'s `name` weight gradient inf after its GEMM (the loss stays finite), as an
    overflow in backward would."""
    k = m._blocks.k
    target = m._blocks.grads[layer][name]

    def matmul(out, *args, **kwargs):
        k.matmul(out, *args, **kwargs)
        if out is target:
            arr = out.numpy()
            arr.reshape(-1)[7] = np.inf
            out.copy_from_numpy(arr)

    m._blocks.k = dataclasses.replace(k, matmul=matmul)
    return lambda: setattr(m._blocks, "k", k)


def test_nonfinite_grad_norm_raises_and_updates_nothing():
    cfg = tiny("tiny")
    m = make(cfg)
    m.train_step(*batch(cfg, seed=1), lr=1e-3)  # moments are not zero any more
    snap = snapshot(m)
    poison_gradient(m)
    with pytest.raises(FloatingPointError, match="train_step: the gradient norm is inf"):
        m.train_step(*batch(cfg, seed=2), lr=1e-3)
    assert_unchanged(m, snap)
    assert m.step == 1 and m.skipped_steps == 0


def test_skip_nonfinite_steps_counts_and_goes_on():
    """The skipped step leaves weights, moments and the step number alone: the next step is
    bitwise the step a run without the bad batch takes."""
    cfg = tiny("tiny")
    m, clean = make(cfg, skip_nonfinite_steps=True), make(cfg)
    restore = poison_gradient(m)
    snap = snapshot(m)
    loss = m.train_step(*batch(cfg, seed=2), lr=1e-3)
    assert math.isfinite(loss) and m.skipped_steps == 1 and m.step == 0
    assert_unchanged(m, snap)
    restore()
    assert m.train_step(*batch(cfg, seed=3), lr=1e-3) == clean.train_step(*batch(cfg, seed=3), lr=1e-3)
    assert m.step == 1
    for k, v in snapshot(clean).items():
        assert_bitwise(snapshot(m)[k], v, k)


def test_skip_nonfinite_steps_must_be_a_bool():
    with pytest.raises(ValueError, match="skip_nonfinite_steps must be True or False"):
        ce.TrainOptions(skip_nonfinite_steps=1)


@pytest.mark.parametrize("dev", DEVICES)
def test_update_skips_on_the_device(dev):
    """`update` without a host check: the NaN clip scale of a non-finite norm makes AdamW write
    nothing, for every parameter."""
    cfg = tiny("tiny-hs64" if dev == "cuda" else "tiny")
    m = make(cfg, device=dev, use_cuda_graphs=dev == "cuda")
    for s in range(2):  # eager, then captured: the guard holds in a replayed graph too
        m.train_step(*batch(cfg, seed=s), lr=1e-3)
    snap = snapshot(m)
    x, y = batch(cfg, seed=5)
    m.forward(x)
    m.backward(x, y)
    G = m.gradients()["model.layers.1.mlp.down_proj.weight"]
    arr = G.numpy()
    arr[3, 4] = np.nan
    G.copy_from_numpy(arr)
    m.update(lr=1e-3)
    m.device.synchronize()
    assert np.isnan(m.opt_state.norm_result.numpy()).all()
    assert_unchanged(m, snap)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("scale", [np.nan, np.inf])
def test_adamw_writes_nothing_for_a_nonfinite_grad_scale(dev, scale):
    rng = np.random.default_rng(0)
    arrays = {k: rng.standard_normal(1000).astype(np.float32) for k in ("p", "g", "m")}
    arrays["v"] = np.abs(arrays["m"])
    t = {k: ce.Tensor.from_numpy(a, dev, name=k) for k, a in arrays.items()}
    hp = ce.Tensor.from_numpy(adamw.make_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, 3), dev, name="hparams")
    gs = ce.Tensor.from_numpy(np.array([scale], np.float32), dev, name="grad_scale")
    adamw.adamw_update(t["p"], t["g"], t["m"], t["v"], hp, gs, True, seed=1)
    for k in ("p", "m", "v"):
        assert_bitwise(t[k].numpy(), arrays[k], k)


# ---- the mutations: FP8 runs, the optimizer steps, z-loss -----------------------------------
def count_matmuls(m):
    """Wrap the blocks' matmul: returns a list that collects, per call, whether both operands were FP8."""
    k, calls = m._blocks.k, []

    def matmul(out, a, b, *args, **kwargs):
        calls.append(a.dtype.is_fp8 and b.dtype.is_fp8)
        k.matmul(out, a, b, *args, **kwargs)

    m._blocks.k = dataclasses.replace(k, matmul=matmul)
    return calls


@pytest.mark.parametrize("grad_dtype", ["e5m2", "e4m3"])
def test_fp8_really_runs(grad_dtype):
    """Same weights, same batch: FP8 logits, loss and gradients differ from BF16 ones, and every
    block GEMM (4 forward, 8 backward per layer) takes FP8 operands; the LM head stays BF16."""
    cfg = tiny("tiny")
    x, y = batch(cfg)
    bf, f8 = make(cfg), make(cfg, matmul_dtype="e4m3", grad_dtype=grad_dtype)
    assert not np.array_equal(bf.logits(x), f8.logits(x))
    calls = {name: count_matmuls(mm) for name, mm in (("bf16", bf), ("fp8", f8))}
    losses = {name: mm.train_step(x, y, lr=1e-3) for name, mm in (("bf16", bf), ("fp8", f8))}
    assert losses["bf16"] != losses["fp8"]
    assert abs(losses["bf16"] - losses["fp8"]) < 0.03 * losses["bf16"]
    L = cfg.num_layers
    assert sum(calls["fp8"]) == 12 * L and len(calls["fp8"]) == 12 * L + 3  # + LM head: logits, d_head, d_lnf
    assert sum(calls["bf16"]) == 0 and len(calls["bf16"]) == 12 * L + 3
    g_bf, g_f8 = bf.gradients(), f8.gradients()
    assert all(not np.array_equal(g_bf[k].numpy(), g_f8[k].numpy()) for k in g_bf if ".layers." in k)


def numpy_adamw(p, g, m, v, step, lr, b1, b2, eps, wd):
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh, vh = m / (1 - b1**step), v / (1 - b2**step)
    return p - lr * (mh / (np.sqrt(vh) + eps) + wd * p), m, v


def test_three_updates_match_numpy_adamw():
    """Bias correction at steps 2 and 3, decay on matrices only, clipping active on every step, the
    model's own gradients fed to a NumPy AdamW in float64."""
    cfg = tiny("tiny", dtype="fp32")
    hp = {"lr": 1e-2, "b1": 0.8, "b2": 0.9, "eps": 1e-6, "wd": 0.1}
    m = randomize(make(cfg, grad_clip=0.05, weight_decay=hp["wd"], beta1=hp["b1"], beta2=hp["b2"], eps=hp["eps"]))
    P = {k: v.astype(np.float64) for k, v in m.weights.host_arrays().items()}
    M = {k: np.zeros_like(v) for k, v in P.items()}
    V = {k: np.zeros_like(v) for k, v in P.items()}
    for step in (1, 2, 3):
        x, y = batch(cfg, seed=30 + step)
        m.forward(x)
        m.backward(x, y)
        G = {k: g.numpy().astype(np.float64) for k, g in m.gradients().items()}
        norm = math.sqrt(sum(float(np.sum(g * g)) for g in G.values()))
        assert norm > 0.05  # the clip is active
        m.update(lr=hp["lr"])
        assert m.step == step
        for k in P:
            decays = not ("norm" in k or k.endswith("bias"))
            P[k], M[k], V[k] = numpy_adamw(P[k], G[k] * 0.05 / norm, M[k], V[k], step, hp["lr"], hp["b1"], hp["b2"],
                                           hp["eps"], hp["wd"] if decays else 0.0)  # fmt: skip
        got = m.weights.host_arrays()
        for k in P:
            np.testing.assert_allclose(
                got[k], P[k], rtol=TOL["fp32"][0], atol=TOL["fp32"][1] * 1e-2, err_msg=f"{k}@{step}"
            )


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_z_loss_in_the_model_loss_and_gradients(preset):
    cfg = tiny(preset, dtype="fp32")
    m = randomize(make(cfg, z_loss=0.1))
    x, y = batch(cfg, seed=6)
    m.forward(x)
    m.backward(x, y)
    want_loss, want, _ = ref.loss_and_grads(cfg, m.weights.host_arrays(), x, y, z_loss=0.1)
    plain, _, _ = ref.loss_and_grads(cfg, m.weights.host_arrays(), x, y, with_grads=False)
    assert want_loss > plain + 1.0  # lse^2 ~ 30: the term is large
    assert abs(m.loss_sum() / valid(y) - want_loss) <= TOL["fp32"][0] * want_loss
    assert_grads_close(m.gradients(), want, "fp32")
    assert abs(m.validate(x, y) - want_loss) <= TOL["fp32"][0] * want_loss


def test_cli_z_loss_reaches_the_model(tmp_path, monkeypatch):
    seen = []
    init = LlamaModel.__init__

    def spy(self, cfg, opts=None, *args, **kwargs):
        seen.append(opts.z_loss)
        init(self, cfg, opts, *args, **kwargs)

    monkeypatch.setattr(LlamaModel, "__init__", spy)
    fast = ["--device", "cpu", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--sample-tokens", "0"]
    assert cli.main(["train", *fast, "--steps", "1", "--z-loss", "0.25", "--out", str(tmp_path / "run")]) == 0
    assert seen and set(seen) == {0.25}


# ---- memory -----------------------------------------------------------------------------------
def buffers(m) -> dict[str, int]:
    """{context/name: bytes} of the device buffers."""
    return {f"{c}/{n}": b for (c, n), (b, _) in m.memory_report().by_name.items() if not c.endswith("(pinned)")}


L3 = 3  # layers: enough that "every layer but the first" differs from "every layer"


def _layers(name, first=0):
    return {f"Activations/{name}.{i}" for i in range(first, L3)}


# flag -> (device buffers it removes, buffers it adds): the sharing rules of RunState
MEMORY_FLAGS = {
    "recompute_rmsnorm": (_layers("ln1", 1) | _layers("ln2"), set()),
    "recompute_qkv": (_layers("qkv", 1), set()),
    "recompute_att": (_layers("ln1", 1) | _layers("qkv", 1) | _layers("att", 1), set()),
    "recompute_ffn": (_layers("ln2") | _layers("mlp_up") | _layers("swiglu", 1), set()),
    "recompute_swiglu": (_layers("swiglu", 1), set()),
    "recompute_block": (
        _layers("ln1", 1) | _layers("ln2") | _layers("qkv", 1) | _layers("att", 1) | _layers("res_att", 1)
        | _layers("mlp_up") | _layers("swiglu", 1),
        set(),
    ),
    "offload_residual": ({"Activations/res_ffn.2"}, set()),
}  # fmt: skip


@pytest.mark.parametrize("flag", list(MEMORY_FLAGS))
def test_memory_flag_saves_its_buffers(flag):
    """The device memory shrinks by exactly the buffers the flag shares or moves, less the growth of
    the stack (recompute_ffn/block put mlp_up there, where it may share the peak with others)."""
    cfg = tiny("tiny", num_layers=L3)
    fast = memory_preset("fast", L3)  # every activation kept: what each flag takes away from
    base, small = buffers(make(cfg, **fast)), buffers(make(cfg, **{**fast, flag: True}))
    removed, added = MEMORY_FLAGS[flag]
    assert set(base) - set(small) == removed
    assert set(small) - set(base) == added
    grown = {k: small[k] - base[k] for k in base.keys() & small.keys() if small[k] != base[k]}
    assert set(grown) <= {"Stack/stack"}, grown
    stack_growth = grown.get("Stack/stack", 0)
    assert sum(base.values()) - sum(small.values()) == sum(base[k] for k in removed) - stack_growth
    assert sum(base[k] for k in removed) > stack_growth


@pytest.mark.parametrize("layers", [1, L3 - 1, L3])
def test_recompute_ffn_layers_drops_the_mlp_up_of_those_layers(layers):
    """recompute_ffn_layers=n keeps the mlp_up of every layer but the first n, and nothing else changes
    but the stack, which now holds one mlp_up (recompute_ffn drops ln2 and swiglu too)."""
    cfg = tiny("tiny", num_layers=L3)
    base, small = buffers(make(cfg)), buffers(make(cfg, recompute_ffn_layers=layers))
    removed = {f"Activations/mlp_up.{i}" for i in range(layers)}
    assert set(base) - set(small) == removed and not set(small) - set(base)
    grown = {k for k in base.keys() & small.keys() if small[k] != base[k]}
    assert grown <= {"Stack/stack"}, grown
    assert sum(base.values()) - sum(small.values()) == sum(base[k] for k in removed) - (
        small["Stack/stack"] - base["Stack/stack"]
    )


def test_recompute_ffn_layers_cannot_exceed_the_layers():
    with pytest.raises(ValueError, match="recompute_ffn_layers=4 exceeds the model's 3 layers"):
        make(tiny("tiny", num_layers=L3), recompute_ffn_layers=L3 + 1)


def test_lmhead_chunks_shrink_the_stack_by_the_logits():
    """The (B*T, V) logits are the largest step temporary of the tiny model: two chunks halve them."""
    cfg = tiny("tiny")
    one, two = buffers(make(cfg)), buffers(make(cfg, lmhead_chunks=2))
    logits = B * T * cfg.vocab_size * 2  # bf16
    assert one["Stack/stack"] == logits and two["Stack/stack"] <= logits // 2
    assert sum(one.values()) - sum(two.values()) == one["Stack/stack"] - two["Stack/stack"]


def test_attn_bwd_chunks_sizes_the_attention_workspace_for_a_chunk():
    cfg = tiny("tiny")
    whole, halves = buffers(make(cfg, b=4)), buffers(make(cfg, b=4, attn_bwd_chunks=2))
    ws = "Scratch/attention_workspace"
    assert halves[ws] * 2 == whole[ws] > 0
    assert sum(whole.values()) - sum(halves.values()) == whole[ws] - halves[ws]


# ---- FP8 logits of a padded batch ------------------------------------------------------------
def test_fp8_logits_ignore_the_padding():
    """Padding token 0 gets a spiky embedding, so the padded rows hold the largest activations;
    the real rows' FP8 scales must not see them: the same prompt gives the same logits bitwise
    whether padded into a (2, 32) or a (1, 16) run state or, at (1, 16), not padded at all."""
    cfg = tiny("tiny")
    models = {}
    for b, t in ((2, 32), (1, 16)):
        m = make(cfg, b=b, t=t, matmul_dtype="e4m3")
        wte = m.weights["wte"]
        arr = wte.numpy()
        arr[0] = 0
        arr[0, 5] = 1.0
        wte.copy_from_numpy(arr)
        m.weights.requantize()
        models[b, t] = m
    x, _ = batch(cfg, seed=9, b=1, t=16)
    x[x == 0] = 1
    full = models[1, 16].logits(x)  # no padding at all
    assert_bitwise(models[2, 32].logits(x), full, "batch and position padding")
    assert_bitwise(models[2, 32].logits(x[:, :8]), models[1, 16].logits(x[:, :8]), "position padding")


# ---- the reference's own backward -----------------------------------------------------------
def test_reference_backward_matches_finite_differences():
    """Along a random direction per parameter tensor, with z-loss and ignored targets: the central
    difference of the float64 forward equals the reference's gradient to 1e-6."""
    cfg = tiny("tiny", num_layers=2)
    rng = np.random.default_rng(0)
    m = randomize(make(cfg, model_dtype="fp32"))
    P = {k: v.astype(np.float64) for k, v in m.weights.host_arrays().items()}
    x, y = batch(cfg, seed=12, b=2, t=8)
    _, G, _ = ref.loss_and_grads(cfg, P, x, y, z_loss=0.01)
    eps = 1e-5
    for k in P:
        d = rng.standard_normal(P[k].shape)
        d /= np.linalg.norm(d)
        lp = ref.loss_and_grads(cfg, {**P, k: P[k] + eps * d}, x, y, with_grads=False, z_loss=0.01)[0]
        lm = ref.loss_and_grads(cfg, {**P, k: P[k] - eps * d}, x, y, with_grads=False, z_loss=0.01)[0]
        fd, an = (lp - lm) / (2 * eps), float(np.sum(G[k] * d))
        assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), f"{k}: finite difference {fd:.9g}, backward {an:.9g}"


# ---- GPU: FP8 flags, determinism, resume ---------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "+".join(f"{k}={v}" for k, v in f.items()))
def test_gpu_fp8_options_bitwise(flags):
    cfg = tiny("tiny-hs64")
    _, base, base_n = run_steps(cfg, device="cuda", matmul_dtype="e4m3")
    m, losses, norms = run_steps(cfg, device="cuda", matmul_dtype="e4m3", **flags)
    assert losses == base
    assert [n.tobytes() for n in norms] == [n.tobytes() for n in base_n]


OFFLOAD_FLAGS = [
    {"offload_residual": True},
    {"offload_residual": True, "use_cuda_graphs": True, "recompute_block": True},
]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", [{}, {"matmul_dtype": "e4m3"}], ids=["bf16", "fp8"])
@pytest.mark.parametrize("flags", OFFLOAD_FLAGS)
def test_gpu_offload_deeper_model_bitwise(flags, precision):
    """Five layers: the double buffer is refilled from host during backward, on real streams."""
    cfg = tiny("tiny-hs64", num_layers=5)
    _, base, base_n = run_steps(cfg, device="cuda", **precision)
    _, losses, norms = run_steps(cfg, device="cuda", **flags, **precision)
    assert losses == base and [n.tobytes() for n in norms] == [n.tobytes() for n in base_n]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3"}, {"use_cuda_graphs": True, "recompute_block": True}])
def test_gpu_same_seed_same_bits(opts):
    cfg = tiny("tiny-hs64")
    runs = [run_steps(cfg, steps=5, device="cuda", **opts) for _ in range(2)]
    (ma, la, na), (mb, lb, nb) = runs
    assert la == lb and [n.tobytes() for n in na] == [n.tobytes() for n in nb]
    for k, w in ma.weights.tensors.items():
        assert_bitwise(mb.weights[k].numpy(), w.numpy(), k)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [{}, {"matmul_dtype": "e4m3", "opt_m_dtype": "bf16", "opt_v_dtype": "bf16"},
                                  {"use_cuda_graphs": True}])  # fmt: skip
def test_gpu_resume_is_bitwise(tmp_path, opts):
    cfg = tiny("tiny-hs64")
    a = make(cfg, device="cuda", **opts)
    for s in range(3):
        a.train_step(*batch(cfg, seed=s), lr=1e-3)
    a.save_checkpoint(tmp_path / "ckpt")
    want = [a.train_step(*batch(cfg, seed=s), lr=1e-3) for s in range(3, 7)]
    b = make(cfg, device="cuda", seed=99, **opts)
    b.load_checkpoint(tmp_path / "ckpt")
    got = [b.train_step(*batch(cfg, seed=s), lr=1e-3) for s in range(3, 7)]
    assert got == want
    for k, w in a.weights.tensors.items():
        assert_bitwise(b.weights[k].numpy(), w.numpy(), k)
