"""TransformerConfig: the shape of a LLaMA / Qwen2 / Qwen3 decoder, read from and written to HF config.json.

Only what the engine implements is accepted: a config.json that asks for anything else (another
architecture, a RoPE scaling other than Llama 3's, a sliding window in use, mixture of experts,
biases on a Llama...) is refused with an error naming the field, rather than silently training a
different model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# The keys of a Llama 3 rope scaling (transformers' _compute_llama3_parameters), with their types.
LLAMA3_KEYS = {"factor": float, "low_freq_factor": float, "high_freq_factor": float,
               "original_max_position_embeddings": int}  # fmt: skip
# Keys of mixture-of-experts configs; any of them set means a model the engine does not implement.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_TORCH_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


@dataclass
class TransformerConfig:
    vocab_size: int  # V: rows of the embedding and of the LM head
    hidden_size: int  # C: width of the residual stream; num_q_heads * head_size except on Qwen3
    intermediate_size: int  # H: width of the SwiGLU MLP (the up projection has 2H rows: [gate | up])
    num_layers: int  # L: decoder blocks
    num_q_heads: int  # Hq: query heads
    num_kv_heads: int  # Hkv: key/value heads (GQA); divides Hq
    head_size: int  # hs: channels per head; even (RoPE rotates halves)
    max_position_embeddings: int = 4096  # rows of the RoPE table; T may not exceed it
    rope_theta: float = 10000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    tied_embeddings: bool = False  # the LM head reuses the embedding matrix
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    architecture: str = "LlamaForCausalLM"  # one of ARCHITECTURES
    dtype: str = "bf16"  # dtype of the stored weights: "bf16" or "fp32"
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3's q_norm / k_norm)
    # None, or Llama 3's: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}, which rescales the RoPE frequencies (rope.rope_freqs)
    rope_scaling: dict | None = None

    def __post_init__(self):
        self.validate()

    # ---- derived sizes -----------------------------------------------------------------------
    @property
    def qkv_channels(self) -> int:
        """Rows of the packed qkv projection: (Hq + 2 Hkv) * hs."""
        return (self.num_q_heads + 2 * self.num_kv_heads) * self.head_size

    @property
    def att_channels(self) -> int:
        """Width of the attention output, the o_proj input: Hq * hs (hidden_size except on Qwen3)."""
        return self.num_q_heads * self.head_size

    def validate(self) -> None:
        """Raise ValueError naming the first field that makes the shape impossible."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_q_heads",
                     "num_kv_heads", "head_size", "max_position_embeddings"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"TransformerConfig.{name} must be a positive int, got {v!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig.num_kv_heads={self.num_kv_heads} does not divide num_q_heads={self.num_q_heads}"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"TransformerConfig.architecture must be {ARCHITECTURES}, got {self.architecture!r}")
        qwen3 = self.architecture == "Qwen3ForCausalLM"
        if self.qk_norm != qwen3:
            raise ValueError(f"TransformerConfig.qk_norm={self.qk_norm} on {self.architecture}; "
                             "q_norm/k_norm are Qwen3's (and Qwen3 has them)")  # fmt: skip
        if qwen3 and self.qkv_bias:
            raise ValueError("TransformerConfig.qkv_bias=True on Qwen3ForCausalLM, which has no q/k/v bias")
        if not qwen3 and self.num_q_heads * self.head_size != self.hidden_size:
            raise ValueError(
                f"TransformerConfig.head_size={self.head_size} is inconsistent: num_q_heads * head_size = "
                f"{self.num_q_heads * self.head_size} but hidden_size = {self.hidden_size}"
            )
        if self.head_size % 2:
            raise ValueError(f"TransformerConfig.head_size must be even for RoPE, got {self.head_size}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"TransformerConfig.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("TransformerConfig.rope_theta and rms_norm_eps must be positive")
        if self.rope_scaling is not None:
            check_llama3_scaling(self.rope_scaling, "TransformerConfig.rope_scaling")

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path) -> TransformerConfig:
        """Read a HF `config.json` (a file, or a directory holding one).

        Accepts LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM (its head_dim may differ
        from hidden_size / heads) with tied or untied embeddings, GQA, any rope_theta and
        rms_norm_eps, and Llama 3's RoPE scaling (`rope_scaling` or transformers 5's
        `rope_parameters` with rope_type "llama3"). Raises FileNotFoundError when there is no file, and ValueError
        naming the file and what is wrong for anything else: unreadable or malformed JSON, a field
        of the wrong type, or a field that asks for something the engine does not implement.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        try:
            d = json.loads(file.read_bytes())
        except (OSError, ValueError) as err:  # ValueError covers bad JSON and bad UTF-8
            raise ValueError(f"{file}: not readable JSON ({err})") from None
        return cls.from_hf_dict(d, source=str(file))

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> TransformerConfig:
        def bad(field, why):
            return ValueError(f"{source}: unsupported {field!r}: {why}")

        def number(key, kind, default=None, value=None):
            v = d.get(key, default) if value is None else value
            # finite JSON numbers only: a bool, a string, NaN or an int too large for a float is malformed
            ok = isinstance(v, int) or (kind is float and isinstance(v, float) and math.isfinite(v))
            if ok and not isinstance(v, bool):
                with contextlib.suppress(OverflowError):
                    return kind(v)
            raise bad(key, f"{v!r} is not {'an integer' if kind is int else 'a finite number'}")

        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, found {type(d).__name__}")
        archs = d.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise bad("architectures", f"{archs!r}; cuengine supports {list(ARCHITECTURES)}")
        arch = archs[0]
        if d.get("model_type", _MODEL_TYPE[arch]) != _MODEL_TYPE[arch]:
            raise bad("model_type", f"{d['model_type']!r} does not match architecture {arch}")
        if d.get("hidden_act", "silu") != "silu":
            raise bad("hidden_act", f"{d['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
        if arch == "LlamaForCausalLM":
            if d.get("attention_bias", False):
                raise bad("attention_bias", "true on a Llama; only Qwen2 has the qkv bias")
            if d.get("mlp_bias", False):
                raise bad("mlp_bias", "true; the MLP has no bias")
        if arch == "Qwen3ForCausalLM" and d.get("attention_bias", False):
            raise bad("attention_bias", "true on a Qwen3; the engine's Qwen3 has no projection biases")
        for key in _MOE_KEYS:
            if d.get(key) not in (None, 0):
                raise bad(key, f"{d[key]!r}; mixture of experts is not implemented (dense MLPs only)")
        if d.get("use_sliding_window", False):
            raise bad("use_sliding_window", "true; only full causal attention is implemented")
        layer_types = d.get("layer_types") or ["full_attention"]
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise bad("layer_types", f"{layer_types!r}; only full causal attention is implemented")
        # transformers >= 5 writes rope_parameters = {"rope_type", "rope_theta", ...} instead of rope_theta
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise bad("rope_parameters", f"{rope!r} is not a JSON object")
        rope_theta = number("rope_theta", float, 10000.0, rope.get("rope_theta"))
        scaling = None
        for key, given in (("rope_scaling", d.get("rope_scaling")), ("rope_parameters", rope)):
            if given is None or given == {}:
                continue
            if not isinstance(given, dict):
                raise bad(key, f"{given!r} is not a JSON object")
            kind = given.get("rope_type", given.get("type", "default"))
            if kind == "default":
                continue
            if kind != "llama3":
                raise bad(key, f"rope_type {kind!r}; only plain RoPE and 'llama3' scaling are implemented")
            parsed = {"rope_type": "llama3"}
            for k, kt in LLAMA3_KEYS.items():
                if k not in given:
                    raise bad(key, f"llama3 scaling without {k!r}")
                parsed[k] = number(k, kt, value=given[k])
            if scaling is not None and scaling != parsed:
                raise bad(key, f"{parsed} differs from the other RoPE scaling given, {scaling}")
            scaling = parsed
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in d:
                raise bad(key, "missing")
        hq = number("num_attention_heads", int)
        hkv = number("num_key_value_heads", int, hq) if d.get("num_key_value_heads") is not None else hq
        hidden = number("hidden_size", int)
        if hq <= 0 or hidden <= 0 or (hidden % hq and arch != "Qwen3ForCausalLM"):
            raise bad("num_attention_heads", f"{hq} does not divide hidden_size {hidden}")
        hs = hidden // hq
        if arch == "Qwen3ForCausalLM":  # o_proj maps Hq * head_dim to hidden_size; transformers' default is 128
            hs = number("head_dim", int, 128) if d.get("head_dim") is not None else 128
        elif d.get("head_dim") is not None and number("head_dim", int) != hs:
            raise bad("head_dim", f"{d['head_dim']} but hidden_size / num_attention_heads = {hs}")
        tied = d.get("tie_word_embeddings", False)
        if not isinstance(tied, bool):
            raise bad("tie_word_embeddings", f"{tied!r} is not true or false")
        torch_dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        if not isinstance(torch_dtype, str) or torch_dtype not in _TORCH_DTYPE:
            raise bad("torch_dtype", f"{torch_dtype!r}; cuengine stores bfloat16 or float32")
        sizes = {
            "vocab_size": number("vocab_size", int),
            "intermediate_size": number("intermediate_size", int),
            "num_layers": number("num_hidden_layers", int),
            "max_position_embeddings": number("max_position_embeddings", int, 4096),
        }
        rms_norm_eps = number("rms_norm_eps", float, 1e-6)
        try:
            return cls(
                **sizes,
                hidden_size=hidden,
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_size=hs,
                rope_theta=rope_theta,
                rms_norm_eps=rms_norm_eps,
                tied_embeddings=tied,
                qkv_bias=arch == "Qwen2ForCausalLM",
                architecture=arch,
                dtype=_TORCH_DTYPE[torch_dtype],
                qk_norm=arch == "Qwen3ForCausalLM",
                rope_scaling=scaling,
            )
        except (ValueError, ZeroDivisionError) as err:
            raise ValueError(f"{source}: {err}") from None

    def to_hf_dict(self) -> dict:
        """The config.json that HF transformers loads as the same model."""
        d = {
            "architectures": [self.architecture],
            "model_type": _MODEL_TYPE[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tied_embeddings,
            "hidden_act": "silu",
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": {v: k for k, v in _TORCH_DTYPE.items()}[self.dtype],
        }
        if self.architecture == "LlamaForCausalLM":
            d.update(attention_bias=False, mlp_bias=False, head_dim=self.head_size, pretraining_tp=1)
        else:
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        if self.architecture == "Qwen3ForCausalLM":
            d.update(attention_bias=False, head_dim=self.head_size)
        return d

    # ---- presets -----------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> TransformerConfig:
        """A named shape: "qwen2.5-0.5b", "qwen2.5-1.5b"; "small" (25M parameters at vocab 256,
        Qwen2-like, `cuengine train`'s default on a GPU); or the test sizes "tiny" (Qwen2-like:
        tied, qkv bias; the default on cpu), "tiny-llama" (untied, no bias), "tiny-hs64" (head
        size 64, for the raw attention kernel on GPU), "tiny-qwen3" (QK-norm, 4 heads of 32 over
        hidden 64) and "tiny-llama3" (Llama 3 RoPE scaling that changes the low frequencies);
        "qwen3-0.6b" and "llama3.2-1b" as published. Small and tiny presets use a byte vocabulary (256)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])


_QWEN = dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tied_embeddings=True, rope_theta=1e6,
             rms_norm_eps=1e-6, max_position_embeddings=32768, vocab_size=151936)  # fmt: skip
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=4, num_kv_heads=2,
             head_size=16, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)  # fmt: skip
_LLAMA3_TINY_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64}  # fmt: skip
PRESETS = {
    "qwen2.5-0.5b": dict(
        _QWEN, hidden_size=896, intermediate_size=4864, num_layers=24, num_q_heads=14, num_kv_heads=2, head_size=64
    ),
    "qwen2.5-1.5b": dict(
        _QWEN, hidden_size=1536, intermediate_size=8960, num_layers=28, num_q_heads=12, num_kv_heads=2, head_size=128
    ),
    "qwen2.5-3b": dict(
        _QWEN, hidden_size=2048, intermediate_size=11008, num_layers=36, num_q_heads=16, num_kv_heads=2, head_size=128
    ),
    "tiny": dict(_TINY, architecture="Qwen2ForCausalLM", qkv_bias=True, tied_embeddings=True),
    "tiny-llama": dict(_TINY, architecture="LlamaForCausalLM", qkv_bias=False, tied_embeddings=False),
    "tiny-qwen3": dict(
        _TINY, architecture="Qwen3ForCausalLM", qkv_bias=False, tied_embeddings=True, qk_norm=True, head_size=32
    ),
    "tiny-llama3": dict(
        _TINY, architecture="LlamaForCausalLM", qkv_bias=False, tied_embeddings=False, rope_scaling=_LLAMA3_TINY_SCALING
    ),
    "qwen3-0.6b": dict(
        _QWEN,
        qkv_bias=False,
        architecture="Qwen3ForCausalLM",
        qk_norm=True,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=28,
        num_q_heads=16,
        num_kv_heads=8,
        head_size=128,
        max_position_embeddings=40960,
    ),
    "llama3.2-1b": dict(
        architecture="LlamaForCausalLM",
        qkv_bias=False,
        tied_embeddings=True,
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_size=64,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "small": dict(
        _TINY,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        tied_embeddings=True,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_q_heads=8,
        num_kv_heads=4,
        head_size=64,
        max_position_embeddings=1024,
    ),
    "tiny-hs64": dict(
        _TINY,
        hidden_size=256,
        intermediate_size=384,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        tied_embeddings=True,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=64,
    ),
}


def check_llama3_scaling(scaling, what: str) -> None:
    """ValueError naming `what` unless `scaling` is a complete, usable Llama 3 rope scaling."""
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        raise ValueError(f"{what}: only {{'rope_type': 'llama3', ...}} is implemented, got {scaling!r}")
    extra = sorted(set(scaling) - set(LLAMA3_KEYS) - {"rope_type"})
    if extra:
        raise ValueError(f"{what}: unknown llama3 keys {extra}")
    for k, kt in LLAMA3_KEYS.items():
        v = scaling.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kt is int and not isinstance(v, int)):
            raise ValueError(f"{what}: {k} must be {'an int' if kt is int else 'a number'}, got {v!r}")
    if not scaling["factor"] >= 1 or scaling["original_max_position_embeddings"] < 1:
        raise ValueError(f"{what}: factor must be >= 1 and original_max_position_embeddings >= 1, got {scaling}")
    if not 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError(f"{what}: need 0 < low_freq_factor < high_freq_factor, got {scaling}")
