"""Train-step performance options (issue 13): they change how a step runs, not what it computes.

attention_deterministic=False must reach the attention backward and the workspace sizing; the
persistent transposed FP8 weight copies must equal a transpose of the E4M3 copies after every update.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cuengine import device as ce_device
from cuengine.kernels import attention as A
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
def test_memory_preset_adds_recompute_parts():
    from cuengine.cli import build_parser
    from cuengine.model.options import MEMORY_PRESETS

    p = build_parser()
    assert MEMORY_PRESETS["lean"] == ("swiglu", "rmsnorm")
    assert p.parse_args(["train", "--memory", "lean"]).recompute == ["swiglu", "rmsnorm"]
    assert p.parse_args(["train", "--recompute", "ffn", "--memory", "lean"]).recompute == ["ffn", "swiglu", "rmsnorm"]
    assert p.parse_args(["bench", "--memory", "lean", "--recompute", "att"]).recompute == ["swiglu", "rmsnorm", "att"]
    assert p.parse_args(["train", "--memory", "default"]).recompute == []


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
