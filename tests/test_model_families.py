"""Qwen3 (QK-norm, head_dim != hidden / heads) and Llama 3.x (llama3 RoPE scaling): config,
RoPE table, weights, training against the float64 reference, recompute flags, export/import,
transformers and inference."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cuengine.kernels.rope import rope_freqs
from cuengine.model import TransformerConfig

QWEN3_06B_CONFIG = {  # as published with Qwen/Qwen3-0.6B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip
LLAMA32_1B_CONFIG = {  # as published with meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "use_cache": True,
    "vocab_size": 128256,
}  # fmt: skip


# ---- config ---------------------------------------------------------------------------------
def test_published_configs_read_as_the_presets():
    assert TransformerConfig.from_hf_dict(QWEN3_06B_CONFIG) == TransformerConfig.preset("qwen3-0.6b")
    assert TransformerConfig.from_hf_dict(LLAMA32_1B_CONFIG) == TransformerConfig.preset("llama3.2-1b")
    c = TransformerConfig.preset("qwen3-0.6b")
    assert c.qk_norm and not c.qkv_bias and c.att_channels == 2048 != c.hidden_size
    # transformers 5 writes the scaling (and theta) into rope_parameters
    v5 = {k: v for k, v in LLAMA32_1B_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(LLAMA32_1B_CONFIG["rope_scaling"], rope_theta=500000.0)
    assert TransformerConfig.from_hf_dict(v5) == TransformerConfig.preset("llama3.2-1b")


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama3", "qwen3-0.6b", "llama3.2-1b"])
def test_hf_config_round_trip(tmp_path, preset):
    c = TransformerConfig.preset(preset)
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf_dict()))
    assert TransformerConfig.from_pretrained(tmp_path) == c


def test_qwen3_head_dim_defaults_to_128_as_transformers():
    d = {k: v for k, v in QWEN3_06B_CONFIG.items() if k != "head_dim"}
    assert TransformerConfig.from_hf_dict(d).head_size == 128


@pytest.mark.parametrize(
    "preset,change,field",
    [
        ("tiny-llama3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'rope_scaling'.*'yarn'"),
        ("tiny-llama3", {"rope_scaling": {"type": "linear", "factor": 4.0}}, "'rope_scaling'.*'linear'"),
        ("tiny-llama3", {"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
         "'rope_parameters'.*'dynamic'"),
        ("tiny-llama3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'rope_scaling'.*low_freq_factor"),
        ("tiny-llama3", {"rope_scaling": "llama3"}, "'rope_scaling'.*not a JSON object"),
        ("tiny-qwen3", {"use_sliding_window": True}, "'use_sliding_window'"),
        ("tiny-qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types'"),
        ("tiny-qwen3", {"num_experts": 8}, "'num_experts'.*mixture of experts"),
        ("tiny-qwen3", {"num_experts_per_tok": 2}, "'num_experts_per_tok'"),
        ("tiny-llama", {"moe_intermediate_size": 64}, "'moe_intermediate_size'"),
        ("tiny-qwen3", {"attention_bias": True}, "'attention_bias'"),
        ("tiny-qwen3", {"model_type": "qwen2"}, "'model_type'"),
        ("tiny-llama3", {"head_dim": 32}, "'head_dim'"),
    ],
)  # fmt: skip
def test_hf_config_refuses_unsupported_naming_the_key(preset, change, field):
    d = TransformerConfig.preset(preset).to_hf_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field):
        TransformerConfig.from_hf_dict(d)


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"qk_norm": False}, "qk_norm=False on Qwen3ForCausalLM"),
        ({"qkv_bias": True}, "qkv_bias=True on Qwen3ForCausalLM"),
        ({"architecture": "LlamaForCausalLM"}, "qk_norm=True on LlamaForCausalLM"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "only .*llama3"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}}, "factor must be >= 1"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}}, "low_freq_factor < high_freq_factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64.5}}, "original_max_position_embeddings must be"),
    ],
)  # fmt: skip
def test_config_checks(change, msg):
    with pytest.raises(ValueError, match=msg):
        TransformerConfig.preset("tiny-qwen3").replace(**change)


def test_head_dim_rule_stays_for_llama_and_qwen2():
    with pytest.raises(ValueError, match="head_size=32 is inconsistent"):
        TransformerConfig.preset("tiny-llama").replace(head_size=32)


# ---- the RoPE table -------------------------------------------------------------------------
def llama3_inv_freq_loop(theta, hs, factor, lo, hi, old):
    """transformers' _compute_llama3_parameters, one frequency at a time."""
    out = []
    for i in range(0, hs, 2):
        f = 1.0 / theta ** (i / hs)
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            s = (old / wavelen - lo) / (hi - lo)
            out.append((1 - s) * f / factor + s * f)
    return np.array(out)


@pytest.mark.parametrize("preset", ["tiny-llama3", "llama3.2-1b"])
def test_rope_freqs_llama3_scaling(preset):
    c = TransformerConfig.preset(preset)
    sc = c.rope_scaling
    inv = llama3_inv_freq_loop(c.rope_theta, c.head_size, sc["factor"], sc["low_freq_factor"],
                               sc["high_freq_factor"], sc["original_max_position_embeddings"])  # fmt: skip
    table = rope_freqs(300, c.head_size, c.rope_theta, np.float64, sc)
    angle = np.arange(300)[:, None] * inv[None, :]
    np.testing.assert_allclose(table, np.concatenate([np.cos(angle), np.sin(angle)], 1), rtol=0, atol=1e-12)
    plain = rope_freqs(300, c.head_size, c.rope_theta, np.float64)
    # the high frequencies are untouched; the lowest is divided by the factor; some lie between
    assert np.array_equal(table[:, 0], plain[:, 0])
    plain_inv = c.rope_theta ** (-np.arange(0, c.head_size, 2) / c.head_size)
    ratio = plain_inv / inv
    assert ratio[0] == 1 and abs(ratio[-1] - sc["factor"]) < 1e-12 and np.any((ratio > 1) & (ratio < sc["factor"]))
    assert not np.allclose(table[:, -1], plain[:, -1], rtol=1e-3, atol=0)  # the lowest frequency's sin


def test_rope_freqs_refuses_other_scaling():
    with pytest.raises(ValueError, match="rope_type 'yarn' is not implemented"):
        rope_freqs(16, 16, 1e4, scaling={"rope_type": "yarn", "factor": 2.0})
