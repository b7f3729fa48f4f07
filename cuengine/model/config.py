"""TransformerConfig: the shape of a LLaMA / Qwen2 decoder, read from and written to HF config.json.

Only what the engine implements is accepted: a config.json that asks for anything else (another
architecture, RoPE scaling, a sliding window in use, biases on a Llama...) is refused with an
error naming the field, rather than silently training a different model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_TORCH_DTYPE = {"bfloat16": "bf16", "float32": "fp32"}


@dataclass
class TransformerConfig:
    vocab_size: int  # V: rows of the embedding and of the LM head
    hidden_size: int  # C: width of the residual stream; equals num_q_heads * head_size
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
    architecture: str = "LlamaForCausalLM"  # "LlamaForCausalLM" or "Qwen2ForCausalLM"
    dtype: str = "bf16"  # dtype of the stored weights: "bf16" or "fp32"

    def __post_init__(self):
        self.validate()

    # ---- derived sizes -----------------------------------------------------------------------
    @property
    def qkv_channels(self) -> int:
        """Rows of the packed qkv projection: (Hq + 2 Hkv) * hs."""
        return (self.num_q_heads + 2 * self.num_kv_heads) * self.head_size

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
        if self.num_q_heads * self.head_size != self.hidden_size:
            raise ValueError(
                f"TransformerConfig.head_size={self.head_size} is inconsistent: num_q_heads * head_size = "
                f"{self.num_q_heads * self.head_size} but hidden_size = {self.hidden_size}"
            )
        if self.head_size % 2:
            raise ValueError(f"TransformerConfig.head_size must be even for RoPE, got {self.head_size}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"TransformerConfig.architecture must be {ARCHITECTURES}, got {self.architecture!r}")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"TransformerConfig.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("TransformerConfig.rope_theta and rms_norm_eps must be positive")

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path) -> TransformerConfig:
        """Read a HF `config.json` (a file, or a directory holding one).

        Accepts LlamaForCausalLM and Qwen2ForCausalLM with tied or untied embeddings, GQA, any
        rope_theta and rms_norm_eps. Raises FileNotFoundError when there is no file, and ValueError
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
        if d.get("rope_scaling") is not None:
            raise bad("rope_scaling", f"{d['rope_scaling']!r}; only plain RoPE is implemented")
        if arch == "LlamaForCausalLM":
            if d.get("attention_bias", False):
                raise bad("attention_bias", "true on a Llama; only Qwen2 has the qkv bias")
            if d.get("mlp_bias", False):
                raise bad("mlp_bias", "true; the MLP has no bias")
        if d.get("use_sliding_window", False):
            raise bad("use_sliding_window", "true; only full causal attention is implemented")
        layer_types = d.get("layer_types") or ["full_attention"]
        if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
            raise bad("layer_types", f"{layer_types!r}; only full causal attention is implemented")
        # transformers >= 5 writes rope_parameters = {"rope_type", "rope_theta", ...} instead of rope_theta
        rope = d.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise bad("rope_parameters", f"{rope!r} is not a JSON object")
        if rope.get("rope_type", "default") != "default":
            raise bad("rope_parameters", f"rope_type {rope['rope_type']!r}; only plain RoPE is implemented")
        rope_theta = number("rope_theta", float, 10000.0, rope.get("rope_theta"))
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in d:
                raise bad(key, "missing")
        hq = number("num_attention_heads", int)
        hkv = number("num_key_value_heads", int, hq) if d.get("num_key_value_heads") is not None else hq
        hidden = number("hidden_size", int)
        if hq <= 0 or hidden <= 0 or hidden % hq:
            raise bad("num_attention_heads", f"{hq} does not divide hidden_size {hidden}")
        hs = hidden // hq
        if d.get("head_dim") is not None and number("head_dim", int) != hs:
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
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": {v: k for k, v in _TORCH_DTYPE.items()}[self.dtype],
        }
        if self.architecture == "LlamaForCausalLM":
            d.update(attention_bias=False, mlp_bias=False, head_dim=self.head_size, pretraining_tp=1)
        else:
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        return d

    # ---- presets -----------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> TransformerConfig:
        """A named shape: "qwen2.5-0.5b", "qwen2.5-1.5b"; "small" (25M parameters at vocab 256,
        Qwen2-like, `cuengine train`'s default on a GPU); or the test sizes "tiny" (Qwen2-like:
        tied, qkv bias; the default on cpu), "tiny-llama" (untied, no bias) and "tiny-hs64" (head
        size 64, for the raw attention kernel on GPU). Small and tiny presets use a byte vocabulary (256)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])


_QWEN = dict(architecture="Qwen2ForCausalLM", qkv_bias=True, tied_embeddings=True, rope_theta=1e6,
             rms_norm_eps=1e-6, max_position_embeddings=32768, vocab_size=151936)  # fmt: skip
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=4, num_kv_heads=2,
             head_size=16, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)  # fmt: skip
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
