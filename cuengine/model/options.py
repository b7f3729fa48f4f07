"""TrainOptions: precision, recompute, memory and optimizer settings of a training run.

The recompute flags follow LLMQ: each one lets the run state share one buffer across layers for
that activation and recompute it during backward, trading FLOPs for memory. Every combination is
required to give bitwise the same losses and gradients as the baseline.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

_MODEL_DTYPES = ("bf16", "fp32")
_MATMUL_DTYPES = ("fp32", "bf16", "e4m3")
_FP8_GRAD_DTYPES = ("e4m3", "e5m2")
_BACKENDS = ("auto", "raw", "cudnn")
OPTIMIZERS = ("adamw", "adamw8bit", "muon")

# The memory presets (`memory_preset`, the CLI's and tools/bench_train.py's `--memory`). Measured on the H200
# at B=8, T=1024, bf16 AdamW moments (the compiled HF peer's precision; PERF_NOTES 25):
# - "default" (TrainOptions' own defaults): the LM head in chunks whose logits fit in 1 GiB
#   (`auto_lmhead_chunks`) and SwiGLU recomputed from mlp_up, the cheapest bytes to drop (one
#   memory-bound pass a layer): 3-5% slower than "fast", and at 0.5B within 0.6x the peer's peak.
# - "fast": neither, every activation kept: the quickest step, the most memory.
# - "lean": also RMSNorm recomputed and the up projection in the first half of the layers
#   (recompute_ffn_layers): about 10% slower than "fast" (9.7-10.7%), and within 0.6x the peer at 0.5B and 1.5B.
MEMORY_PRESETS = ("default", "fast", "lean")
# Logits of one LM-head chunk above this are split further (auto_lmhead_chunks)
_LMHEAD_CHUNK_BYTES = 1 << 30


def memory_preset(name: str, num_layers: int) -> dict:
    """The TrainOptions fields of memory preset `name` (MEMORY_PRESETS) for a model of `num_layers`."""
    if name not in MEMORY_PRESETS:
        raise ValueError(f"memory preset must be one of {MEMORY_PRESETS}, got {name!r}")
    if name == "fast":
        return {"recompute_swiglu": False, "lmhead_chunks": 1}
    if name == "lean":
        return {"recompute_rmsnorm": True, "recompute_ffn_layers": num_layers // 2}
    return {}


def auto_lmhead_chunks(rows: int, vocab: int, itemsize: int) -> int:
    """lmhead_chunks=None: the fewest chunks (halving while the rows stay even and >= 1024 a chunk)
    whose (rows / chunks, vocab) logits fit in 1 GiB: the logits are the step's largest temporary,
    and chunks of >= 1024 rows keep the head's GEMMs at their speed (a 2048-row chunk costs the 0.5B
    step under 1%)."""
    chunks = 1
    while (
        rows // chunks * vocab * itemsize > _LMHEAD_CHUNK_BYTES
        and rows % (2 * chunks) == 0
        and (rows // (2 * chunks) >= 1024)
    ):
        chunks *= 2
    return chunks


@dataclass
class TrainOptions:
    # ---- precision ---------------------------------------------------------------------------
    model_dtype: str | None = None  # weights, activations and gradients: "bf16" or "fp32" (None: the config's)
    matmul_dtype: str | None = None  # operands of the block matmuls: model dtype or "e4m3" (None: model dtype)
    grad_dtype: str | None = None  # activation gradients fed to FP8 matmuls: "e4m3"/"e5m2" (None: matmul dtype)
    opt_m_dtype: str = "fp32"  # AdamW first moment: "fp32" or "bf16"
    opt_v_dtype: str = "fp32"  # AdamW second moment: "fp32" or "bf16"
    # also run the LM head's three GEMMs in FP8 (E4M3 lnf and head weight, grad_dtype dlogits; per-chunk
    # scales); needs matmul_dtype "e4m3". Off by default: the logits then carry E4M3 rounding (~2^-4 relative)
    lmhead_fp8: bool = False
    # FP8 only: > 0 scales each layer's two largest FP8 tensors, the SwiGLU output (E4M3) and the gradient of
    # the up projection's output (grad_dtype), from the largest abs-max of the last this-many micro-steps
    # (delayed scaling), so that the kernels computing them write the FP8 copies themselves: one pass over
    # each fewer a layer. The scale then lags the values: one larger than the history's max saturates.
    # The first micro-step (empty history) scales them as the rest. With several ranks the abs-maxes are the max
    # over the ranks (one history everywhere, which checkpoints carry). 0: every tensor from its own abs-max
    # (current scaling). None: 16 with FP8 matmuls (on the H100 it took 5.6% off the 0.5B FP8 step and 4.3% off
    # the 1.5B one, its loss after 200 steps within the seeds' spread of current scaling's), else 0.
    fp8_amax_history: int | None = None
    # ---- recompute and memory ----------------------------------------------------------------
    recompute_rmsnorm: bool = False  # recompute ln1/ln2 in backward; one shared buffer each
    recompute_qkv: bool = False  # recompute the qkv projection + RoPE in backward
    recompute_att: bool = False  # recompute ln1, qkv and attention in backward
    recompute_ffn: bool = False  # recompute ln2, the up projection and SwiGLU; mlp_up lives on the stack
    # recompute the up projection in the first this-many layers only (their mlp_up on the stack, as with
    # recompute_ffn; the others keep theirs): memory between none and recompute_ffn, one GEMM a layer
    recompute_ffn_layers: int = 0
    # recompute SwiGLU from mlp_up in backward; None: on (the default preset), off with keep_all_activations
    recompute_swiglu: bool | None = None
    recompute_block: bool = False  # recompute the whole block from its input residual
    keep_all_activations: bool = False  # never share activation buffers across layers (debugging aid)
    offload_residual: bool = False  # keep the per-layer residuals in pinned host memory, double-buffered
    # split the B*T rows of the LM head + loss into this many chunks; None: `auto_lmhead_chunks` at allocation
    lmhead_chunks: int | None = None
    attn_bwd_chunks: int = 1  # split the batch of the attention backward into this many chunks
    attention_backend: str = "auto"  # "auto", "raw" (our flash kernel) or "cudnn"
    # False: cuDNN's faster attention backward (dQ added with atomics, no dQ pass); its bits vary
    # from run to run, so the bitwise-repeatability promises no longer hold. The raw backend ignores it.
    attention_deterministic: bool = True
    use_cuda_graphs: bool = False  # capture each block's forward and backward once, then replay
    # ---- optimizer ---------------------------------------------------------------------------
    optimizer: str = "adamw"  # "adamw", "adamw8bit" (8-bit block-wise moments) or "muon" (see model/muon.py)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum (the block matrices; the rest takes beta1/beta2)
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables clipping
    weight_decay: float = 0.1  # AdamW decoupled weight decay on matrices (not norms or biases)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    z_loss: float = 0.0  # coefficient of the z-loss (lse^2) regulariser
    skip_nonfinite_steps: bool = False  # a non-finite gradient norm skips the step (counted) instead of raising
    seed: int = 42  # seeds the optimizer's stochastic-rounding stream
    # ---- several GPUs ------------------------------------------------------------------------
    zero_stage: int = 0  # with a communicator of several ranks: 0 data parallel, 1 shard AdamW, 2 also gradients

    def __post_init__(self):
        self.validate()

    def resolved(self, config_dtype: str) -> TrainOptions:
        """A copy with every None filled in from `config_dtype`, checked; raises ValueError naming
        the option for an invalid value or combination."""
        o = dataclasses.replace(self)
        o.model_dtype = o.model_dtype or config_dtype
        if o.recompute_swiglu is None:
            o.recompute_swiglu = not o.keep_all_activations
        o.matmul_dtype = o.matmul_dtype or o.model_dtype
        if o.grad_dtype is None:
            o.grad_dtype = "e5m2" if o.fp8 else o.matmul_dtype
        if o.fp8_amax_history is None:
            o.fp8_amax_history = 16 if o.fp8 else 0
        o.validate()
        return o

    def validate(self) -> None:
        """Raise ValueError naming the option for an invalid value or combination. A dtype left
        None (filled in from the config by `resolved`) skips the checks that need it, so a
        construction checks all it can without the config and `resolved` checks the rest."""

        def bad(msg):
            return ValueError(f"TrainOptions: {msg}")

        model, matmul, grad = self.model_dtype, self.matmul_dtype, self.grad_dtype
        if model is not None and model not in _MODEL_DTYPES:
            raise bad(f"model_dtype must be one of {_MODEL_DTYPES}, got {model!r}")
        if matmul is not None and matmul not in _MATMUL_DTYPES:
            raise bad(f"matmul_dtype must be one of {_MATMUL_DTYPES}, got {matmul!r}")
        if grad is not None and grad not in _MATMUL_DTYPES + _FP8_GRAD_DTYPES:
            raise bad(f"grad_dtype must be one of {_FP8_GRAD_DTYPES} (FP8 matmuls) or None, got {grad!r}")
        if self.fp8:
            if model not in (None, "bf16"):
                raise bad(f"matmul_dtype 'e4m3' needs model_dtype 'bf16', got {model!r}")
            if grad is not None and grad not in _FP8_GRAD_DTYPES:
                raise bad(f"grad_dtype must be one of {_FP8_GRAD_DTYPES} with FP8 matmuls, got {grad!r}")
        else:
            if None not in (matmul, model) and matmul != model:
                raise bad(f"matmul_dtype {matmul!r} differs from model_dtype {model!r}; only 'e4m3' may differ")
            # without FP8 matmuls the gradients are in the matmul dtype, which is the model's
            known = matmul or model
            if grad is not None and (grad in _FP8_GRAD_DTYPES or (known is not None and grad != known)):
                raise bad(f"grad_dtype {grad!r} needs FP8 matmuls; with {known or 'the model dtype'} leave it None")
        v = self.fp8_amax_history
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 1024):
            raise bad(f"fp8_amax_history must be an int in [0, 1024], got {v!r}")
        if v and matmul is not None and not self.fp8:
            raise bad(f"fp8_amax_history scales FP8 tensors: it needs matmul_dtype 'e4m3', got {matmul!r}")
        if not isinstance(self.lmhead_fp8, bool):
            raise bad(f"lmhead_fp8 must be True or False, got {self.lmhead_fp8!r}")
        if self.lmhead_fp8 and matmul is not None and not self.fp8:
            raise bad(f"lmhead_fp8 needs matmul_dtype 'e4m3' (FP8 matmuls), got {matmul!r}")
        if self.optimizer not in OPTIMIZERS:
            raise bad(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("opt_m_dtype", "opt_v_dtype"):
            if getattr(self, name) not in ("fp32", "bf16"):
                raise bad(f"{name} must be 'fp32' or 'bf16', got {getattr(self, name)!r}")
        if self.keep_all_activations and self.any_recompute:
            raise bad("keep_all_activations contradicts the recompute_* flags (which share buffers); choose one")
        v = self.recompute_ffn_layers
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise bad(f"recompute_ffn_layers must be an int >= 0, got {v!r}")
        if v and (self.recompute_ffn or self.recompute_block):
            raise bad("recompute_ffn_layers is for some layers; recompute_ffn / recompute_block already recompute "
                      "every layer's up projection: choose one")  # fmt: skip
        for name in ("lmhead_chunks", "attn_bwd_chunks"):
            v = getattr(self, name)
            if v is None and name == "lmhead_chunks":  # chosen at allocation
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be an int >= 1, got {v!r}")
        if self.zero_stage not in (0, 1, 2) or isinstance(self.zero_stage, bool):
            raise bad(f"zero_stage must be 0, 1 or 2, got {self.zero_stage!r}")
        if self.attention_backend not in _BACKENDS:
            raise bad(f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        for name in ("attention_deterministic", "skip_nonfinite_steps"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("grad_clip", "weight_decay", "eps", "z_loss", "beta1", "beta2", "muon_momentum"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise bad(f"{name} must be a number, got {v!r}")
        for name in ("grad_clip", "weight_decay", "eps", "z_loss"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise bad(f"{name} must be finite and >= 0, got {v!r}")
        for name in ("beta1", "beta2", "muon_momentum"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise bad(f"{name} must be in [0, 1), got {v!r}")

    # ---- derived flags (the seed's _recompute_block) -----------------------------------------
    @property
    def any_recompute(self) -> bool:
        return any((self.recompute_rmsnorm, self.recompute_qkv, self.recompute_att, self.recompute_ffn,
                    self.recompute_swiglu, self.recompute_block, self.recompute_ffn_layers))  # fmt: skip

    @property
    def fp8(self) -> bool:
        return self.matmul_dtype == "e4m3"

    @property
    def rc_ln1(self) -> bool:
        return self.recompute_rmsnorm or self.recompute_att or self.recompute_block

    @property
    def rc_ln2(self) -> bool:
        return self.recompute_rmsnorm or self.recompute_ffn or self.recompute_block

    @property
    def rc_qkv(self) -> bool:
        return self.recompute_qkv or self.recompute_att or self.recompute_block

    @property
    def rc_att(self) -> bool:
        return self.recompute_att or self.recompute_block

    @property
    def rc_mlp_up(self) -> bool:
        return self.recompute_ffn or self.recompute_block

    def rc_mlp_up_at(self, layer: int) -> bool:
        """Layer `layer` recomputes its up projection in backward (its mlp_up lives on the stack)."""
        return self.rc_mlp_up or layer < self.recompute_ffn_layers

    @property
    def rc_swiglu(self) -> bool:
        return self.recompute_swiglu or self.recompute_ffn or self.recompute_block
