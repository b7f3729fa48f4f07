"""TransformerConfig: the shape of a LLaMA / Qwen2 decoder, read from and written to HF config.json.

Only what the engine implements is accepted: a config.json that asks for anything else (another
architecture, RoPE scaling, a sliding window in use, biases on a Llama...) is refused with an
error naming the field, rather than silently training a different model.
"""

from __future__ import annotations

import dataclasses
import json
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
        rope_theta and rms_norm_eps. Raises ValueError naming the field for anything else.
        """
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}")
        return cls.from_hf_dict(json.loads(file.read_text()), source=str(file))

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> TransformerConfig:
        def bad(field, why):
            return ValueError(f"{source}: unsupported {field!r}: {why}")

        archs = d.get("architectures") or []
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
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
        layer_types = set(d.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise bad("layer_types", f"{sorted(layer_types)}; only full causal attention is implemented")
        # transformers >= 5 writes rope_parameters = {"rope_type", "rope_theta", ...} instead of rope_theta
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise bad("rope_parameters", f"rope_type {rope['rope_type']!r}; only plain RoPE is implemented")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in d:
                raise bad(key, "missing")
        hq = int(d["num_attention_heads"])
        hkv = int(d.get("num_key_value_heads") or hq)
        hidden = int(d["hidden_size"])
        if hidden % hq:
            raise bad("num_attention_heads", f"{hq} does not divide hidden_size {hidden}")
        hs = hidden // hq
        if d.get("head_dim") is not None and int(d["head_dim"]) != hs:
            raise bad("head_dim", f"{d['head_dim']} but hidden_size / num_attention_heads = {hs}")
        torch_dtype = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
        if torch_dtype not in _TORCH_DTYPE:
            raise bad("torch_dtype", f"{torch_dtype!r}; cuengine stores bfloat16 or float32")
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_q_heads=hq,
                num_kv_heads=hkv,
                head_size=hs,
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tied_embeddings=bool(d.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM",
                architecture=arch,
                dtype=_TORCH_DTYPE[torch_dtype],
            )
        except ValueError as err:
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
