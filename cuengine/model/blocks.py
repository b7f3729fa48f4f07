"""The code of a step's decoder blocks and LM head, over a run state's buffers (seed 001).

`Blocks` holds the seed's `_forward_block`, `_recompute_block` and `_backward_block`, and the
matmuls they go through, `qmm_forward` / `qmm_backward` (the seed's forward_qmm / backward_qmm).
Those switch between plain BF16/FP32 GEMMs and FP8 GEMMs (E4M3 weights and activations, E5M2 or
E4M3 gradients, transposed copies for the TN-only weight-gradient GEMMs) by the operand: a
`QuantTensor` with a quant copy takes the FP8 path.

Every launch goes through a `Kernels` table. `RECORDING` has the same launchers, each doing
nothing, so the real code run against a simulated stack measures the stack a step needs
(`RunState.size_stack`): there is no second description of the step to keep in step with this one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import blas
from ..dtypes import FP32
from ..kernels import activations, attention, classifier, fp8, qknorm, rmsnorm, rope
from ..tensor import STATS_SLOTS
from .records import LayerActivations, LayerGradients, QuantTensor


def _no_launch(*args, **kwargs) -> None:
    """A launch on a recording pass: nothing runs and no memory is touched."""


def _fill_zero(t, stream=None) -> None:
    t.fill_zero(stream)


@dataclass(frozen=True)
class Kernels:
    """The launchers that block and LM-head code calls; `Kernels.recording()` makes them no-ops."""

    matmul: Callable = blas.matmul
    rmsnorm_forward: Callable = rmsnorm.rmsnorm_forward
    fused_residual_rmsnorm_forward: Callable = rmsnorm.fused_residual_rmsnorm_forward
    rmsnorm_backward: Callable = rmsnorm.rmsnorm_backward
    rope_forward: Callable = rope.rope_forward
    rope_backward: Callable = rope.rope_backward
    qknorm_forward: Callable = qknorm.qknorm_forward
    qknorm_backward: Callable = qknorm.qknorm_backward
    attention_forward: Callable = attention.attention_forward
    attention_backward: Callable = attention.attention_backward
    swiglu_forward: Callable = activations.swiglu_forward
    activation_forward_quant: Callable = activations.activation_forward_quant
    swiglu_backward: Callable = activations.swiglu_backward
    abs_max: Callable = fp8.abs_max
    quantize_with_abs_max: Callable = fp8.quantize_with_abs_max
    quantize_and_transpose: Callable = fp8.quantize_and_transpose
    quantize_dual: Callable = fp8.quantize_dual
    transpose: Callable = fp8.transpose
    bias_backward: Callable = fp8.bias_backward
    fused_classifier: Callable = classifier.fused_classifier
    fill_zero: Callable = _fill_zero  # a stack temporary's stats slot (no memory on a recording pass)

    @classmethod
    def recording(cls) -> Kernels:
        return cls(**{f.name: _no_launch for f in dataclasses.fields(cls)})


LIVE = Kernels()
RECORDING = Kernels.recording()


@dataclass(frozen=True)
class _HeadQuant:
    """The FP8 LM head's stack temporaries for one chunk of rows (`Blocks._head_quant`)."""

    stats: object  # (2, STATS_SLOTS) fp32: x's stats, then dlogits'
    x: object  # (n, C) E4M3 with stats[0]
    dlogits: object  # (n, V) grad_dtype with stats[1], or None without backward


class Blocks:
    """Forward, recompute and backward of the decoder blocks, and the LM head.

    Args:
        cfg: TransformerConfig.
        opts: resolved TrainOptions (recompute flags, chunks, attention backend).
        weights: ModelWeights, with its FP8 copies when opts.fp8.
        rs: the RunState: its per-layer records and the shared buffers (stack, RoPE table,
            attention workspace, scratch, lnf) the code uses.
        grads: per block, {short name ("qkv_w", ...): parameter gradient}; None for forward only.
        kernels: LIVE, or RECORDING to run the code without launching anything.
    """

    def __init__(self, cfg, opts, weights, rs, grads: list[dict] | None = None, kernels: Kernels = LIVE):
        self.cfg, self.opts, self.weights, self.rs = cfg, opts, weights, rs
        self.grads = grads
        self.k = kernels
        # [(start, stop)] row ranges of (B*T) that hold real tokens when the batch is padded (logits of
        # a smaller batch): FP8 scales then come from those rows alone. None: every row is real.
        self.real_rows: list[tuple[int, int]] | None = None
        # FP8 matmul inputs whose stored E4M3 copy holds the transposed values (C, N), written by the
        # forward's quantize (quantize_dual, the plain copy a stack temporary for the forward GEMM), so
        # the backward's weight-gradient GEMM reads it without a transpose pass. Only where the copy is
        # one per layer and nothing after the forward reads it untransposed: a shared copy is rewritten
        # by recompute, and a recomputed qkv (rc_qkv) or mlp_up (rc_mlp_up_at) GEMM reads ln1's or ln2's.
        # (A recomputed SwiGLU output's shared copy is rewritten transposed: backward_block.)
        self.stored_tp = {
            "ln1": not (opts.recompute_rmsnorm or opts.rc_qkv),
            "ln2": not (opts.recompute_rmsnorm or opts.rc_mlp_up),  # and per layer: `_ln2_stored_tp`
            "swiglu": not opts.rc_swiglu,
        }

    # ---- matmuls (the seed's forward_qmm / backward_qmm) --------------------------------------
    def qmm_forward(self, out, inp: QuantTensor, wname: str, bias=None, reuse_quant: bool = False,
                    store_tp: bool = False) -> None:  # fmt: skip
        """out (N, OC) = inp (N, C) · Wᵀ (+ bias). FP8: quantize inp with its stored abs-max
        (unless `reuse_quant`: its FP8 copy is already valid) and use the E4M3 weight copy.
        `store_tp`: inp's FP8 buffer gets the transposed copy (C, N) (for `qmm_backward(stored_tp=True)`)
        and the plain copy the GEMM reads is a stack temporary, both from one `quantize_dual` pass."""
        k = self.k
        if inp.quant is None:
            k.matmul(out, inp.value, self.weights[wname], bias)
            return
        if not reuse_quant:
            if self.real_rows is not None:  # the producer's abs-max saw the padding rows too
                inp.abs_max.fill_zero()
                rows = inp.value.reshape(-1, inp.value.shape[-1])
                for start, stop in self.real_rows:
                    k.abs_max(inp.abs_max, rows.rows(start, stop))
            if store_tp:
                C = inp.value.shape[-1]
                N = inp.value.nelem // C
                with self.rs.stack.temporary(inp.quant.dtype, (N, C), "x_q") as raw:
                    plain = raw.with_stats(inp.quant.stats)
                    k.quantize_dual(plain, inp.quant.reshape(C, N), inp.value)  # (N, C) and (C, N), one read
                    k.matmul(out, plain, self.weights.fp8[wname], bias)
                return
            k.quantize_with_abs_max(inp.quant, inp.value)
        k.matmul(out, inp.quant, self.weights.fp8[wname], bias)

    def qmm_backward(self, dinp, dweight, dbias, dout: QuantTensor, inp: QuantTensor, wname: str,
                     reuse_inp: bool, stored_tp: bool = False, after_dinp=None, dout_tp=None) -> None:  # fmt: skip
        """dinp (N, C) = dout (N, OC) · W;  dweight (OC, C) += doutᵀ · inp;  dbias += Σ dout.

        `after_dinp()`, if given, runs once dinp is written and before dweight reads inp (it may write inp).
        `dout_tp` (OC, N), FP8 only: dout's quant copy and this transpose are already written (by the kernel
        that computed dout, with a delayed scale), so dout is not quantised here.

        FP8: dout is quantized to the gradient dtype with the abs-max its producer recorded;
        both GEMMs are TN, so they read W's transposed E4M3 copy (made with W8 after each update)
        and transposed copies of dout (written by the same pass as its plain copy) and inp (from
        its stored FP8 copy when `reuse_inp`, else quantized and transposed at once), both stack
        temporaries; with `stored_tp` inp's FP8 buffer already holds its transpose
        (`qmm_forward(store_tp=True)`) and is read as it is.
        """
        k, stack = self.k, self.rs.stack
        if dbias is not None:
            k.bias_backward(dbias, dout.value, self.rs.bias_scratch)
        if dout.quant is None:
            k.matmul(dinp, dout.value, self.weights[wname], trans_b=False)
            if after_dinp is not None:
                after_dinp()
            k.matmul(dweight, dout.value, inp.value, trans_a=True, trans_b=False, accumulate=True)
            return
        OC, C = dout.value.shape[-1], inp.value.shape[-1]
        N = dout.value.nelem // OC
        grad_raw = None
        if dout_tp is None:
            grad_raw = stack.allocate(dout.quant.dtype, (OC, N), "grad_tp")
            dout_tp = grad_raw.with_stats(dout.quant.stats)
            k.quantize_dual(dout.quant, dout_tp, dout.value)  # one read of dout for both copies
        k.matmul(dinp, dout.quant, self.weights.fp8_tp[wname])  # (N, OC) · (C, OC)ᵀ
        if after_dinp is not None:
            after_dinp()
        if stored_tp:
            k.matmul(dweight, dout_tp, inp.quant.reshape(C, N), accumulate=True)  # (OC, N) · (C, N)ᵀ
        else:
            with stack.temporary(inp.quant.dtype, (C, N), "act_tp") as act_raw:
                act_tp = act_raw.with_stats(inp.quant.stats)
                if reuse_inp:
                    k.transpose(act_tp, inp.quant)
                else:
                    k.quantize_and_transpose(act_tp, inp.value)
                k.matmul(dweight, dout_tp, act_tp, accumulate=True)  # (OC, N) · (C, N)ᵀ
        if grad_raw is not None:
            stack.free(grad_raw)

    @contextlib.contextmanager
    def _quant_on_stack(self, t: QuantTensor):
        """`t` with memory from the stack for its quant copy, which has only a layout and a stats slot."""
        if t.quant is None:
            yield t
            return
        with self.rs.stack.temporary(t.quant.dtype, t.quant.shape, t.quant.name) as raw:
            yield QuantTensor(t.value, raw.with_stats(t.quant.stats))

    def _ln2_stored_tp(self, i: int) -> bool:
        """Layer i's ln2 FP8 copy holds its transpose: not where backward's recompute of mlp_up reads it."""
        return self.stored_tp["ln2"] and not self.opts.rc_mlp_up_at(i)

    @contextlib.contextmanager
    def _mlp_up(self, a: LayerActivations):
        """The layer's mlp_up buffer, or where it is recomputed (rc_mlp_up_at) a stack temporary."""
        if a.mlp_up is not None:
            yield a.mlp_up
            return
        rs = self.rs
        with rs.stack.temporary(rs.dtype, (rs.B, rs.T, 2 * self.cfg.intermediate_size), "mlp_up") as t:
            yield t

    def _qkv(self, i: int, a: LayerActivations, reuse_quant: bool = False) -> None:
        """a.qkv = RoPE(QK-norm(ln1 · qkv_wᵀ + qkv_b)); QK-norm (Qwen3) keeps its input in a.qkv_pre."""
        k, rs, cfg = self.k, self.rs, self.cfg
        w, p = self.weights.block(i), f"layers.{i}."
        Hq, Hkv = cfg.num_q_heads, cfg.num_kv_heads
        tp = self.stored_tp["ln1"]  # False whenever recompute calls this (rc_qkv)
        if cfg.qk_norm:
            self.qmm_forward(a.qkv_pre, a.ln1, p + "qkv_w", w.get("qkv_b"), reuse_quant=reuse_quant, store_tp=tp)
            k.qknorm_forward(a.qkv, a.qk_rstd, a.qkv_pre, w["q_norm_w"], w["k_norm_w"], Hq, Hkv, cfg.rms_norm_eps)
        else:
            self.qmm_forward(a.qkv, a.ln1, p + "qkv_w", w.get("qkv_b"), reuse_quant=reuse_quant, store_tp=tp)
        k.rope_forward(a.qkv, a.qkv, rs.freqs, Hq, Hkv)  # in place

    # ---- one block ---------------------------------------------------------------------------
    def forward(self, i: int, residual) -> None:
        """Block i's forward from its input `residual` (B, T, C) and its ln1 (already computed)."""
        a = self.rs.acts[i]
        with self._mlp_up(a) as mlp_up:
            self.forward_block(i, a, residual, mlp_up)

    def backward(self, i: int, residual) -> None:
        """Block i's recompute and backward, from d_res_ffn to d_res_att and d_ln1."""
        a, g = self.rs.acts[i], self.rs.dacts[i]
        with self._mlp_up(a) as mlp_up:
            self.recompute_block(i, a, residual, mlp_up)
            self.backward_block(i, a, g, mlp_up)

    def forward_block(self, i: int, a: LayerActivations, residual, mlp_up) -> None:
        """Block i on the activations record `a`; its output is res_att + mlp_down, with mlp_down
        left in rs.lnf for the next fused residual RMSNorm."""
        k, rs, cfg, o = self.k, self.rs, self.cfg, self.opts
        w, p = self.weights.block(i), f"layers.{i}."
        Hq, Hkv, eps = cfg.num_q_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        att_o = mlp_down = rs.lnf  # (B, T, C): never needed in backward
        self._qkv(i, a)
        k.attention_forward(a.att.value, a.lse, a.qkv, Hq, Hkv, backend=o.attention_backend,
                            workspace=rs.att_workspace)  # fmt: skip
        if a.att.quant is not None:  # the attention kernels record no abs-max
            k.abs_max(a.att.abs_max, a.att.value)
        self.qmm_forward(att_o, a.att, p + "atto_w")
        k.fused_residual_rmsnorm_forward(a.res_att, a.ln2.value, a.ln2_rstd, residual, att_o, w["ln2_w"], eps,
                                         abs_max=a.ln2.abs_max)  # fmt: skip
        self.qmm_forward(mlp_up, a.ln2, p + "up_w", store_tp=self._ln2_stored_tp(i))  # (B, T, 2H)
        scale = rs.delayed_scale(i, "swiglu_q")
        if scale is None:
            k.swiglu_forward(a.swiglu.value, mlp_up, abs_max=a.swiglu.abs_max)  # (B, T, H)
            self.qmm_forward(mlp_down, a.swiglu, p + "down_w", store_tp=self.stored_tp["swiglu"])
        else:
            self._down_forward_delayed(mlp_down, a.swiglu, mlp_up, p + "down_w", scale)

    def _down_forward_delayed(self, out, swiglu: QuantTensor, mlp_up, wname: str, scale) -> None:
        """out = SwiGLU(mlp_up) · Wᵀ with the SwiGLU output written straight to E4M3 with its delayed `scale`
        (fp8_amax_history): no bf16 output and no quantise pass. Where its copy is stored transposed (no
        SwiGLU recompute) the plain copy is a stack temporary, transposed after the GEMM."""
        k, q = self.k, swiglu.quant
        if not self.stored_tp["swiglu"]:
            k.activation_forward_quant(q, mlp_up, "swiglu", "split", scale=scale)
            k.matmul(out, q, self.weights.fp8[wname])
            return
        H = q.shape[-1]
        N = q.nelem // H
        with self.rs.stack.temporary(q.dtype, (N, H), "x_q") as raw:
            plain = raw.with_stats(q.stats)
            k.activation_forward_quant(plain, mlp_up.reshape(N, 2 * H), "swiglu", "split", scale=scale)
            k.matmul(out, plain, self.weights.fp8[wname])
            k.transpose(q.reshape(H, N), plain)

    def recompute_block(self, i: int, a: LayerActivations, residual, mlp_up) -> None:
        """Recompute what the recompute flags dropped, exactly as forward computed it (same
        kernels, same stored abs-maxes), so results stay bitwise equal to the baseline."""
        k, rs, cfg, o = self.k, self.rs, self.cfg, self.opts
        w, p = self.weights.block(i), f"layers.{i}."
        Hq, Hkv, eps = cfg.num_q_heads, cfg.num_kv_heads, cfg.rms_norm_eps
        if o.rc_ln1:
            k.rmsnorm_forward(a.ln1.value, a.ln1_rstd, residual, w["ln1_w"], eps)
        if o.rc_qkv:
            self._qkv(i, a, reuse_quant=not o.rc_ln1)
        if o.rc_att:
            k.attention_forward(a.att.value, a.lse, a.qkv, Hq, Hkv, backend=o.attention_backend,
                                workspace=rs.att_workspace)  # fmt: skip
            if o.recompute_block:
                self.qmm_forward(rs.lnf, a.att, p + "atto_w")
        if o.rc_ln2:
            if o.recompute_block:
                k.fused_residual_rmsnorm_forward(a.res_att, a.ln2.value, a.ln2_rstd, residual, rs.lnf, w["ln2_w"], eps)
            else:
                k.rmsnorm_forward(a.ln2.value, a.ln2_rstd, a.res_att, w["ln2_w"], eps)
        if o.rc_mlp_up_at(i):  # ln2 recomputed above (rc_ln2), else as forward left it: its own or its FP8 copy
            self.qmm_forward(mlp_up, a.ln2, p + "up_w", reuse_quant=not o.rc_ln2)
        # a dropped SwiGLU output (rc_swiglu) is rewritten by backward_block's SwiGLU backward as it reads mlp_up,
        # in FP8 as the transposed E4M3 copy the down projection's weight gradient reads (one pass fewer, and
        # no transpose)

    def backward_block(self, i: int, a: LayerActivations, g: LayerGradients, mlp_up) -> None:
        """From g.d_res_ffn: g.d_res_att (the residual's gradient so far) and g.d_ln1, and this
        block's parameter gradients (+=). mlp_up is overwritten by its gradient (not with a delayed scale
        for it: `_mlp_backward`)."""
        k, rs, cfg, o = self.k, self.rs, self.cfg, self.opts
        w, p, G = self.weights.block(i), f"layers.{i}.", self.grads[i]
        B, T, Q = rs.B, rs.T, cfg.qkv_channels
        Hq, Hkv = cfg.num_q_heads, cfg.num_kv_heads
        stack = rs.stack
        self._mlp_backward(i, a, g, mlp_up)
        # ln2: d_res_att = d_res_ffn + ∂ln2 (in place when they share a buffer)
        k.rmsnorm_backward(g.d_res_att.value, G["ln2_w"], rs.rms_scratch, g.d_res_ffn.value, g.d_ln2, a.res_att,
                           w["ln2_w"], a.ln2_rstd, abs_max=g.d_res_att.abs_max)  # fmt: skip
        # attention output projection
        self.qmm_backward(g.d_att_y, G["atto_w"], None, g.d_res_att, a.att, p + "atto_w", reuse_inp=False)
        with stack.temporary(rs.dtype, (B, T, Q), "d_qkv") as d_qkv_raw:
            d_qkv = QuantTensor(d_qkv_raw, g.d_qkv_q)
            n = o.attn_bwd_chunks
            for c in range(n):
                k.attention_backward(d_qkv_raw.shard_view(c, n), g.d_att_y.shard_view(c, n),
                                     a.att.value.shard_view(c, n), a.lse.shard_view(c, n), a.qkv.shard_view(c, n),
                                     Hq, Hkv, backend=o.attention_backend, workspace=rs.att_workspace,
                                     deterministic=o.attention_deterministic)  # fmt: skip
            # with QK-norm, d_qkv's FP8 abs-max is that of the gradient the matmul reads: after QK-norm's backward
            if cfg.qk_norm:
                k.rope_backward(d_qkv_raw, d_qkv_raw, rs.freqs, Hq, Hkv)
                k.qknorm_backward(d_qkv_raw, G["q_norm_w"], G["k_norm_w"], rs.qk_scratch, d_qkv_raw, a.qkv_pre,
                                  w["q_norm_w"], w["k_norm_w"], a.qk_rstd, Hq, Hkv)  # fmt: skip
                if d_qkv.abs_max is not None:
                    k.abs_max(d_qkv.abs_max, d_qkv_raw)
            else:
                k.rope_backward(d_qkv_raw, d_qkv_raw, rs.freqs, Hq, Hkv, abs_max=d_qkv.abs_max)
            self.qmm_backward(g.d_ln1, G["qkv_w"], G.get("qkv_b"), d_qkv, a.ln1, p + "qkv_w",
                              reuse_inp=not (o.recompute_rmsnorm or o.recompute_att),
                              stored_tp=self.stored_tp["ln1"])  # fmt: skip

    def _mlp_backward(self, i: int, a: LayerActivations, g: LayerGradients, mlp_up) -> None:
        """The down and up projections' backward, from g.d_res_ffn to g.d_ln2 (parameter gradients +=), with
        the SwiGLU backward between the down projection's two GEMMs: the SwiGLU output it recomputes (a
        dropped one) is what the dweight GEMM reads. Its gradient overwrites mlp_up, which the up projection's
        backward quantises (FP8); with a delayed scale for it (fp8_amax_history) the SwiGLU backward writes
        the two FP8 copies itself instead, into stack temporaries."""
        k, rs, o = self.k, self.rs, self.opts
        p, G, H, N = f"layers.{i}.", self.grads[i], self.cfg.intermediate_size, rs.B * rs.T
        d_mlp_up = QuantTensor(mlp_up, g.d_mlp_up_q)
        out = out_tp = None  # where the SwiGLU backward rewrites a dropped output
        if o.rc_swiglu and a.swiglu.quant is None:
            out = a.swiglu.value
        elif o.rc_swiglu:
            out_tp = a.swiglu.quant.reshape(H, N)
        dscale = rs.delayed_scale(i, "d_mlp_up_q")
        with contextlib.ExitStack() as temps:
            if dscale is None:
                dinp, dq_tp, grad = mlp_up, None, {"abs_max": d_mlp_up.abs_max, "out": out}
            else:
                d_mlp_up = temps.enter_context(self._quant_on_stack(d_mlp_up))
                dinp = d_mlp_up.quant
                raw = temps.enter_context(rs.stack.temporary(dinp.dtype, (2 * H, N), "grad_tp"))
                dq_tp = raw.with_stats(dinp.stats)
                grad = {"dinp_tp": dq_tp, "dinp_scale": dscale}
                if out_tp is not None:  # the forward's output had its delayed scale too
                    grad["out_scale"] = rs.delayed_scale(i, "swiglu_q")
            with rs.stack.temporary(rs.dtype, (rs.B, rs.T, H), "d_swiglu") as d_swiglu:
                swiglu_backward = functools.partial(k.swiglu_backward, dinp, d_swiglu, mlp_up, out_fp8_tp=out_tp,
                                                    **grad)  # fmt: skip
                self.qmm_backward(d_swiglu, G["down_w"], None, g.d_res_ffn, a.swiglu, p + "down_w", reuse_inp=True,
                                  stored_tp=self.stored_tp["swiglu"] or out_tp is not None,
                                  after_dinp=swiglu_backward)  # fmt: skip
            if dscale is None:
                d_mlp_up = temps.enter_context(self._quant_on_stack(d_mlp_up))
            self.qmm_backward(g.d_ln2, G["up_w"], None, d_mlp_up, a.ln2, p + "up_w",
                              reuse_inp=not o.recompute_rmsnorm, stored_tp=self._ln2_stored_tp(i),
                              dout_tp=dq_tp)  # fmt: skip

    # ---- LM head -----------------------------------------------------------------------------
    def lm_head(self, d_loss, d_head=None, logits_out: np.ndarray | None = None) -> None:
        """Logits and loss of rs.lnf against rs.targets, in lmhead_chunks chunks of rows through
        one stack buffer of (B*T/chunks, V) logits. With `d_head` (the LM-head weight gradient,
        accumulated) also dlogits → d_head and rs.d_lnf, each token's loss weighing `d_loss` (a
        float, or rs.d_loss: read on the device, so graph replays see the value of their batch).
        With `logits_out` ((B*T, V) float32), copy the logits there instead (a host sync per chunk:
        for generation and tests).

        With TrainOptions.lmhead_fp8 the three GEMMs are FP8, as a block's (`qmm_backward`): each
        chunk's lnf rows are quantized to E4M3 with their own abs-max (over the real rows of a
        padded batch), the head weight's E4M3 copy and its transpose come from `weights.requantize`,
        and dlogits goes to grad_dtype (E5M2) with the abs-max the classifier recorded as it wrote
        them (exact: a max does not depend on order, so no second pass over the (n, V) logits)."""
        k, rs, cfg = self.k, self.rs, self.cfg
        N, C, V = rs.B * rs.T, cfg.hidden_size, cfg.vocab_size
        chunks = self.opts.lmhead_chunks
        n = N // chunks
        head = self.weights.lm_head
        lnf, d_lnf = rs.lnf.reshape(N, C), rs.d_lnf.reshape(N, C)
        targets = rs.targets.reshape(N)
        backward = d_head is not None
        with rs.stack.temporary(rs.dtype, (n, V), "lmhead_logits") as out, self._head_quant(n, backward) as hq:
            for c in range(chunks):
                rows = slice(c * n, (c + 1) * n)
                x = lnf[rows]
                if hq is None:
                    k.matmul(out, x, head)  # (n, V)
                else:
                    k.fill_zero(hq.stats)  # both abs-max slots (x_q, dlogits_q) in one memset
                    self._quantize_head_input(hq.x, x, c * n)
                    k.matmul(out, hq.x, self.weights.fp8[self.weights.head_name])  # (n, C) · (V, C)ᵀ
                if logits_out is not None:
                    logits_out[rows] = out.numpy().astype(np.float32)
                    continue
                dl_amax = hq.dlogits.abs_max if hq is not None and backward else None  # max|dlogits|, as written
                k.fused_classifier(out, rs.losses[rows], rs.head_lse[rows], targets[rows], d_loss, self.opts.z_loss,
                                   write_dlogits=backward, abs_max=dl_amax)  # fmt: skip
                if not backward:
                    continue
                if hq is None:
                    k.matmul(d_head, out, x, trans_a=True, trans_b=False, accumulate=True)  # (V, C)
                    k.matmul(d_lnf[rows], out, head, trans_b=False)  # (n, C)
                    continue
                dlogits = QuantTensor(out, hq.dlogits)
                self.qmm_backward(d_lnf[rows], d_head, None, dlogits, QuantTensor(x, hq.x), self.weights.head_name,
                                  reuse_inp=True)  # fmt: skip

    @contextlib.contextmanager
    def _head_quant(self, n: int, backward: bool):
        """None without lmhead_fp8; else a `_HeadQuant` of stack temporaries: x_q (n, C) E4M3 and
        dlogits_q (n, V) in grad_dtype (None without backward), each with a stats slot of its own in
        `stats` (2, STATS_SLOTS), one table so that one memset zeroes both abs-maxes."""
        if not self.opts.lmhead_fp8:
            yield None
            return
        stack, C, V = self.rs.stack, self.cfg.hidden_size, self.cfg.vocab_size
        if n % 16:  # allocate_run_state's recording pass gets here first
            raise ValueError(f"lmhead_fp8: the LM head's weight-gradient GEMM reduces over B*T/lmhead_chunks = {n} "
                             "rows, and FP8 GEMMs need a multiple of 16")  # fmt: skip
        with stack.temporary(FP32, (2, STATS_SLOTS), "lmhead_fp8_stats") as stats:
            with stack.temporary(self.opts.matmul_dtype, (n, C), "lmhead_x_q") as xq:
                if not backward:
                    yield _HeadQuant(stats, xq.with_stats(stats[0]), None)
                    return
                with stack.temporary(self.opts.grad_dtype, (n, V), "lmhead_dlogits_q") as dq:
                    yield _HeadQuant(stats, xq.with_stats(stats[0]), dq.with_stats(stats[1]))

    def _quantize_head_input(self, xq, x, first: int) -> None:
        """xq = E4M3(x) for rows [first, first + len(x)) of lnf, scaled by their abs-max (only the
        real rows of a padded batch count, as in `qmm_forward`); xq.abs_max must be zero."""
        k = self.k
        if self.real_rows is None:
            k.abs_max(xq.abs_max, x)
        else:
            last = first + x.shape[0]
            for start, stop in self.real_rows:
                a, b = max(start, first), min(stop, last)
                if a < b:
                    k.abs_max(xq.abs_max, x.rows(a - first, b - first))
        k.quantize_with_abs_max(xq, x)
