"""Typed per-layer records of the run state (the seed's sLLamaLayerActivations and its gradients).

One field per buffer, with its shape. Several layers' records may hold the same Tensor: the run
state shares a buffer across layers when backward recomputes it (the recompute flags), and every
layer's gradient record aliases layer 0's buffers. FP8 stats are never shared: each layer's quant
copies carry their own stats slot, so a shared quant buffer still keeps each layer's scales.

Shapes: C hidden, H intermediate, Q = (Hq + 2 Hkv) * head_size, Hq query heads, A = Hq * head_size
the attention output (C except on Qwen3).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..tensor import Tensor


@dataclass
class QuantTensor:
    """An operand of a block matmul and, when the matmuls run in FP8, its quantized copy.

    The FP8 path is a property of the operand: `quant` is None with BF16/FP32 matmuls. The
    producer of `value` fuses the abs-max into its kernel (`abs_max`), and the matmul quantizes
    with it into `quant`, whose stats slot holds that layer's abs-max and scales.
    """

    value: Tensor
    quant: Tensor | None = None  # same shape, e4m3 (activations) or the gradient dtype; carries stats

    @property
    def abs_max(self) -> Tensor | None:
        """The slot where the producer of `value` records max|value| (None: no FP8 copy)."""
        return None if self.quant is None else self.quant.abs_max


@dataclass
class LayerActivations:
    """What one block's forward keeps for its backward."""

    ln1_rstd: Tensor  # (B, T) fp32
    ln2_rstd: Tensor  # (B, T) fp32
    ln1: QuantTensor  # (B, T, C) RMSNorm of the block input
    qkv: Tensor  # (B, T, Q) after RoPE (and QK-norm)
    lse: Tensor  # (B, Hq, T) fp32 attention log-sum-exp
    att: QuantTensor  # (B, T, A) attention output, before the output projection
    res_att: Tensor  # (B, T, C) residual after attention: block input + att_o
    ln2: QuantTensor  # (B, T, C) RMSNorm of res_att
    mlp_up: Tensor | None  # (B, T, 2H) [gate | up]; None when recomputed onto the stack (opts.rc_mlp_up_at)
    swiglu: QuantTensor  # (B, T, H) silu(gate) * up
    # QK-norm (cfg.qk_norm) only, shared across layers like qkv under the recompute flags:
    qkv_pre: Tensor | None = None  # (B, T, Q) the projection's output, before QK-norm (its backward reads it)
    qk_rstd: Tensor | None = None  # (B, T, Hq + Hkv) fp32 per-head 1/rms of QK-norm


@dataclass
class LayerGradients:
    """One block's activation gradients. Without keep_all_activations every layer's record holds
    layer 0's buffers, and d_res_att, d_ln2, d_att_y and d_ln1 alias other buffers (see RunState)."""

    d_res_ffn: QuantTensor  # (B, T, C) gradient of the block output (the next block's residual)
    d_res_att: QuantTensor  # (B, T, C) gradient of res_att
    d_ln2: Tensor  # (B, T, C)
    d_att_y: Tensor  # (B, T, A) gradient of att
    d_ln1: Tensor  # (B, T, C)
    # d_qkv and d_mlp_up are stack temporaries; with FP8 these are their quant copies:
    d_qkv_q: Tensor | None  # (B, T, Q) in the gradient dtype
    d_mlp_up_q: Tensor | None  # (B, T, 2H) layout and stats slot only: the FP8 copy is put on the stack
