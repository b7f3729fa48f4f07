"""The run state: every activation, activation gradient and scratch buffer of a train step.

It follows the seed's RunStateBuilder (LLMQ `llama_run_state.cpp`):
- `allocate_or_reuse`: an activation that backward recomputes (per the recompute flags) or only
  needs quantized (FP8) shares one buffer across layers; otherwise each layer has its own.
- att_o and mlp_down are never needed in backward, so they share the `lnf` buffer (the fused
  residual RMSNorm reads them before it writes its output).
- Activation gradients live in one set of buffers that every layer reuses ("alias layer 0").
- FP8: one quantized copy per activation, with per-layer abs-max/scale slots (`abs_max` table),
  so a shared quant buffer still keeps each layer's scales.
- Step temporaries (recomputed mlp_up, d_swiglu, d_qkv, FP8 transposes, LM-head logits) come
  from a DeviceMemoryStack sized by simulating a step (`simulate_stack`).
- Optional residual offload to pinned host memory, double-buffered on a side stream.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..alloc import DeviceMemoryStack
from ..dtypes import BF16, BYTE, FP16, FP32, INT32
from ..dtypes import dtype as _dtype
from ..kernels import attention, encoder, fp8, norm, rmsnorm, rope
from ..tensor import STAT_ABS_MAX, STATS_SLOTS

# Per-layer FP8 stats slots in the `abs_max` table (cuengine.tensor's STATS_SLOTS layout).
STAT_SLOTS = ("ln1_q", "att_q", "ln2_q", "swiglu_q", "d_res_ffn_q", "d_res_att_q", "d_mlp_up_q", "d_qkv_q")


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

    Everything is allocated here from `alloc` (contexts "Activations", "Activation gradients",
    "Scratch", "Inputs"); the step temporaries live on `self.stack`, sized by `simulate_stack`.
    """

    def __init__(self, cfg, opts, B: int, T: int, alloc):
        self.cfg, self.opts, self.B, self.T = cfg, opts, B, T
        self.alloc = alloc
        self.device = dev = alloc.device
        self.dtype = dt = _dtype(opts.model_dtype)
        self.fp8 = opts.fp8
        self.mm_dtype = _dtype(opts.matmul_dtype)
        self.grad_dtype = _dtype(opts.grad_dtype)
        C, Q, L = cfg.hidden_size, cfg.qkv_channels, cfg.num_layers
        N = B * T

        with alloc.context("Inputs"):
            self.inputs = alloc.allocate(INT32, "inputs", (B, T))
            self.targets = alloc.allocate(INT32, "targets", (B, T))
            self.inputs_host = alloc.allocate(INT32, "inputs_host", (B, T), kind="pinned")
            self.targets_host = alloc.allocate(INT32, "targets_host", (B, T), kind="pinned")
            self.losses_host = alloc.allocate(FP32, "losses_host", (N,), kind="pinned")
            self.hparams_host = alloc.allocate(FP32, "hparams_host", (8,), kind="pinned")
        self.inputs_event = dev.event()  # the last copy out of inputs_host
        self.targets_event = dev.event()
        self.hparams_event = dev.event()

        with alloc.context("Activations"):
            self.encoded = alloc.allocate(dt, "encoded", (B, T, C))
            # cos/sin are bounded by 1: fp16 keeps more mantissa than bf16 for the same bytes.
            freq_dt = FP16 if dt == BF16 else FP32
            self.freqs_full = alloc.allocate(freq_dt, "freqs", (cfg.max_position_embeddings, cfg.head_size))
            table = rope.rope_freqs(cfg.max_position_embeddings, cfg.head_size, cfg.rope_theta, dtype=freq_dt.np)
            self.freqs_full.copy_from_numpy(table)
            self.freqs = self.freqs_full.rows(0, T)  # (T, hs): [cos | sin]
            self.lnf = alloc.allocate(dt, "lnf", (B, T, C))
            self.lnf_rstd = alloc.allocate(FP32, "lnf_rstd", (B, T))
            self.losses = alloc.allocate(FP32, "losses", (N,))
            self.head_lse = alloc.allocate(FP32, "head_lse", (N,))
            self.residuals = ResidualStore(alloc, dt, (B, T, C), L, opts.offload_residual, dev.stream)
            self.acts = self._forward_buffers()
        with alloc.context("Activation gradients"):
            self.d_lnf = alloc.allocate(dt, "d_lnf", (B, T, C))
            self.d_emb = alloc.allocate(dt, "d_emb", (B, T, C))
            self.dacts = self._backward_buffers()
        if self.fp8:
            with alloc.context("FP8 stats"):
                # one Tensor stats slot (STATS_SLOTS floats, 16-byte lanes) per quantised tensor
                self.abs_maxes = alloc.allocate(FP32, "abs_max", (L, len(STAT_SLOTS), STATS_SLOTS))
            self._attach_stats()
        with alloc.context("Scratch"):
            self.rms_scratch = alloc.allocate(FP32, "rms_scratch", rmsnorm.rmsnorm_scratch_shape(N, C))
            self.bias_scratch = alloc.allocate(FP32, "bias_scratch", fp8.bias_backward_scratch_shape(N, Q))
            self.enc_scratch = alloc.allocate(INT32, "enc_scratch", encoder.encoder_scratch_shape(B, T, C))
            self.norm_partials = alloc.allocate(FP32, "norm_partials", norm.norm_partials_shape())
            self.norm_result = alloc.allocate(FP32, "norm_result", (2,))  # [norm, clip scale]
            self.hparams = alloc.allocate(FP32, "hparams", (8,))
            # forward runs on the whole batch, backward on attn_bwd_chunks shards: size for both
            ws = max(attention.workspace_shape(b, T, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size,
                                               backend=opts.attention_backend, dtype=dt, device=dev)[0]
                     for b in (B, B // opts.attn_bwd_chunks))  # fmt: skip
            self.att_workspace = alloc.allocate(BYTE, "attention_workspace", (ws,))
        self.stack = None

    # ---- the seed's allocate_or_reuse ---------------------------------------------------------
    def _forward_buffers(self) -> list[SimpleNamespace]:
        cfg, o, B, T, dt, alloc = self.cfg, self.opts, self.B, self.T, self.dtype, self.alloc
        C, H, Q = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_channels
        shared: dict[str, object] = {"ln2": self.lnf}

        def reuse(flag, key, dtype, name, shape):
            if flag and not o.keep_all_activations:
                if key not in shared:
                    shared[key] = alloc.allocate(dtype, name, shape)
                return shared[key]
            return alloc.allocate(dtype, name, shape)

        quant = self.fp8
        layers = []
        for i in range(cfg.num_layers):
            a = SimpleNamespace()
            a.ln1_rstd = alloc.allocate(FP32, f"ln1_rstd.{i}", (B, T))
            a.ln2_rstd = alloc.allocate(FP32, f"ln2_rstd.{i}", (B, T))
            a.ln1 = reuse(o.rc_ln1 or quant, "ln1", dt, f"ln1.{i}", (B, T, C))
            a.ln2 = reuse(o.rc_ln2 or quant, "ln2", dt, f"ln2.{i}", (B, T, C))
            a.qkv = reuse(o.rc_qkv, "qkv", dt, f"qkv.{i}", (B, T, Q))
            a.lse = alloc.allocate(FP32, f"lse.{i}", (B, cfg.num_q_heads, T))
            a.att = reuse(o.rc_att, "att", dt, f"att.{i}", (B, T, C))
            a.res_att = reuse(o.recompute_block, "res_att", dt, f"res_att.{i}", (B, T, C))
            a.swiglu = reuse(o.rc_swiglu or quant, "swiglu", dt, f"swiglu.{i}", (B, T, H))
            # With recompute_ffn mlp_up is recomputed onto the stack in backward (acquire_mlp_up).
            a.mlp_up = None if o.rc_mlp_up else alloc.allocate(dt, f"mlp_up.{i}", (B, T, 2 * H))
            if quant:
                mq = self.mm_dtype
                first = layers[0] if layers else None

                def q(name, shape, keep_first, first=first, i=i, mq=mq):
                    if first is not None and keep_first:
                        return getattr(first, name)
                    return alloc.allocate(mq, f"{name}.{i}", shape, stats=False)

                a.ln1_q = q("ln1_q", (B, T, C), o.recompute_rmsnorm)
                a.ln2_q = q("ln2_q", (B, T, C), o.recompute_rmsnorm)
                a.att_q = q("att_q", (B, T, C), True)  # backward re-quantizes att from its value
                a.swiglu_q = q("swiglu_q", (B, T, H), o.rc_swiglu)
            layers.append(a)
        return layers

    def _backward_buffers(self) -> list[SimpleNamespace]:
        cfg, o, B, T, dt, alloc = self.cfg, self.opts, self.B, self.T, self.dtype, self.alloc
        C, Q = cfg.hidden_size, cfg.qkv_channels
        layers = []
        for i in range(cfg.num_layers):
            if layers and not o.keep_all_activations:
                layers.append(SimpleNamespace(**vars(layers[0])))
                continue
            g = SimpleNamespace()
            g.d_res_ffn = alloc.allocate(dt, f"d_res_ffn.{i}", (B, T, C))
            keep = o.keep_all_activations
            g.d_res_att = alloc.allocate(dt, f"d_res_att.{i}", (B, T, C)) if keep else g.d_res_ffn
            g.d_ln2 = alloc.allocate(dt, f"d_ln2.{i}", (B, T, C)) if keep else self.d_lnf
            g.d_att_y = alloc.allocate(dt, f"d_att_y.{i}", (B, T, C)) if keep else self.d_lnf
            g.d_ln1 = alloc.allocate(dt, f"d_ln1.{i}", (B, T, C)) if keep else self.d_lnf
            if self.fp8:
                gd = self.grad_dtype
                g.d_res_ffn_q = alloc.allocate(gd, f"d_res_ffn_q.{i}", (B, T, C), stats=False)
                g.d_res_att_q = (
                    alloc.allocate(gd, f"d_res_att_q.{i}", (B, T, C), stats=False) if keep else g.d_res_ffn_q
                )
                g.d_qkv_q = alloc.allocate(gd, f"d_qkv_q.{i}", (B, T, Q), stats=False)
            layers.append(g)
        return layers

    def _attach_stats(self) -> None:
        """Give each layer's quant views their own stats slots (shared storage, per-layer scales)."""
        for i, (a, g) in enumerate(zip(self.acts, self.dacts)):
            slot = {name: self.abs_maxes[i][k] for k, name in enumerate(STAT_SLOTS)}
            for name in ("ln1_q", "att_q", "ln2_q", "swiglu_q"):
                setattr(a, name, getattr(a, name).with_stats(slot[name]))
            for name in ("d_res_ffn_q", "d_res_att_q", "d_qkv_q"):
                setattr(g, name, getattr(g, name).with_stats(slot[name]))
            # d_mlp_up's FP8 copy is a stack temporary: keep its slot, and the abs-max view swiglu_backward fills
            g.d_mlp_up_stats = slot["d_mlp_up_q"]
            g.d_mlp_up_amax = g.d_mlp_up_stats.rows(STAT_ABS_MAX, STAT_ABS_MAX + 1)

    # ---- step temporaries ---------------------------------------------------------------------
    def acquire_mlp_up(self, layer: int):
        a = self.acts[layer]
        if a.mlp_up is not None:
            return a.mlp_up
        return self.stack.allocate(self.dtype, (self.B, self.T, 2 * self.cfg.intermediate_size), "mlp_up")

    def release_mlp_up(self, layer: int, t) -> None:
        if self.acts[layer].mlp_up is None:
            self.stack.free(t)

    def lmhead_rows(self) -> int:
        return self.B * self.T // self.opts.lmhead_chunks

    def size_stack(self) -> None:
        """Allocate the stack exactly as large as a simulated step needs (context "Stack")."""
        sim = DeviceMemoryStack.simulate(self.device)
        simulate_stack(self, sim)
        with self.alloc.context("Stack"):
            self.stack = DeviceMemoryStack.sized_from(sim, self.alloc, name="stack")


def qmm_backward_temporaries(rs, stack, rows: int, C: int, OC: int) -> None:
    """The stack use of one FP8 backward matmul (`LlamaModel._qmm_backward`), for simulation."""
    if not rs.fp8:
        return
    stack.free(stack.allocate(rs.mm_dtype, (C, OC), "weight_tp"))
    act = stack.allocate(rs.mm_dtype, (C, rows), "act_tp")
    stack.free(stack.allocate(rs.grad_dtype, (OC, rows), "grad_tp"))
    stack.free(act)


def simulate_stack(rs, stack) -> None:
    """Run the stack allocations of one step, in the order `LlamaModel` makes them.

    Forward needs no temporaries; backward of a block holds mlp_up (recompute_ffn) while it
    allocates d_swiglu, the FP8 d_mlp_up copy, d_qkv and the FP8 transposes; the LM head holds
    one chunk of logits. Keep this in step with llama.py.
    """
    cfg, B, T = rs.cfg, rs.B, rs.T
    C, H, Q, N = cfg.hidden_size, cfg.intermediate_size, cfg.qkv_channels, B * T
    if rs.acts[0].mlp_up is None:
        mlp_up = stack.allocate(rs.dtype, (B, T, 2 * H), "mlp_up")
    d_swiglu = stack.allocate(rs.dtype, (B, T, H), "d_swiglu")
    qmm_backward_temporaries(rs, stack, N, H, C)
    stack.free(d_swiglu)
    if rs.fp8:
        d_up_q = stack.allocate(rs.grad_dtype, (B, T, 2 * H), "d_mlp_up_q")
        qmm_backward_temporaries(rs, stack, N, C, 2 * H)
        stack.free(d_up_q)
    qmm_backward_temporaries(rs, stack, N, C, C)
    d_qkv = stack.allocate(rs.dtype, (B, T, Q), "d_qkv")
    qmm_backward_temporaries(rs, stack, N, C, Q)
    stack.free(d_qkv)
    if rs.acts[0].mlp_up is None:
        stack.free(mlp_up)
    stack.free(stack.allocate(rs.dtype, (rs.lmhead_rows(), cfg.vocab_size), "lmhead_logits"))
