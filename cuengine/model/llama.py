"""LlamaModel: training and evaluation of a LLaMA / Qwen2 decoder (seed 001, LLMQ llama_model.cpp).

A step is forward → LM head + loss → backward → AdamW, all enqueued on the device's main stream
with buffers from the allocator or the stack, so any part can be captured into a CUDA graph.
This file holds the step's outer loops (embedding, residual stream, the RMSNorms between blocks,
graphs, the optimizer step); the blocks, their FP8 matmuls and the LM head are `blocks.Blocks`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import blas
from ..alloc import TensorAllocator
from ..device import device as _get_device
from ..dist.plan import ShardPlan
from ..dist.zero import DataParallel, flat_buckets
from ..dtypes import dtype as _dtype
from ..inference import InferenceMixin
from ..kernels import encoder, rmsnorm
from .adamw8bit import AdamW8bitState
from .blocks import RECORDING, Blocks
from .fit import options_that_fit
from .muon import MuonState
from .optimizer import AdamWState
from .options import TrainOptions, auto_lmhead_chunks
from .params import ParametersMixin
from .run_state import RunState
from .weights import ModelWeights, param_specs


def _check_lr(what: str, lr) -> None:
    if (
        isinstance(lr, bool)
        or not isinstance(lr, (int, float, np.integer, np.floating))
        or not (math.isfinite(lr) and lr >= 0)
    ):
        raise ValueError(f"{what}: lr must be a finite number >= 0, got {lr!r}")


def count_valid(targets: np.ndarray) -> int:
    """The number of targets that count in the loss (not -1), from the host array."""
    return int(np.count_nonzero(targets != -1))


class LlamaModel(ParametersMixin, InferenceMixin):
    """A LLaMA or Qwen2 causal LM on one device.

    Args:
        cfg: TransformerConfig.
        opts: TrainOptions (None: defaults); missing dtypes are filled in from the config.
        device: "cpu", "cuda", "auto" or a Device.
        alloc: optional TensorAllocator to allocate from (e.g. with a memory limit).
        comm: optional `cuengine.dist` Communicator of several ranks, each training on its own
            batch; `opts.zero_stage` says what is sharded (`cuengine.dist.zero`). The device must
            be the communicator's. Losses, valid-target counts and gradient norms are then those
            of all ranks' batches together.
    """

    def __init__(self, cfg, opts: TrainOptions | None = None, device="auto", alloc: TensorAllocator | None = None,
                 comm=None):  # fmt: skip
        self.cfg = cfg
        self.opts = (opts or TrainOptions()).resolved(cfg.dtype)
        self.device = _get_device(device)
        self.alloc = alloc or TensorAllocator(self.device)
        self.dtype = _dtype(self.opts.model_dtype)
        self.comm = comm if comm is not None and comm.world_size > 1 else None
        self._plan = self._dp = None
        if self.comm is not None:
            if self.comm.device is not self.device:
                raise ValueError(f"LlamaModel: the model is on {self.device}, the communicator on {self.comm.device}")
            self._plan = ShardPlan(param_specs(cfg), self.comm.world_size)
        self.weights = ModelWeights(cfg, self.dtype, self.alloc, fp8=self.opts.fp8, layout=self._plan,
                                    fp8_head=self.opts.lmhead_fp8)  # fmt: skip
        self.rs: RunState | None = None
        self.grads: dict | None = None
        self._grads_flat = None  # the one buffer the 1-GPU gradients are views of
        self._grads_written = False  # by a backward or a script (gradients()): before, the buffer holds old bytes
        self._blocks: Blocks | None = None
        self.opt_state: AdamWState | None = None
        self.step = 0
        self._graphs: dict = {}
        self._graphs_warm: set = set()
        self._in_graph = False
        if self.comm is not None:  # NCCL destroys a communicator only once the graphs of its collectives are gone
            self.comm.on_close(self, lambda model: model._graphs.clear())
        self.skipped_steps = 0  # steps skipped for a non-finite gradient norm (opts.skip_nonfinite_steps)
        # ZeRO >= 1: the last update left the all-gather of the layers' and head's weights to the
        # next forward (`cuengine.dist.zero`); every other reader of the weights syncs first
        self._gather_due = False

    # ---- run state ---------------------------------------------------------------------------
    def allocate_run_state(self, B: int, T: int) -> None:
        """Allocate every buffer a step of batch (B, T) needs: activations, gradients, optimizer
        state, scratch and the stack (sized by running a block and the LM head against a simulated
        stack). Call once, before stepping.

        The buffers are one plan (`TensorAllocator.all_or_nothing`): when it does not fit in memory
        nothing stays allocated, and the MemoryError says which recompute / offload / LM-head
        chunking options would make it fit, found by allocating the plan with each in turn (a
        long T needs them: activations grow with T, the logits with T times the vocabulary)."""
        o, cfg = self.opts, self.cfg
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in (B, T)):
            raise ValueError(f"allocate_run_state: B and T must be ints, got B={B!r}, T={T!r}")
        if B < 1 or T < 1:
            raise ValueError(f"allocate_run_state: B and T must be >= 1, got B={B}, T={T}")
        if T > cfg.max_position_embeddings:
            raise ValueError(f"allocate_run_state: T={T} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        if o.lmhead_chunks is None:  # the run state's options say how many chunks were chosen
            o = self.opts = dataclasses.replace(
                o, lmhead_chunks=auto_lmhead_chunks(B * T, cfg.vocab_size, self.dtype.itemsize)
            )
        if (B * T) % o.lmhead_chunks:
            raise ValueError(f"allocate_run_state: lmhead_chunks={o.lmhead_chunks} does not divide B*T={B * T}")
        if o.recompute_ffn_layers > cfg.num_layers:
            raise ValueError(f"allocate_run_state: recompute_ffn_layers={o.recompute_ffn_layers} exceeds the model's "
                             f"{cfg.num_layers} layers")  # fmt: skip
        if B % o.attn_bwd_chunks:
            raise ValueError(f"allocate_run_state: attn_bwd_chunks={o.attn_bwd_chunks} does not divide B={B}")
        if o.fp8 and (B * T) % 16:
            # the weight-gradient GEMMs reduce over B*T, and FP8 GEMMs need K % 16 == 0
            raise ValueError(f"allocate_run_state: FP8 matmuls need B*T to be a multiple of 16, got {B * T}")
        if self.rs is not None:
            raise ValueError("allocate_run_state: the run state is already allocated; make a new LlamaModel")
        blas.init(self.alloc)
        try:
            self._build_run_state(o, B, T)
            return
        except MemoryError as err:
            why = str(err)  # leaving the handler drops the traceback, and with it the failed plan's buffers
        raise MemoryError(f"allocate_run_state: B={B}, T={T} does not fit in memory with these options; "
                          f"{options_that_fit(self, B, T)}\n{why}")  # fmt: skip

    def _allocate_grads(self) -> tuple:
        """One flat gradient buffer and each parameter's gradient as a view of it: the first
        micro-step zeroes them all with one memset instead of one per parameter (~170 graph nodes).
        Views start on 256-byte boundaries, as separate allocations would."""
        layout = ShardPlan(self.weights.specs, 1, align=256 // self.dtype.itemsize)
        with self.alloc.context("Gradients"):
            flat = self.alloc.allocate(self.dtype, "gradients", (layout.total,))
        grads = {}
        for name, shape, _ in self.weights.specs:
            s = layout.params[name]
            grads[name] = flat.rows(s.offset, s.offset + s.numel).reshape(shape)
            grads[name].name = f"d.{name}"
        return flat, grads

    def _build_run_state(self, o: TrainOptions, B: int, T: int) -> None:
        """The run state, gradients, optimizer state and stack for options `o`: all of it, or
        (MemoryError) none of it."""
        cfg = self.cfg
        try:
            with self.alloc.all_or_nothing(f"the run state of B={B}, T={T}"):
                self.rs = RunState(cfg, o, B, T, self.alloc)
                opt_specs = self.weights.specs
                if self.comm is None:
                    self._grads_flat, self.grads = self._allocate_grads()
                else:
                    if o.zero_stage and getattr(o, "optimizer", "adamw") != "adamw":
                        raise ValueError(f"allocate_run_state: zero_stage {o.zero_stage} shards AdamW's moments; "
                                         f"with optimizer={o.optimizer!r} use zero_stage=0")  # fmt: skip
                    self._dp = DataParallel(self.comm, o.zero_stage, self._plan, self.dtype, self.alloc, B * T,
                                            o.opt_m_dtype, o.opt_v_dtype)  # fmt: skip
                    self.grads = self._dp.grads
                    if o.zero_stage > 0:
                        opt_specs = []  # the moments are DataParallel's shards
                block_grads = [{k[len(f"layers.{i}.") :]: v for k, v in self.grads.items()
                                if k.startswith(f"layers.{i}.")} for i in range(cfg.num_layers)]  # fmt: skip
                if o.optimizer == "adamw8bit":
                    self.opt_state = AdamW8bitState(opt_specs, self.alloc, multi_tensor=self.comm is None)
                elif o.optimizer == "muon":
                    self.opt_state = MuonState(cfg, self.weights.specs, self.alloc, o.muon_momentum)
                else:
                    self.opt_state = AdamWState(opt_specs, self.alloc, o.opt_m_dtype, o.opt_v_dtype)
                self._blocks = Blocks(cfg, o, self.weights, self.rs, block_grads)
                recording = Blocks(cfg, o, self.weights, self.rs, block_grads, RECORDING)
                self.rs.size_stack(lambda: self._step_temporaries(recording))
        except BaseException:
            self.rs = self.grads = self._grads_flat = self.opt_state = self._blocks = None
            raise

    def _step_temporaries(self, blocks: Blocks) -> None:
        """Everything in a step that takes stack memory: a block's forward and backward (every
        block allocates alike) and the LM head; with RECORDING kernels, this sizes the stack."""
        rs = self.rs
        if self._dp is not None and self._dp.stage:  # DataParallel.encode's lookups
            with rs.stack.temporary(*self._dp.lookups, "encode_lookups"):
                pass
        for filled in (False, True) if rs.fp8_history is not None else (False,):  # both ways of scaling
            rs.fp8_history_filled = filled
            blocks.forward(0, rs.encoded)
            blocks.backward(0, rs.encoded)
        rs.fp8_history_filled = False
        blocks.lm_head(1.0, d_head=self._head_grad)

    @property
    def _head_grad(self):
        return self.grads["wte" if self.cfg.tied_embeddings else "lm_head"]

    def memory_report(self):
        """The allocator's MemoryReport: bytes per context and per named buffer."""
        return self.alloc.report()

    def _need_rs(self, what):
        if self.rs is None:
            raise ValueError(f"{what}: call allocate_run_state(B, T) first")
        return self.rs

    # ---- inputs ------------------------------------------------------------------------------
    def _check_tokens(self, arr, what: str, allow_ignore: bool) -> np.ndarray:
        rs = self.rs
        if not isinstance(arr, np.ndarray) or arr.dtype != np.int32:
            got = f"{arr.dtype} array" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise ValueError(f"{what}: expected an int32 NumPy array of shape ({rs.B}, {rs.T}), got {got}")
        if arr.shape != (rs.B, rs.T):
            raise ValueError(
                f"{what}: expected shape (B, T) = ({rs.B}, {rs.T}) as allocated by allocate_run_state, got {arr.shape}"
            )
        lo = -1 if allow_ignore else 0
        V = self.cfg.vocab_size
        if arr.size and (arr.min() < lo or arr.max() >= V):
            bad = arr[(arr < lo) | (arr >= V)]
            allowed = f"[-1, {V}) (-1 = ignore)" if allow_ignore else f"[0, {V})"
            raise ValueError(f"{what}: token id {int(bad[0])} outside {allowed}; {bad.size} such ids")
        return arr

    def _upload(self, host, dst, event, arr) -> None:
        event.synchronize()  # the previous copy out of this pinned buffer has finished
        host.array()[...] = arr
        self.device.copy_async(dst, host)
        self.device.stream.record(event)

    def _upload_targets(self, targets, d_loss: float) -> None:
        """Enqueue the copy of `targets` and of the per-token loss weight `d_loss`, in one upload."""
        rs = self.rs
        rs.targets_event.synchronize()  # the previous copy out of the pinned buffer has finished
        rs.targets_host.array()[...] = targets
        rs.d_loss_host.array()[...] = d_loss
        self.device.copy_async(rs.targets_upload, rs.targets_upload_host)
        self.device.stream.record(rs.targets_event)

    def _graph(self, key, fn) -> None:
        """Run `fn`, or with use_cuda_graphs: run it eagerly the first time (kernels compile and
        matmul plans are built outside any capture), capture it under `key` the second time,
        then replay. Calls nested inside a captured `fn` run plainly, becoming part of it."""
        if not self.opts.use_cuda_graphs or self._in_graph:
            fn()
            return
        if self.rs is not None and self.rs.fp8_history is not None:  # the first micro-step scales as the rest
            key = (*key, self.rs.fp8_history_filled)
        g = self._graphs.get(key)
        self._in_graph = True
        try:
            if g is None and key not in self._graphs_warm:
                self._graphs_warm.add(key)
                fn()
                return
            if g is None:
                g = self._graphs[key] = self.device.capture(fn)
            g.launch()
        finally:
            self._in_graph = False

    @property
    def _whole_graphs(self) -> bool:
        """Capture forward and backward whole; offload's side-stream copies need per-block graphs."""
        return not self.opts.offload_residual

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, inputs) -> None:
        """Run the forward pass of `inputs` (int32 (B, T)) up to the final RMSNorm (`lnf`).
        Enqueued only: no host sync."""
        rs = self._need_rs("forward")
        self._need_weights("forward")
        self._check_tokens(inputs, "inputs", allow_ignore=False)
        self._upload(rs.inputs_host, rs.inputs, rs.inputs_event, inputs)
        gather, self._gather_due = self._gather_due, False
        if self._whole_graphs:
            self._graph(("forward", "gather") if gather else ("forward",), lambda: self._forward(gather))
        else:
            self._forward(gather)

    def _forward(self, gather: bool = False) -> None:
        """The forward; with `gather`, also the all-gather the last update left due, layer l
        waiting only for its own bucket (and re-quantizing its FP8 copies) before it runs."""
        rs, cfg, W = self.rs, self.cfg, self.weights
        L, eps = cfg.num_layers, cfg.rms_norm_eps
        res = rs.residuals
        if gather:  # the encoder reads the embedding's shards: its gather runs beside the whole forward
            self._dp.encode(rs.encoded, rs.inputs, W["wte"], rs.stack)
            self._dp.start_gather(self._weight_buckets)
        else:
            encoder.encoder_forward(rs.encoded, rs.inputs, W["wte"])  # (B, T, C)
        if self.opts.fp8:
            rs.abs_maxes.fill_zero()
        for i in range(L):
            a, w = rs.acts[i], W.block(i)
            if gather:  # ln1_w is the first of layer i's weights read
                self._gathered(f"layers.{i}")
            if i == 0:
                residual = rs.encoded
                rmsnorm.rmsnorm_forward(a.ln1.value, a.ln1_rstd, residual, w["ln1_w"], eps, abs_max=a.ln1.abs_max)
            else:
                p = rs.acts[i - 1]
                residual = res.get(i - 1)
                # res_ffn[i-1] = res_att[i-1] + mlp_down[i-1] (mlp_down lives in lnf)
                rmsnorm.fused_residual_rmsnorm_forward(residual, a.ln1.value, a.ln1_rstd, p.res_att, rs.lnf,
                                                       w["ln1_w"], eps, abs_max=a.ln1.abs_max)  # fmt: skip
                res.mark_ready(i - 1)
            self._graph(("forward", i), lambda i=i, r=residual: self._blocks.forward(i, r))
            if i > 0:
                res.put(i - 1)
        if gather:
            self._gathered("head")
            self._gathered("embedding")  # (re-quantizing a tied FP8 head before the backward reads it)
            self.comm.join()  # a captured graph rejoins every stream it forked
        last = rs.acts[L - 1]
        rmsnorm.fused_residual_rmsnorm_forward(res.get(L - 1), rs.lnf, rs.lnf_rstd, last.res_att, rs.lnf,
                                               W["lnf_w"], eps)  # fmt: skip
        res.mark_ready(L - 1)
        res.put(L - 1)

    # ---- backward ----------------------------------------------------------------------------
    def backward(self, inputs, targets, micro_step: int = 0, grad_accum_steps: int = 1,
                 valid_tokens: int | None = None) -> None:  # fmt: skip
        """LM head, loss and backward through every block after `forward(inputs)`.

        The gradient is that of the mean loss over the valid targets (not -1) of the whole
        accumulated batch, as PyTorch's cross_entropy and HF's `num_items_in_batch` define it:
        each valid target's loss weighs 1/valid_tokens. `valid_tokens` counts them over all
        `grad_accum_steps` micro-batches; None takes this micro-batch's count times
        grad_accum_steps (each micro-batch's mean weighs the same, which is the same thing when
        every micro-batch holds as many valid targets). Parameter gradients are zeroed on
        micro_step 0 and accumulate over micro-steps. Enqueued only: no host sync (the weight
        travels to the device with the targets).
        """
        self._need_rs("backward")
        self.sync_weights()  # (a no-op after forward, which gathers what is due)
        self._check_tokens(inputs, "inputs", allow_ignore=False)
        self._check_tokens(targets, "targets", allow_ignore=True)
        if not 0 <= micro_step < grad_accum_steps:
            raise ValueError(f"backward: micro_step={micro_step} outside [0, grad_accum_steps={grad_accum_steps})")
        here = count_valid(targets)
        if valid_tokens is None:
            valid_tokens = here * grad_accum_steps
        elif isinstance(valid_tokens, bool) or not isinstance(valid_tokens, (int, np.integer)) or valid_tokens < here:
            raise ValueError(f"backward: valid_tokens={valid_tokens!r} must be an int >= the {here} valid targets "
                             "of this micro-batch (it counts those of every micro-batch)")  # fmt: skip
        # several ranks: every rank's valid targets weigh alike, so the count goes up and the device adds them all
        weight = 1.0 / max(int(valid_tokens), 1) if self._dp is None else self._dp.count_bits(valid_tokens)
        self._upload_targets(targets, weight)
        if self._whole_graphs:
            key = ("backward", micro_step == 0)
            if self._dp is not None:  # ranks communicate in the last micro-step's backward
                key += (micro_step == grad_accum_steps - 1,)
            self._graph(key, lambda: self._backward(micro_step, grad_accum_steps))
        else:
            self._backward(micro_step, grad_accum_steps)
        if self.rs.fp8_history is not None:  # _backward rolled it: the next forward quantises with its scales
            self.rs.fp8_history_filled = True
        self._grads_written = True

    def _backward(self, micro_step: int, grad_accum_steps: int = 1) -> None:
        rs, cfg, W, G, dp = self.rs, self.cfg, self.weights, self.grads, self._dp
        L, res = cfg.num_layers, rs.residuals
        if micro_step == 0:
            if dp is None:
                self._grads_flat.fill_zero()
            rs.losses.fill_zero()
        if dp is not None:
            dp.begin_backward(micro_step, grad_accum_steps, rs.d_loss)
        # the encoder backward's token plan, beside the LM head: off the critical path (the last sum that
        # read the scratch and this micro-batch's token upload are before the fork, on the main stream)
        rs.enc_stream.wait(rs.enc_fork.record())
        encoder.encoder_backward_plan(rs.enc_scratch, rs.inputs, *G["wte"].shape, stream=rs.enc_stream)
        rs.enc_stream.record(rs.enc_join)
        self._blocks.lm_head(rs.d_loss, d_head=self._head_grad)
        top = rs.dacts[L - 1].d_res_ffn
        top.value.fill_zero()
        rmsnorm.rmsnorm_backward(top.value, G["lnf_w"], rs.rms_scratch, top.value, rs.d_lnf, res.get(L - 1),
                                 W["lnf_w"], rs.lnf_rstd, abs_max=top.abs_max)  # fmt: skip
        res.release(L - 1)
        if dp is not None:
            dp.bucket_done("head")
        # res_ffn[L-2] is still in its device buffer from forward (only res_ffn[L-1] came after
        # it, into the other buffer), so the first fetch is for L-3, issued in the loop.
        for i in reversed(range(L)):
            if i > 1:
                res.fetch(i - 2)
            a, g, w = rs.acts[i], rs.dacts[i], W.block(i)
            residual = rs.encoded if i == 0 else res.get(i - 1)
            if dp is not None:
                dp.before_layer(i)
            self._graph(("backward", i), lambda i=i, r=residual: self._blocks.backward(i, r))
            dg = G[f"layers.{i}.ln1_w"]
            if i > 0:
                prev = rs.dacts[i - 1].d_res_ffn
                rmsnorm.rmsnorm_backward(prev.value, dg, rs.rms_scratch, g.d_res_att.value, g.d_ln1, residual,
                                         w["ln1_w"], a.ln1_rstd, abs_max=prev.abs_max)  # fmt: skip
                res.release(i - 1)
            else:
                rmsnorm.rmsnorm_backward(rs.d_emb, dg, rs.rms_scratch, g.d_res_att.value, g.d_ln1, rs.encoded,
                                         w["ln1_w"], a.ln1_rstd)  # fmt: skip
            if dp is not None:
                dp.bucket_done(f"layers.{i}")
        self.device.stream.wait(rs.enc_join)
        encoder.encoder_backward_sum(G["wte"], rs.d_emb, rs.inputs, rs.enc_scratch)
        if dp is not None:
            dp.bucket_done("embedding")
            dp.end_backward(rs.losses)
        if rs.fp8_history is not None:
            if dp is not None:  # one history on every rank (and in a checkpoint): the abs-maxes' max over ranks
                self.comm.all_reduce(rs.abs_maxes, op="max")
            rs.roll_fp8_history()

    # ---- update ------------------------------------------------------------------------------
    def update(self, lr: float, step: int | None = None) -> None:
        """Global norm, clipping and one AdamW step at learning rate `lr` (`step` defaults to
        the next step number; it drives the bias correction). Enqueued only: no host sync.

        A non-finite gradient norm leaves weights and moments as they were: the clip scale is
        then NaN, and AdamW reads it on the device and writes nothing. The host does not learn
        of it here; `finish_step` (and so `train_step`) checks the norm before updating."""
        self._need_rs("update")
        _check_lr("update", lr)
        self._need_grads("update")
        self._graph(("norm",), self._norm)
        self._adamw(lr, step)

    def _norm(self) -> None:
        if self._dp is None:
            self.opt_state.global_norm(self.grads, self.opts.grad_clip)
        else:
            self._dp.global_norm(self.opt_state, self.opts.grad_clip)

    def _adamw(self, lr: float, step: int | None = None) -> None:
        o = self.opts
        self.sync_weights()  # an update right after an update: the first one's gather goes first
        self.step = self.step + 1 if step is None else int(step)
        self.opt_state.set_hparams(lr, o.beta1, o.beta2, o.eps, o.weight_decay, self.step)
        self._graph(("adamw",), self._update)
        self._gather_due = self._dp is not None and self._dp.stage > 0

    def _update(self) -> None:
        if self._dp is None:
            w, opt = self.weights, self.opt_state
            if w.fp8 and opt.records_abs_max:  # the update's stores give each FP8 copy its abs-max (one memset)
                w.zero_abs_max()
                opt.update(w.tensors, self.grads, self.opts.seed, abs_max=w.abs_max_slots)
                w.requantize(abs_max_recorded=True)
                return
            opt.update(w.tensors, self.grads, self.opts.seed)
            w.requantize()
            return
        self._dp.update(self.weights.tensors, self.opt_state, self.opts.seed)
        if self._dp.stage == 0:  # (stages 1 and 2 re-quantize each bucket after its gather)
            self.weights.requantize()

    # ---- the all-gather of the updated weights (ZeRO >= 1; cuengine.dist.zero) -----------------
    @property
    def _weight_buckets(self) -> dict:
        return flat_buckets(self._plan, self.weights.flat)

    def _fp8_of(self, bucket: str) -> list:
        """The parameters of `bucket` that have FP8 copies."""
        return [p.name for p in self._plan.bucket(bucket).params if p.name in self.weights.fp8]

    def _gathered(self, bucket: str) -> None:
        """The main stream waits for `bucket`'s all-gather, then re-quantizes its FP8 copies."""
        self._dp.wait_gathered(bucket)
        self.weights.requantize(self._fp8_of(bucket))

    def sync_weights(self) -> None:
        """Make the weights whole now. With zero_stage >= 1 an update leaves the all-gather of
        the layers' and the head's weights to the next forward, which overlaps it with the layers
        before (`cuengine.dist.zero`); anything else that reads the weights calls this first, on
        every rank (it is then a collective). `backward`, `update`, `finish_step`,
        `save_checkpoint` and `Trainer.run`'s end call it; `parameters()`, `export_weights` and
        generation, which one rank may call alone, raise instead of gathering. Enqueued only (the
        main stream waits for the gathers, the host does not); a no-op when nothing is due."""
        if not self._gather_due:
            return
        self._gather_due = False
        self._graph(("gather",), self._gather_all)

    def _gather_all(self) -> None:
        self._dp.start_gather(self._weight_buckets)
        self.comm.join()
        for b in self._dp.late:
            self.weights.requantize(self._fp8_of(b.name))

    def _need_grads(self, what: str) -> None:
        if not self._grads_written:
            raise ValueError(f"{what}: no gradients yet; run backward first (or write them through gradients())")

    def _need_weights(self, what: str) -> None:
        if not self.weights.assigned:
            raise ValueError(f"{what}: the model's weights were never set; call init_weights(seed), "
                             "import_weights(path) or load_checkpoint(path) first, or write every one through "
                             "parameters()")  # fmt: skip

    def _need_whole_weights(self, what: str) -> None:
        """Raise when a gather is due: `what` may run on one rank alone, so it cannot gather."""
        if self._gather_due:
            raise ValueError(f"{what}: with zero_stage {self.opts.zero_stage} the last update's weights are "
                             "all-gathered by the next forward; call sync_weights() on every rank first")  # fmt: skip

    def _prepare(self, what, *args):
        self._need_weights(what)  # generate / stream (InferenceMixin)
        self._need_whole_weights(what)
        return super()._prepare(what, *args)

    def loss_sum(self) -> float:
        """Sum of the per-token losses accumulated since micro-step 0 (after `backward` over grad
        accumulation; divided by the valid targets it is the mean loss); waits for the device, so
        call it once per step."""
        rs = self.rs
        if self._dp is not None:  # several ranks: over every rank's tokens
            return self._dp.loss_sum()
        self.device.copy(rs.losses_host, rs.losses)
        return float(np.sum(rs.losses_host.array(), dtype=np.float64))

    def finish_step(self, lr: float, valid_tokens: int) -> float:
        """After `backward` of every micro-batch: the gradient norm, one host sync to read the loss
        and the norm, then the AdamW update; returns the mean loss over `valid_tokens` (the valid
        targets of all micro-batches, as passed to `backward`; with several ranks this rank's, and
        the loss is that of all ranks' batches).

        A non-finite loss raises FloatingPointError and updates nothing. So does a non-finite
        gradient norm, unless `TrainOptions.skip_nonfinite_steps`: then the step is skipped
        (weights, moments and the step number unchanged), counted in `skipped_steps`, and the
        loss returned (the usual loss-scaler behaviour).
        """
        self._need_rs("finish_step")
        _check_lr("finish_step", lr)
        self._need_grads("finish_step")
        if isinstance(valid_tokens, bool) or not isinstance(valid_tokens, (int, np.integer)) or valid_tokens < 1:
            raise ValueError(f"finish_step: valid_tokens must be an int >= 1, got {valid_tokens!r}")
        rs, opt = self.rs, self.opt_state
        self._graph(("norm",), self._norm)
        self.device.copy_async(opt.norm_host, opt.norm_result)
        if self._dp is None:
            self.device.copy_async(rs.losses_host, rs.losses)
            self.device.stream.synchronize()
            loss = float(np.sum(rs.losses_host.array(), dtype=np.float64)) / int(valid_tokens)
        else:  # the gathered losses of every rank over the count of all their valid targets
            loss = self._dp.loss_sum() / self._dp.count  # loss_sum reads the count
        norm = float(opt.norm_host.array()[0])
        if not math.isfinite(loss):
            raise FloatingPointError(f"the loss is {loss} (non-finite); the update was skipped")
        if not math.isfinite(norm):
            if not self.opts.skip_nonfinite_steps:
                raise FloatingPointError(f"the gradient norm is {norm} (non-finite; the loss {loss:.6g} is finite); "
                                         "the update was skipped")  # fmt: skip
            self.skipped_steps += 1
            return loss
        self._adamw(lr)
        return loss

    def train_step(self, inputs, targets, lr: float) -> float:
        """forward + backward + update on one batch; returns the mean loss over the valid targets
        (those not -1), as PyTorch's cross_entropy. The host waits once, for the loss and the
        gradient norm, before the update is enqueued (see `finish_step` for non-finite values)."""
        self._need_rs("train_step")
        self._check_tokens(inputs, "inputs", allow_ignore=False)
        self._check_tokens(targets, "targets", allow_ignore=True)
        _check_lr("train_step", lr)
        n = count_valid(targets)
        if n == 0:
            raise ValueError("train_step: every target is -1 (ignored); there is no loss to learn from")
        self.forward(inputs)
        self.backward(inputs, targets, valid_tokens=n)
        try:
            return self.finish_step(lr, n)
        except FloatingPointError as err:
            raise FloatingPointError(f"train_step: {err}") from None

    def validate(self, inputs, targets) -> float:
        """Mean loss over the valid targets (not -1) of `targets` given `inputs`, without gradients."""
        rs = self._need_rs("validate")
        self._check_tokens(targets, "targets", allow_ignore=True)
        n = count_valid(targets)
        if n == 0:
            raise ValueError("validate: every target is -1 (ignored); the mean loss is undefined")
        self.forward(inputs)
        self._upload_targets(targets, 0.0 if self._dp is None else self._dp.count_bits(n))
        rs.losses.fill_zero()
        self._blocks.lm_head(0.0)
        if self._dp is not None:  # the mean over every rank's batch
            self._dp.gather_losses(rs.losses)
            self._dp.loss_weight(rs.d_loss)
        loss = self.loss_sum()
        loss /= n if self._dp is None else self._dp.count
        if not math.isfinite(loss):
            raise FloatingPointError(f"validate: the loss is {loss} (non-finite)")
        return loss

    def logits(self, inputs) -> np.ndarray:
        """float32 logits (B, T, V) of `inputs`, for generation and tests. A batch smaller than
        the run state's (B, T) is zero-padded: causal attention keeps the real positions exact,
        and with FP8 matmuls the activation scales are taken over the real rows alone, so the
        padding changes nothing (CUDA graphs are not used for a padded batch)."""
        rs = self._need_rs("logits")
        inputs = np.asarray(inputs)
        if inputs.ndim != 2 or inputs.shape[0] > rs.B or inputs.shape[1] > rs.T:
            raise ValueError(f"logits: inputs must be (b, t) with b <= {rs.B} and t <= {rs.T}, got {inputs.shape}")
        if inputs.dtype != np.int32:
            raise ValueError(f"logits: expected an int32 NumPy array, got {inputs.dtype}")
        b, t = inputs.shape
        padded = np.zeros((rs.B, rs.T), np.int32)
        padded[:b, :t] = inputs
        out = np.empty((rs.B * rs.T, self.cfg.vocab_size), np.float32)
        if (b, t) == (rs.B, rs.T) or not self.opts.fp8:
            self.forward(padded)
        else:
            real = [(0, b * rs.T)] if t == rs.T else [(i * rs.T, i * rs.T + t) for i in range(b)]
            self._blocks.real_rows, self._in_graph = real, True  # _in_graph: run plainly, capture nothing
            try:
                self.forward(padded)
            finally:
                self._blocks.real_rows, self._in_graph = None, False
        self._blocks.lm_head(0.0, logits_out=out)
        return out.reshape(rs.B, rs.T, -1)[:b, :t]
