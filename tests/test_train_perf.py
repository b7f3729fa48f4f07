"""Train-step performance options (issue 13): they change how a step runs, not what it computes.

attention_deterministic=False must reach the attention backward and the workspace sizing; the
persistent transposed FP8 weight copies must equal a transpose of the E4M3 copies after every update.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuengine import device as ce_device
from cuengine.dtypes import dtype as ce_dtype
from cuengine.kernels import attention as A
from cuengine.kernels import fp8
from cuengine.model import LlamaModel, TrainOptions, TransformerConfig

B, T = 2, 16


def make(device="cpu", preset="tiny", **opts):
    m = LlamaModel(TransformerConfig.preset(preset), TrainOptions(**opts), device=device)
    m.init_weights(1)
    m.allocate_run_state(B, T)
    return m


def batch(cfg, seed=0):
    g = np.random.default_rng(seed)
    return tuple(g.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(2))


def test_attention_deterministic_option_is_checked():
    assert TrainOptions().attention_deterministic is True
    with pytest.raises(ValueError, match="attention_deterministic must be True or False, got 0"):
        TrainOptions(attention_deterministic=0)


@pytest.mark.parametrize("flag", [True, False])
def test_attention_deterministic_reaches_backward_and_workspace(flag, monkeypatch):
    sized = []
    real_ws = A.workspace_shape
    monkeypatch.setattr(
        A, "workspace_shape", lambda *a, **kw: sized.append(kw.get("deterministic")) or real_ws(*a, **kw)
    )
    m = make(attention_deterministic=flag)
    assert flag in sized, sized  # the backward workspace is sized for the algorithm that runs
    seen = []
    real_bwd = m._blocks.k.attention_backward

    def spy(*args, **kw):
        seen.append(kw.get("deterministic"))
        real_bwd(*args, **kw)

    m._blocks.k = dataclasses.replace(m._blocks.k, attention_backward=spy)
    x, y = batch(m.cfg)
    loss = m.train_step(x, y, lr=1e-3)
    assert seen == [flag] * m.cfg.num_layers
    # on cpu the twin runs either way: the same loss as the default
    ref = make()
    assert ref.train_step(x, y, lr=1e-3) == loss


@pytest.mark.gpu
def test_gpu_nondeterministic_attention_trains_like_deterministic():
    """hs 64 (cuDNN when installed): losses and gradient norms over 3 steps within bf16 rounding."""
    res = {}
    for flag in (True, False):
        m = make("cuda", "tiny-hs64", attention_deterministic=flag)
        losses = []
        for s in range(3):
            losses.append(m.train_step(*batch(m.cfg, 10 + s), lr=1e-3))
        res[flag] = losses, m.opt_state.norm_result.numpy()[0]
    np.testing.assert_allclose(res[False][0], res[True][0], rtol=1e-2)
    np.testing.assert_allclose(res[False][1], res[True][1], rtol=5e-2)


# ---- memory presets and the benchmark's gradient accumulation -------------------------------------
def test_memory_presets_are_options():
    from cuengine._cli_util import recompute_options
    from cuengine.cli import build_parser
    from cuengine.model.options import memory_preset

    assert memory_preset("default", 24) == {}
    assert memory_preset("fast", 24) == {"recompute_swiglu": False, "lmhead_chunks": 1}
    assert memory_preset("lean", 24) == {"recompute_rmsnorm": True, "recompute_ffn_layers": 12}
    with pytest.raises(ValueError, match="memory preset must be one of"):
        memory_preset("small", 24)
    p = build_parser()
    args = p.parse_args(["train", "--memory", "lean", "--recompute", "att"])
    assert recompute_options(args.memory, args.recompute, 28) == {
        "recompute_rmsnorm": True, "recompute_ffn_layers": 14, "recompute_att": True}  # fmt: skip
    # ffn and block recompute every layer's up projection: lean's partial count gives way
    args = p.parse_args(["bench", "--recompute", "ffn", "--memory", "lean"])
    assert recompute_options(args.memory, args.recompute, 28) == {"recompute_rmsnorm": True, "recompute_ffn": True}
    args = p.parse_args(["train", "--memory", "fast", "--recompute", "swiglu"])  # a part given wins over the preset
    assert recompute_options(args.memory, args.recompute, 28) == {"recompute_swiglu": True, "lmhead_chunks": 1}
    assert recompute_options(p.parse_args(["train"]).memory, [], 28) == {}


def test_default_options_recompute_swiglu_and_chunk_the_lm_head():
    """The default keeps memory low cheaply: SwiGLU recomputed, the logits in chunks of <= 1 GiB (a
    chunk from 1024 rows up); keep_all_activations turns the SwiGLU recompute off with it."""
    from cuengine.model.options import auto_lmhead_chunks

    o = TrainOptions().resolved("bf16")
    assert o.recompute_swiglu and o.lmhead_chunks is None
    assert not TrainOptions(keep_all_activations=True).resolved("bf16").recompute_swiglu
    assert auto_lmhead_chunks(8192, 151936, 2) == 4  # 0.5B at B=8, T=1024: 594 MiB a chunk
    assert auto_lmhead_chunks(8192, 151936, 4) == 8
    assert auto_lmhead_chunks(16384, 256, 2) == 1  # small logits are not split
    assert auto_lmhead_chunks(2048, 10**6, 2) == 2  # never under 1024 rows a chunk
    assert auto_lmhead_chunks(2050, 10**6, 2) == 2  # 1025 rows a chunk do not halve evenly
    # a model whose logits exceed 1 GiB: allocation picks the chunks and sizes the stack for one chunk
    cfg = TransformerConfig.preset("tiny").replace(vocab_size=1 << 19)
    m = LlamaModel(cfg, TrainOptions(model_dtype="bf16"), device="cpu")
    m.allocate_run_state(16, 256)  # 4096 rows x 2^19 x 2 bytes = 4 GiB of logits: 4 chunks of 1 GiB
    assert m.opts.lmhead_chunks == 4
    assert (1 << 30) <= m.memory_report().by_context["Stack"][0] < (5 << 28)


def test_bench_train_step_with_grad_accum_matches_a_manual_step():
    from cuengine.bench_train import bench_train_step, random_batch

    cfg = TransformerConfig.preset("tiny")
    dev = ce_device("cpu")
    r = bench_train_step(cfg, TrainOptions(), dev, B, T, steps=1, warmup=1, grad_accum=2)
    assert r["tok_s"] > 0 and np.isfinite(r["loss"])
    m = make()
    m.init_weights(42)
    x, y = random_batch(cfg.vocab_size, B, T)
    for micro in range(2):
        m.forward(x)
        m.backward(x, y, micro_step=micro, grad_accum_steps=2)
    assert r["first_loss"] == m.loss_sum() / (2 * B * T)


def test_qwen25_3b_preset():
    c = TransformerConfig.preset("qwen2.5-3b")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_q_heads, c.num_kv_heads, c.head_size) == (
        2048, 11008, 36, 16, 2, 128)  # fmt: skip
    assert c.tied_embeddings and c.qkv_bias and c.vocab_size == 151936


# ---- FP8: the weights' transposed E4M3 copies ---------------------------------------------------------
def _check_fp8_transposes(m):
    assert m.weights.fp8_tp and m.weights.fp8_tp.keys() == m.weights.fp8.keys()
    for name, q in m.weights.fp8.items():
        tp = m.weights.fp8_tp[name]
        assert tp.shape == q.shape[::-1] and tp.stats.ptr == q.stats.ptr, name
        np.testing.assert_array_equal(tp.numpy().view(np.uint8), q.numpy().view(np.uint8).T, err_msg=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_weight_transposes_follow_every_update(device):
    """The backward's dinp GEMMs read weights.fp8_tp: it must be W8ᵀ after init and after each update."""
    m = make(device, "tiny-hs64", matmul_dtype="e4m3")
    _check_fp8_transposes(m)
    before = {k: v.numpy().copy() for k, v in m.weights.fp8_tp.items()}
    for s in range(2):
        m.train_step(*batch(m.cfg, s), lr=1e-2)
    _check_fp8_transposes(m)
    assert any(not np.array_equal(before[k], v.numpy()) for k, v in m.weights.fp8_tp.items())
    assert make(device).weights.fp8_tp == {}  # bf16 matmuls keep no FP8 copies


# ---- FP8 activations stored transposed (Blocks.stored_tp) --------------------------------------------------
def _spied(m, log):
    """m's kernel table with transpose / quantize / quantize_dual calls logged as (name, inp shape)."""
    k = m._blocks.k

    def spy(name):
        real, at = getattr(k, name), {"transpose": 1, "quantize_with_abs_max": 1, "quantize_dual": 2}[name]

        def call(*a, **kw):
            log.append((name, a[at].shape))  # the input's shape
            real(*a, **kw)

        return call

    return dataclasses.replace(k, **{n: spy(n) for n in ("transpose", "quantize_with_abs_max", "quantize_dual")})


OPTION_SETS = [{"recompute_swiglu": False}, {}, {"recompute_ffn": True}, {"recompute_rmsnorm": True},
               {"recompute_att": True}, {"recompute_block": True}, {"keep_all_activations": True},
               {"recompute_ffn_layers": 1}]  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("opts", OPTION_SETS, ids=lambda o: "-".join(o) or "default")
def test_fp8_activations_stored_transposed_skip_the_backward_transposes(device, opts):
    """ln1, ln2 and swiglu keep their E4M3 copy transposed, written by the forward's quantize_dual, so the
    backward transposes nothing where that copy is per layer and read by nothing else; whatever the flags,
    three steps give the bits of the path that stores them untransposed and transposes them in backward.
    Current scaling: the stack is sized for the stored copies, and delayed scaling's temporaries on the
    untransposed path would not fit it (test_fp8_delayed covers that path)."""
    runs = {}
    for stored in (True, False):
        m = make(device, "tiny-llama", matmul_dtype="e4m3", fp8_amax_history=0, **opts)
        if stored:
            any_stored = any(m._blocks.stored_tp.values())
        else:
            m._blocks.stored_tp = dict.fromkeys(m._blocks.stored_tp, False)
        log = []
        m._blocks.k = _spied(m, log)
        x, y = batch(m.cfg)
        losses = [m.train_step(x, y, lr=1e-3) for _ in range(3)]
        runs[stored] = (losses, {n: g.numpy() for n, g in m.grads.items()}, log)
    assert runs[True][0] == runs[False][0]
    for n, g in runs[True][1].items():
        np.testing.assert_array_equal(g.view(np.uint8), runs[False][1][n].view(np.uint8), err_msg=n)
    L, (C, H) = m.cfg.num_layers, (m.cfg.hidden_size, m.cfg.intermediate_size)
    transposed = [s[-1] for name, s in runs[True][2] if name == "transpose"]
    if opts == OPTION_SETS[0]:  # every activation kept: no transpose, the three inputs quantized both ways
        assert transposed == [], transposed
        dual = [s[-1] for name, s in runs[True][2] if name == "quantize_dual"]
        assert dual.count(H) >= 3 * L and dual.count(C) >= 3 * (2 * L)
    before = len([1 for name, _ in runs[False][2] if name == "transpose"])
    assert len(transposed) < before if any_stored else len(transposed) == before


# ---- FP8 LM head (TrainOptions.lmhead_fp8) ----------------------------------------------------------------
def test_lmhead_fp8_option_is_checked():
    with pytest.raises(ValueError, match="lmhead_fp8 needs matmul_dtype 'e4m3' \\(FP8 matmuls\\), got 'bf16'"):
        TrainOptions(matmul_dtype="bf16", lmhead_fp8=True)
    with pytest.raises(ValueError, match="lmhead_fp8 needs matmul_dtype 'e4m3' \\(FP8 matmuls\\), got 'fp32'"):
        TrainOptions(lmhead_fp8=True).resolved("fp32")  # the model dtype fills matmul_dtype in
    with pytest.raises(ValueError, match="lmhead_fp8 must be True or False, got 1"):
        TrainOptions(matmul_dtype="e4m3", lmhead_fp8=1)
    with pytest.raises(ValueError, match="B\\*T/lmhead_chunks = 8 rows, and FP8 GEMMs need a multiple of 16"):
        make(matmul_dtype="e4m3", lmhead_fp8=True, lmhead_chunks=4)


def _dequant(t) -> np.ndarray:
    """An FP8 tensor's values times its scale_inv, in float64."""
    return t.numpy().astype(np.float64) * float(t.stats.numpy()[8])


def _e4m3(x: np.ndarray, real=slice(None)) -> np.ndarray:
    """x quantized to E4M3 with the abs-max of x[real] and dequantized (float64): the twin's arithmetic."""
    amax = np.abs(x[real].astype(np.float32)).max() if x[real].size else 0
    q, st = fp8.quantize_reference(x, np.float32(amax), ce_dtype("e4m3"))
    return q.astype(np.float64) * float(st[2])


@pytest.mark.parametrize("chunks", [1, 2])
def test_lmhead_fp8_logits_are_e4m3_products(chunks):
    """The logits are E4M3(lnf chunk) · E4M3(head)ᵀ rounded once to bf16, which differ from the bf16 LM
    head's by more than bf16 rounding: the option cannot silently fall back to bf16 GEMMs."""
    m = make(matmul_dtype="e4m3", lmhead_fp8=True, lmhead_chunks=chunks)
    assert "wte" in m.weights.fp8 and "wte" not in make(matmul_dtype="e4m3").weights.fp8
    x, _ = batch(m.cfg)
    got = m.logits(x).reshape(B * T, -1).astype(np.float64)
    lnf = m.rs.lnf.numpy().reshape(B * T, -1)
    w = m.weights["wte"].numpy().astype(np.float64)
    n = B * T // chunks
    want = np.concatenate([_e4m3(lnf[c * n : (c + 1) * n]) @ _dequant(m.weights.fp8["wte"]).T for c in range(chunks)])
    np.testing.assert_allclose(got, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())
    bf16 = lnf.astype(np.float64) @ w.T
    err = np.abs(got - bf16).max() / np.abs(bf16).max()
    assert 2**-7 < err < 0.1, err  # more than bf16 rounding, within E4M3's


@pytest.mark.parametrize("chunks", [1, 2])
def test_lmhead_fp8_padded_batch_scales_by_real_rows(chunks):
    """A batch padded to (B, T) (logits of b < B, t < T): the head's E4M3 scales come from the real rows
    of lnf alone, as the blocks' scales do; here the padding rows are made 10x larger."""
    m = make(matmul_dtype="e4m3", lmhead_fp8=True, lmhead_chunks=chunks)
    m.forward(batch(m.cfg)[0])
    t = T // 2
    lnf = m.rs.lnf.array().reshape(B * T, -1)
    lnf[t:] *= 10
    lnf = lnf.copy()
    got = np.empty((B * T, m.cfg.vocab_size), np.float32)
    m._blocks.real_rows = [(0, t)]
    m._blocks.lm_head(0.0, logits_out=got)
    w8 = _dequant(m.weights.fp8["wte"])
    n = B * T // chunks
    want = np.concatenate([_e4m3(lnf[c * n : (c + 1) * n], real=slice(0, max(0, t - c * n)) if c * n < t else 0)
                           @ w8.T for c in range(chunks)])[:t]  # fmt: skip
    np.testing.assert_allclose(got[:t], want, rtol=2**-8, atol=2**-8 * np.abs(want).max())
    wrong = (_e4m3(lnf[:n]) @ w8.T)[:t]
    assert np.abs(got[:t] - wrong).max() > 4 * 2**-8 * np.abs(want).max()


def test_lmhead_fp8_backward_is_the_fp8_products():
    """Untied head: d_lnf = D(dlogits) · D(W)  and  d_head = D(dlogits)ᵀ · D(lnf), with D the E5M2 and E4M3
    quantize-dequantize of the dlogits the classifier wrote (captured), of the head weight and of lnf."""
    m = make(preset="tiny-llama", matmul_dtype="e4m3", lmhead_fp8=True)
    seen = {}
    real = m._blocks.k.quantize_dual

    def spy(out, out_tp, inp, *a, **kw):
        real(out, out_tp, inp, *a, **kw)
        if inp.shape[-1] == m.cfg.vocab_size:
            seen["dl"] = _dequant(out)
            seen["raw"] = inp.numpy().astype(np.float64)

    m._blocks.k = dataclasses.replace(m._blocks.k, quantize_dual=spy)
    x, y = batch(m.cfg)
    m.forward(x)
    m._upload_targets(y, 1.0 / (B * T))
    m.grads["lm_head"].fill_zero()
    m._blocks.lm_head(m.rs.d_loss, d_head=m.grads["lm_head"])  # d_lnf is overwritten later in backward
    assert m.opts.grad_dtype == "e5m2"
    dl, lnf = seen["dl"], m.rs.lnf.numpy().reshape(B * T, -1)
    assert 0 < np.abs(dl - seen["raw"]).max() < 0.25 * np.abs(seen["raw"]).max()  # E5M2, not the bf16 values
    d_lnf = m.rs.d_lnf.numpy().reshape(B * T, -1).astype(np.float64)
    want = dl @ _dequant(m.weights.fp8["lm_head"])
    np.testing.assert_allclose(d_lnf, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())
    d_head = m.grads["lm_head"].numpy().astype(np.float64)
    want = dl.T @ _e4m3(lnf)
    np.testing.assert_allclose(d_head, want, rtol=2**-8, atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize("chunks", [1, 2])
def test_lmhead_fp8_dlogits_scale_comes_from_the_classifier(chunks):
    """The E5M2 dlogits of each chunk are scaled by max|dlogits| that the fused classifier recorded as it
    wrote them (exactly what a separate abs-max pass gives), and no abs-max pass reads the logits."""
    m = make(preset="tiny-llama", matmul_dtype="e4m3", lmhead_fp8=True, lmhead_chunks=chunks)
    V, k = m.cfg.vocab_size, m._blocks.k
    written, stats, passes = [], [], []

    def classifier(logits, *a, **kw):
        k.fused_classifier(logits, *a, **kw)
        written.append(logits.numpy().copy())

    def quantize_dual(out, out_tp, inp, *a, **kw):
        k.quantize_dual(out, out_tp, inp, *a, **kw)
        if inp.shape[-1] == V:
            stats.append(out.stats.numpy()[[0, 4, 8]].copy())

    def abs_max(amax, inp, *a, **kw):
        passes.append(inp.shape)
        k.abs_max(amax, inp, *a, **kw)

    m._blocks.k = dataclasses.replace(k, fused_classifier=classifier, quantize_dual=quantize_dual, abs_max=abs_max)
    x, y = batch(m.cfg)
    m.forward(x)
    m.backward(x, y)
    assert len(written) == len(stats) == chunks
    assert not [s for s in passes if s[-1] == V], passes  # no separate pass over the (n, V) logits
    for dl, (amax, scale, scale_inv) in zip(written, stats):
        want = fp8.abs_max_reference(dl)
        assert amax == want > 0, (amax, want)
        assert (scale, scale_inv) == fp8.fp8_scales(want, ce_dtype("e5m2"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_lmhead_fp8_trains_like_the_bf16_head(device):
    """Five steps: losses within 2% of the bf16 LM head's, and the head's E4M3 copy follows every update."""
    losses = {}
    for flag in (False, True):
        m = make(device, "tiny-hs64", matmul_dtype="e4m3", lmhead_fp8=flag)
        losses[flag] = [m.train_step(*batch(m.cfg, s % 2), lr=1e-3) for s in range(5)]
    np.testing.assert_allclose(losses[True], losses[False], rtol=2e-2)
    assert losses[True] != losses[False]
    assert losses[True][-1] < losses[True][0]
    _check_fp8_transposes(m)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_gpu_lmhead_fp8_matches_cpu(graphs):
    """cuda against the cpu twin over 3 steps, graphs or not. An FP8 rounding that flips between the
    devices (their fp32 sums differ in order) moves one E4M3 input by a step, and three steps of
    updates drift apart, so a few logits move by up to ~6% of the largest (the H200 saw 4 of 8192
    beyond 5%, at most 5.5%, the same with and without graphs)."""
    res = {}
    for device in ("cpu", "cuda"):
        m = make(device, "tiny-hs64", matmul_dtype="e4m3", lmhead_fp8=True, use_cuda_graphs=graphs and device == "cuda")
        res[device] = [m.train_step(*batch(m.cfg, 20 + s), lr=1e-3) for s in range(3)], m.logits(batch(m.cfg)[0])
    np.testing.assert_allclose(res["cuda"][0], res["cpu"][0], rtol=1.6e-2)  # TOL["bf16"], as test_gpu_matches_cpu
    got, want = (np.asarray(res[d][1], np.float64) for d in ("cuda", "cpu"))
    rel_l2 = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f"lmhead_fp8 cuda vs cpu logits: relative L2 {rel_l2:.2e}, max |diff| {np.abs(got - want).max():.3f}")
    np.testing.assert_allclose(got, want, rtol=0, atol=0.1 * np.abs(want).max())


@pytest.mark.gpu
def test_gpu_lmhead_fp8_200_steps_of_the_embedded_corpus():
    """The issue's loss check for the option: `small` (the CLI's GPU model) on the stdlib corpus, 200 steps
    each; the mean of the last 20 losses with the FP8 LM head within 2% of bf16's (cpu, `tiny`: +0.45%)."""
    from cuengine.data import stdlib_sources

    final = {}
    for name, opts in (("bf16", {}), ("fp8", {"matmul_dtype": "e4m3"}),
                       ("fp8 + lmhead_fp8", {"matmul_dtype": "e4m3", "lmhead_fp8": True})):  # fmt: skip
        src, _ = stdlib_sources(0)
        m = LlamaModel(TransformerConfig.preset("small"), TrainOptions(use_cuda_graphs=True, **opts), device="cuda")
        m.init_weights(42)
        m.allocate_run_state(8, 256)
        losses = [m.train_step(*src.batch(8, 256), lr=1e-3 * min(1.0, (s + 1) / 20)) for s in range(200)]
        final[name] = float(np.mean(losses[-20:]))
        assert final[name] < 0.8 * losses[0], (name, losses[0], final[name])
    print("mean loss of steps 181-200:", final)
    assert abs(final["fp8 + lmhead_fp8"] - final["bf16"]) <= 0.02 * final["bf16"], final


@pytest.mark.parametrize(
    "flag,field,want,error",
    [
        (["--lmhead-fp8"], "lmhead_fp8", True, "lmhead_fp8 needs matmul_dtype 'e4m3' (FP8 matmuls), got 'bf16'"),
        (["--fp8-amax-history", "8"], "fp8_amax_history", 8,
         "fp8_amax_history scales FP8 tensors: it needs matmul_dtype 'e4m3', got 'bf16'"),
    ],
)  # fmt: skip
def test_cli_train_fp8_flags(tmp_path, capsys, monkeypatch, flag, field, want, error):
    """`cuengine train --lmhead-fp8` and `--fp8-amax-history N` reach TrainOptions and run.json (a resume
    keeps them); without FP8 matmuls each is one line on stderr and exit code 2."""
    import json

    from cuengine import cli

    seen = []
    real = LlamaModel.__init__

    def spy(self, cfg, opts=None, *a, **kw):
        seen.append(getattr(opts, field))
        real(self, cfg, opts, *a, **kw)

    monkeypatch.setattr(LlamaModel, "__init__", spy)
    fast = ["train", "--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--steps", "2", "--eval-every", "0",
            "--sample-tokens", "0", "--dtype", "bf16"]  # fmt: skip
    out = tmp_path / "run"
    assert cli.main([*fast, "--matmul-dtype", "e4m3", *flag, "--out", str(out)]) == 0
    assert json.loads((out / "run.json").read_text())[field] == want and seen[-1] == want
    assert cli.main([*fast, "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert seen[-1] == want
    capsys.readouterr()
    assert cli.main([*fast, *flag, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cuengine train: error: TrainOptions: {error}"], err
