"""The run state: every activation, activation gradient and scratch buffer of a train step.

It follows the seed's RunStateBuilder (LLMQ `llama_run_state.cpp`):
- `allocate_or_reuse`: an activation that backward recomputes (per the recompute flags) or only
  needs quantized (FP8) shares one buffer across layers; otherwise each layer has its own.
- att_o and mlp_down are never needed in backward, so they share the `lnf` buffer (the fused
  residual RMSNorm reads them before it writes its output).
- Activation gradients live in one set of buffers that every layer reuses ("alias layer 0").
- FP8: one quantized copy per activation, with per-layer abs-max/scale slots (`abs_max` table),
  so a shared quant buffer still keeps each layer's scales.
- Per-layer buffers are typed records (`records.LayerActivations`, `records.LayerGradients`).
- Step temporaries (recomputed mlp_up, d_swiglu, d_qkv, FP8 transposes, LM-head logits) come
  from a DeviceMemoryStack sized by running the step's own code against a simulated stack
  (`size_stack`).
- Optional residual offload to pinned host memory, double-buffered on a side stream.
"""

from __future__ import annotations

import numpy as np

from ..alloc import DeviceMemoryStack
from ..dtypes import BF16, BYTE, FP8_E4M3, FP16, FP32, INT32
from ..dtypes import dtype as _dtype
from ..kernels import attention, encoder, fp8, qknorm, rmsnorm, rope
from ..tensor import STATS_SLOTS, Tensor
from .records import LayerActivations, LayerGradients, QuantTensor

# Per-layer FP8 stats slots in the `abs_max` table (cuengine.tensor's STATS_SLOTS layout).
STAT_SLOTS = ("ln1_q", "att_q", "ln2_q", "swiglu_q", "d_res_ffn_q", "d_res_att_q", "d_mlp_up_q", "d_qkv_q")
# The tensors TrainOptions.fp8_amax_history scales from a history (the rows of `fp8_history`, per layer): the
# largest two of a layer, whose producers then quantise them in the pass that computes them.
DELAYED_SLOTS = ("swiglu_q", "d_mlp_up_q")


class ResidualStore:
    """The per-layer residual stream `res_ffn[l]` (the input of layer l + 1).

    Without offload: one device buffer per layer. With offload: one pinned host buffer per layer
    and two device buffers used alternately (layer l in buffer l % 2); copies run on a side
    stream, ordered against the main stream with events (the seed's fetch/put/get/release).
    """

    def __init__(self, alloc, dtype, shape, num_layers: int, offload: bool, stream):
        self.device = alloc.device
        self.offload = offload
        self.main = stream
        if not offload:
            self.dev = [alloc.allocate(dtype, f"res_ffn.{i}", shape) for i in range(num_layers)]
            return
        self.dev = [alloc.allocate(dtype, f"res_ffn.{i}", shape) for i in range(2)]
        self.host = [alloc.allocate(dtype, f"res_ffn_offload.{i}", shape, kind="pinned") for i in range(num_layers)]
        self.side = self.device.new_stream()
        self.events = [self.device.event() for _ in range(2)]
        self.ready_event = self.device.event()
        self.ready = [False, False]

    def fetch(self, layer: int) -> None:
        """Start copying res_ffn[layer] from host into its device buffer on the side stream."""
        if not self.offload or layer < 0:
            return
        i = layer % 2
        self.side.wait(self.events[i])  # the buffer's last user is done
        self.ready[i] = False
        self.device.copy_async(self.dev[i], self.host[layer], self.side)
        self.side.record(self.events[i])

    def mark_ready(self, layer: int) -> None:
        """res_ffn[layer] has just been written on the main stream."""
        if self.offload:
            self.main.record(self.ready_event)

    def put(self, layer: int) -> None:
        """Copy res_ffn[layer] to host on the side stream, once the main stream has written it."""
        if not self.offload:
            return
        i = layer % 2
        self.side.wait(self.ready_event)
        self.ready[i] = False
        self.device.copy_async(self.host[layer], self.dev[i], self.side)
        self.side.record(self.events[i])

    def get(self, layer: int):
        """The device buffer of res_ffn[layer]; the main stream waits for its pending copy."""
        if not self.offload:
            return self.dev[layer]
        i = layer % 2
        if not self.ready[i]:
            self.main.wait(self.events[i])
            self.ready[i] = True
        return self.dev[i]

    def release(self, layer: int) -> None:
        """The main stream is done reading res_ffn[layer]; its buffer may be refilled."""
        if self.offload:
            self.main.record(self.events[layer % 2])


class RunState:
    """Buffers for training a model of config `cfg` with options `opts` on batches (B, T).

    Everything is allocated here from `alloc` (contexts "Inputs", "FP8 stats", "Activations",
    "Activation gradients", "Scratch"); the step temporaries live on `self.stack` ("Stack"),
    allocated by `size_stack`.
    """

    def __init__(self, cfg, opts, B: int, T: int, alloc):
        self.cfg, self.opts, self.B, self.T = cfg, opts, B, T
        self.alloc = alloc
        self.device = dev = alloc.device
        self.dtype = dt = _dtype(opts.model_dtype)
        C, Q, L = cfg.hidden_size, cfg.qkv_channels, cfg.num_layers
        N = B * T

        with alloc.context("Inputs"):
            self.inputs = alloc.allocate(INT32, "inputs", (B, T))
            self.inputs_host = alloc.staging(self.inputs, "inputs_host")  # pinned on cuda; inputs itself on cpu
            # The targets and the loss gradient per valid target travel in one upload: B*T ids, then
            # d_loss's fp32 bits, which the classifier reads on the device (graph replays see new values).
            self.targets_upload = alloc.allocate(INT32, "targets", (N + 1,))
            self.targets_upload_host = alloc.staging(self.targets_upload, "targets_host")
            self.targets = self.targets_upload.rows(0, N).reshape(B, T)  # (B, T)
            self.d_loss = self.targets_upload[N:].view(FP32)  # (1,)
            self.targets_host = self.targets_upload_host.rows(0, N).reshape(B, T)  # (B, T)
            self.d_loss_host = self.targets_upload_host[N:].view(FP32)  # (1,)
        self.inputs_event = dev.event()  # the last copy out of inputs_host
        self.targets_event = dev.event()

        self.abs_maxes = self.fp8_history = None
        # True once a training micro-step has rolled the history (fp8_amax_history): the producers of
        # DELAYED_SLOTS then quantise with its scales; until then (the first micro-step) they scale as the rest
        self.fp8_history_filled = False
        if opts.fp8:
            with alloc.context("FP8 stats"):
                # one Tensor stats slot (STATS_SLOTS floats, 16-byte lanes) per quantised tensor
                self.abs_maxes = alloc.allocate(FP32, "abs_max", (L, len(STAT_SLOTS), STATS_SLOTS))
                if opts.fp8_amax_history:
                    self._allocate_fp8_history(L, opts.fp8_amax_history, _dtype(opts.grad_dtype).fp8_max)
        with alloc.context("Activations"):
            self.encoded = alloc.allocate(dt, "encoded", (B, T, C))
            # cos/sin are bounded by 1: fp16 keeps more mantissa than bf16 for the same bytes.
            freq_dt = FP16 if dt == BF16 else FP32
            self.freqs_full = alloc.allocate(freq_dt, "freqs", (cfg.max_position_embeddings, cfg.head_size))
            table = rope.rope_freqs(cfg.max_position_embeddings, cfg.head_size, cfg.rope_theta, freq_dt.np,
                                    cfg.rope_scaling)  # fmt: skip
            self.freqs_full.copy_from_numpy(table)
            self.freqs = self.freqs_full.rows(0, T)  # (T, hs): [cos | sin]
            self.lnf = alloc.allocate(dt, "lnf", (B, T, C))
            self.lnf_rstd = alloc.allocate(FP32, "lnf_rstd", (B, T))
            self.losses = alloc.allocate(FP32, "losses", (N,))
            self.losses_host = alloc.staging(self.losses, "losses_host")
            self.head_lse = alloc.allocate(FP32, "head_lse", (N,))
            self.residuals = ResidualStore(alloc, dt, (B, T, C), L, opts.offload_residual, dev.stream)
            self.acts = self._forward_buffers()
        with alloc.context("Activation gradients"):
            self.d_lnf = alloc.allocate(dt, "d_lnf", (B, T, C))
            self.d_emb = alloc.allocate(dt, "d_emb", (B, T, C))
            self.dacts = self._backward_buffers()
        with alloc.context("Scratch"):
            self.rms_scratch = alloc.allocate(FP32, "rms_scratch", rmsnorm.rmsnorm_scratch_shape(N, C))
            self.bias_scratch = alloc.allocate(FP32, "bias_scratch", fp8.bias_backward_scratch_shape(N, Q))
            self.enc_scratch = alloc.allocate(INT32, "enc_scratch", encoder.encoder_scratch_shape(B, T, C))
            # the encoder backward's plan reads only the tokens: it runs on its own stream beside the LM head
            self.enc_stream = dev.new_stream()
            self.enc_fork, self.enc_join = dev.event(), dev.event()
            self.qk_scratch = None
            if cfg.qk_norm:
                shape = qknorm.qknorm_scratch_shape(N, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size)
                self.qk_scratch = alloc.allocate(FP32, "qknorm_scratch", shape)
            # forward runs on the whole batch, backward on attn_bwd_chunks shards: the larger need of the two
            heads = (T, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size)
            kw = {
                "backend": opts.attention_backend,
                "dtype": dt,
                "device": dev,
                "deterministic": opts.attention_deterministic,
            }
            fwd = attention.workspace_shape(B, *heads, passes=("forward",), **kw)[0]
            bwd = attention.workspace_shape(B // opts.attn_bwd_chunks, *heads, passes=("backward",), **kw)[0]
            ws = max(fwd, bwd)
            self.att_workspace = alloc.allocate(BYTE, "attention_workspace", (ws,))
        self.stack = None

    def _allocate_fp8_history(self, L: int, n: int, grad_max: float) -> None:
        """fp8_history (L * len(DELAYED_SLOTS), n + 1): fp8.amax_history_roll's table, zero (empty), with the
        flat index of each row's stats slot in `abs_maxes` and its FP8 format's largest value."""
        alloc, k = self.alloc, len(DELAYED_SLOTS)
        self.fp8_history = alloc.allocate(FP32, "fp8_amax_history", (L * k, n + 1)).fill_zero()
        slots = [
            (i * len(STAT_SLOTS) + STAT_SLOTS.index(name)) * STATS_SLOTS for i in range(L) for name in DELAYED_SLOTS
        ]
        fp8_max = [FP8_E4M3.fp8_max if name == "swiglu_q" else grad_max for _ in range(L) for name in DELAYED_SLOTS]
        self.fp8_history_slots = alloc.allocate(INT32, "fp8_history_slots", (L * k,))
        self.fp8_history_slots.copy_from_numpy(np.array(slots, np.int32))
        self.fp8_history_max = alloc.allocate(FP32, "fp8_history_max", (L * k,))
        self.fp8_history_max.copy_from_numpy(np.array(fp8_max, np.float32))

    def delayed_scale(self, layer: int, name: str) -> Tensor | None:
        """The (1,) scale layer `layer`'s `name` (one of DELAYED_SLOTS) is quantised with, or None where it is
        scaled from its own abs-max (no fp8_amax_history, or the history not filled yet)."""
        if not self.fp8_history_filled:
            return None
        return self.fp8_history[layer * len(DELAYED_SLOTS) + DELAYED_SLOTS.index(name)].rows(0, 1)

    def roll_fp8_history(self) -> None:
        """The end of a training micro-step: the delayed tensors' abs-maxes into the history, their next scales."""
        if self.fp8_history is not None:
            fp8.amax_history_roll(self.fp8_history, self.abs_maxes, self.fp8_history_slots, self.fp8_history_max)

    def _stats(self, t: Tensor | None, layer: int, name: str) -> Tensor | None:
        """The quant buffer `t` with layer `layer`'s stats slot for `name` (one of STAT_SLOTS)."""
        return None if t is None else t.with_stats(self.abs_maxes[layer][STAT_SLOTS.index(name)])

    # ---- the seed's allocate_or_reuse ---------------------------------------------------------
    def _forward_buffers(self) -> list[LayerActivations]:
        cfg, o, B, T, dt, alloc = self.cfg, self.opts, self.B, self.T, self.dtype, self.alloc
        C, H, Q, A = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_channels, cfg.att_channels
        mm = _dtype(o.matmul_dtype)
        keep = o.keep_all_activations
        shared: dict[str, Tensor] = {"ln2": self.lnf}

        def buffer(share, key, dtype, name, shape):
            if not share:
                return alloc.allocate(dtype, name, shape, stats=False)
            if key not in shared:
                shared[key] = alloc.allocate(dtype, name, shape, stats=False)
            return shared[key]

        def act(share, key, i, shape, quant_share=None):
            """Layer i's buffer for activation `key`, one for all layers when `share`. A matmul operand
            (`quant_share` given) is a QuantTensor: with FP8 matmuls its e4m3 copy, one for all layers
            when `quant_share`, is what backward reads."""
            value = buffer(share and not keep, key, dt, f"{key}.{i}", shape)
            if quant_share is None:
                return value
            q = buffer(quant_share, key + "_q", mm, f"{key}_q.{i}", shape) if o.fp8 else None
            return QuantTensor(value, self._stats(q, i, key + "_q"))

        layers = []
        for i in range(cfg.num_layers):
            a = LayerActivations(
                ln1_rstd=alloc.allocate(FP32, f"ln1_rstd.{i}", (B, T)),
                ln2_rstd=alloc.allocate(FP32, f"ln2_rstd.{i}", (B, T)),
                ln1=act(o.rc_ln1 or o.fp8, "ln1", i, (B, T, C), quant_share=o.recompute_rmsnorm),
                ln2=act(o.rc_ln2 or o.fp8, "ln2", i, (B, T, C), quant_share=o.recompute_rmsnorm),
                qkv=act(o.rc_qkv, "qkv", i, (B, T, Q)),
                lse=alloc.allocate(FP32, f"lse.{i}", (B, cfg.num_q_heads, T)),
                att=act(o.rc_att, "att", i, (B, T, A), quant_share=True),  # backward re-quantizes att
                res_att=act(o.recompute_block, "res_att", i, (B, T, C)),
                swiglu=act(o.rc_swiglu or o.fp8, "swiglu", i, (B, T, H), quant_share=o.rc_swiglu),
                # recomputed: a stack temporary in forward and backward (Blocks._mlp_up)
                mlp_up=None if o.rc_mlp_up_at(i) else alloc.allocate(dt, f"mlp_up.{i}", (B, T, 2 * H)),
            )
            if cfg.qk_norm:  # QK-norm's input and rstd: recomputed with qkv, so shared as qkv is
                a.qkv_pre = act(o.rc_qkv, "qkv_pre", i, (B, T, Q))
                a.qk_rstd = buffer(o.rc_qkv and not keep, "qk_rstd", FP32, f"qk_rstd.{i}",
                                   (B, T, cfg.num_q_heads + cfg.num_kv_heads))  # fmt: skip
            layers.append(a)
        return layers

    def _backward_buffers(self) -> list[LayerGradients]:
        cfg, o, B, T, dt, alloc = self.cfg, self.opts, self.B, self.T, self.dtype, self.alloc
        C, H, Q, A = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_channels, cfg.att_channels
        gd = _dtype(o.grad_dtype)
        keep = o.keep_all_activations
        layers = []
        for i in range(cfg.num_layers):
            if i == 0 or keep:  # else every layer reuses layer 0's buffers, with its own stats slots
                d_res_ffn = alloc.allocate(dt, f"d_res_ffn.{i}", (B, T, C))
                d_res_att = alloc.allocate(dt, f"d_res_att.{i}", (B, T, C)) if keep else d_res_ffn
                d_ln2 = alloc.allocate(dt, f"d_ln2.{i}", (B, T, C)) if keep else self.d_lnf
                # d_lnf's buffer where it has the shape; with A != C (Qwen3) a buffer of its own
                d_att_y = alloc.allocate(dt, f"d_att_y.{i}", (B, T, A)) if keep or A != C else self.d_lnf
                d_ln1 = alloc.allocate(dt, f"d_ln1.{i}", (B, T, C)) if keep else self.d_lnf
                d_res_ffn_q = d_res_att_q = d_qkv_q = d_mlp_up_q = None
                if o.fp8:
                    d_res_ffn_q = alloc.allocate(gd, f"d_res_ffn_q.{i}", (B, T, C), stats=False)
                    d_res_att_q = (
                        alloc.allocate(gd, f"d_res_att_q.{i}", (B, T, C), stats=False) if keep else d_res_ffn_q
                    )
                    d_qkv_q = alloc.allocate(gd, f"d_qkv_q.{i}", (B, T, Q), stats=False)
                    d_mlp_up_q = Tensor(gd, (B, T, 2 * H), self.device, None, 0, "d_mlp_up_q")  # no memory
            layers.append(LayerGradients(
                d_res_ffn=QuantTensor(d_res_ffn, self._stats(d_res_ffn_q, i, "d_res_ffn_q")),
                d_res_att=QuantTensor(d_res_att, self._stats(d_res_att_q, i, "d_res_att_q")),
                d_ln2=d_ln2,
                d_att_y=d_att_y,
                d_ln1=d_ln1,
                d_qkv_q=self._stats(d_qkv_q, i, "d_qkv_q"),
                d_mlp_up_q=self._stats(d_mlp_up_q, i, "d_mlp_up_q"),
            ))  # fmt: skip
        return layers

    # ---- step temporaries ---------------------------------------------------------------------
    def size_stack(self, step) -> None:
        """Allocate the stack (context "Stack") exactly as large as `step()` needs: it runs the
        step's own code against a simulated stack, with launches that do nothing."""
        sim = self.stack = DeviceMemoryStack.simulate(self.device)
        try:
            step()
        finally:
            self.stack = None
        with self.alloc.context("Stack"):
            self.stack = DeviceMemoryStack.sized_from(sim, self.alloc, name="stack")
