"""DataParallel: what a model adds to its training step when it runs on several ranks.

zero_stage 0 is plain data parallelism: every rank keeps full gradients, all-reduces them
bucket by bucket and runs the full AdamW update (the same bits on every rank). zero_stage 1
(LLMQ's mode) keeps full gradients for accumulation but, in the backward of the last micro-step,
reduce-scatters each bucket as soon as backward is done with it; each rank then runs AdamW on
its shard only (moments for the shard alone) and all-gathers the updated weights (see "The
all-gather of the updated weights" below). zero_stage 2
keeps only the gradient shard: each layer's gradients go into one of two alternating bucket
buffers, which are reduce-scattered into the shard after every micro-step, so backward of
layer i-1 fills one buffer while layer i's reduce-scatter drains the other. To accumulate over
micro-steps without an add kernel, a bucket buffer starts a later micro-step holding the shard
so far in this rank's own chunk (zeros elsewhere): backward adds its gradients on top (every
parameter gradient is `+=`), and the reduce-scatter's sum then carries the shard forward.

Collectives run on the communicator's stream: `comm.wait_for()` orders each after the main
stream's work that produced its bucket, so it overlaps with the backward of the next layer,
and the main stream joins before anything reads the results. Nothing here allocates or waits
on the host inside a step, so a captured step replays its collectives too. That includes the
loss weight 1/(valid targets of every rank): each rank uploads its count with its targets, and
`loss_weight` all-reduces it and takes the reciprocal on the device; the host reads the total
with the losses, at the step's one sync (`loss_sum`).

The global gradient norm is the same on every rank and deterministic: each rank sums the squares
of the gradient elements it owns (its pieces of the plan, in plan order) into the norm partials,
which one small all-reduce adds up in rank order; all three stages compute it the same way.
The norm and (stages 1 and 2) the shard's AdamW run as multi-tensor launches over a table of the
pieces (`adamw.MultiTensorTable`, each piece with its parameter's seed and `index_offsets` = its
first element), bitwise the launch per piece they replace: at 0.5B on two ranks rank 0 owns 146
pieces, 73 of them norm weights and biases of one block each, so 292 launches a step become 2 + 1.
Losses are all-gathered (not summed) so that the host adds the same per-token values in the same
order as one process with the whole batch would.

The all-gather of the updated weights (stages 1 and 2) is left *due* by `update`, so that no step
waits for it: the next forward issues every bucket's gather at its start (`start_gather`, on the
communication stream, one event per bucket: the layers in order, the head, then the embedding)
and waits for layer l's (`wait_gathered`) just before layer l reads its weights, so the gathers
run beside the forward of the layers before (only layer 0's is exposed), and the embedding's,
the largest, beside the whole forward: its first reader after the encoder is the LM head.
The encoder itself reads the embedding before any gather could finish, so that forward looks up
its rows from the shards instead (`encode`): the ranks all-gather their tokens (B*T int32), each
looks up every rank's tokens in the part of the table it owns, zeros elsewhere, and a
reduce-scatter adds the lookups up and hands each rank its own rows (2 * B*T*C elements move,
where the embedding's gather moves V*C; x + 0 is exact, so the rows are the table's bits). When
the embedding was gathered in the update instead, its gather finished 1.4 ms (0.5B) after the
update's last AdamW kernel, with nothing else to run beside it.
Gathers live in the same captured graph as the work they overlap: a CUDA graph must join every
stream it forked, so a gather issued in the update's graph could not be waited for in the
forward's. The model keeps the host flag saying a gather is due (`LlamaModel.sync_weights`).
The gather moves bytes only: the weights every rank then holds are those of today's order.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import BYTE, FP32, INT32
from ..dtypes import dtype as _dtype
from ..kernels import adamw, encoder, loss_weight, norm
from .plan import ShardPlan

STAGES = (0, 1, 2)


class DataParallel:
    """Gradient buffers, the sharded optimizer state and the collectives of one model's step.

    Args:
        comm: the Communicator (world_size > 1), on the model's device.
        stage: zero_stage, 0, 1 or 2.
        plan: the ShardPlan of the model's parameters for comm.world_size ranks.
        dtype: the gradient dtype (the model dtype).
        alloc: the model's TensorAllocator.
        tokens: B*T, the tokens of one rank's micro-batch (for the gathered losses).
        m_dtype, v_dtype: AdamW moment dtypes (sharded with stage >= 1).

    Attributes:
        grads: {name: Tensor}: where backward accumulates each parameter's gradient (with
            stage 2, layer i's gradients share buffer i % 2 with every other layer of its parity).
        count: the valid targets of every rank that the last `loss_weight` added up, as `loss_sum`
            last read it.
    """

    def __init__(self, comm, stage: int, plan: ShardPlan, dtype, alloc, tokens: int, m_dtype="fp32", v_dtype="fp32"):
        if stage not in STAGES:
            raise ValueError(f"DataParallel: zero_stage must be one of {STAGES}, got {stage!r}")
        if plan.world_size != comm.world_size:
            raise ValueError(f"DataParallel: the plan is for {plan.world_size} ranks, the job has {comm.world_size}")
        if comm.device is not alloc.device:
            raise ValueError(f"DataParallel: the communicator is on {comm.device}, the model on {alloc.device}")
        self.comm, self.stage, self.rank = comm, stage, comm.rank
        self.device = alloc.device
        self.plan = plan
        self._index = {name: i for i, (name, _, _) in enumerate(plan.specs)}
        self._pieces = plan.pieces(self.rank)
        dt = _dtype(dtype)
        layers = [b for b in plan.buckets if b.name.startswith("layers.")]
        with alloc.context("Gradients"):
            if stage < 2:
                self.buffers = flat_buckets(plan, alloc.allocate(dt, "d.flat", (plan.total,)))
                self.grad_shard = None
            else:
                _check_same_layout(layers)
                alternate = [alloc.allocate(dt, f"d.layers.{k}", (layers[0].size,)) for k in range(min(2, len(layers)))]
                self.buffers = {}
                for b in plan.buckets:
                    if b in layers:
                        self.buffers[b.name] = alternate[int(b.name.split(".")[1]) % 2]
                    else:
                        self.buffers[b.name] = alloc.allocate(dt, f"d.{b.name}", (b.size,))
                self.grad_shard = alloc.allocate(dt, "d.shard", (plan.shard_size,))
        self.grads = bucket_views(plan, self.buffers)
        self.m = self.v = None
        if stage >= 1:
            with alloc.context("Optimizer"):
                self.m = alloc.allocate(_dtype(m_dtype), "m.shard", (plan.shard_size,))
                self.v = alloc.allocate(_dtype(v_dtype), "v.shard", (plan.shard_size,))
        with alloc.context("Activations"):
            self.losses_all = alloc.allocate(FP32, "losses.all_ranks", (comm.world_size * tokens,))
            self.losses_host = alloc.allocate(FP32, "losses.all_ranks_host", (comm.world_size * tokens,),
                                              kind="pinned")  # fmt: skip
            self._count = alloc.allocate(INT32, "count.all_ranks", (1,))
            self._count_host = alloc.allocate(INT32, "count.all_ranks_host", (1,), kind="pinned")
        self._layer_free = [self.device.event() for _ in range(2)]  # stage 2: a layer buffer drained
        # the buckets whose updated weights the next forward gathers (`start_gather`), in the order it
        # issues them, each with the event of its gather
        embedding = plan.bucket("embedding")
        self.late = [b for b in plan.buckets if b is not embedding] + [embedding] if stage else []
        self._gathered = {b.name: self.device.event() for b in self.late}
        if stage:  # `encode`: the shard's part of the table, and every rank's tokens and lookups
            (wte,) = [p for p in embedding.params if p.name == "wte"]
            lo, hi = embedding.owned(self.rank)
            self._owned = (min(max(lo - wte.offset, 0), wte.numel), min(max(hi - wte.offset, 0), wte.numel))
            n = comm.world_size * tokens
            with alloc.context("Activations"):
                self._tokens_all = alloc.allocate(INT32, "tokens.all_ranks", (n,))
            self.lookups = (dt, (n, wte.shape[1]))  # (dtype, shape) of the stack temporary `encode` takes
            self._tokens_event, self._encoded_event = self.device.event(), self.device.event()
        # the multi-tensor tables over this rank's pieces: the norm's (built now) and, stages 1 and 2,
        # the one of `update`'s AdamW launch (built by its first call, see `_adamw_table`)
        with alloc.context("Optimizer"):
            sizes = [p.numel for p in self._pieces]
            self._norm_sums = alloc.allocate(FP32, "norm_sums.shard", adamw.multi_norm_sums_shape(sizes))
            table = alloc.allocate(BYTE, "norm_table.shard", adamw.multi_tensor_table_shape(sizes))
            self._norm_table = self._piece_table(table, self._pieces)
            self._table_bytes = alloc.allocate(BYTE, "adamw_table.shard", adamw.multi_tensor_table_shape(sizes))
        self._table, self._table_key = None, None
        self._micro, self._accum, self._drained, self._forked = 0, 1, set(), False
        self.count = 0
        self.zero()

    def zero(self) -> None:
        """Zero gradients (padding included: it is summed, never read) and moments."""
        for t in {id(t): t for t in self.buffers.values()}.values():
            t.fill_zero()
        for t in (self.grad_shard, self.m, self.v):
            if t is not None:
                t.fill_zero()

    # ---- backward hooks, in the order backward calls them -----------------------------------------
    def begin_backward(self, micro_step: int, grad_accum_steps: int, d_loss) -> None:
        """Prepare this micro-step: its loss weight (`loss_weight(d_loss)`), and what it accumulates
        into: zero every gradient on micro-step 0 (stages 0 and 1), or (stage 2) the embedding and
        head buckets on every micro-step, holding the shard so far in this rank's chunk after the
        first; layer buffers: `before_layer`."""
        self.loss_weight(d_loss)
        self._micro, self._accum = micro_step, grad_accum_steps
        self._drained = set()  # stage 2: layer buffers whose reduce-scatter this backward enqueued
        self._forked = False  # whether this backward put work on the communication stream
        if self.stage < 2:
            if micro_step == 0:
                for b in self.plan.buckets:
                    self.buffers[b.name].fill_zero()
            return
        for b in self.plan.buckets:
            if not b.name.startswith("layers."):
                self._start_bucket(b)

    def before_layer(self, i: int) -> None:
        """Stage 2: wait until the buffer layer i shares with layer i+2 has been reduce-scattered,
        then zero it for layer i's gradients."""
        if self.stage == 2:
            if i % 2 in self._drained:  # else the buffer was last drained before the previous step's join
                self.comm.wait(self._layer_free[i % 2])
            self._start_bucket(self.plan.bucket(f"layers.{i}"))

    def _start_bucket(self, b) -> None:
        buf = self.buffers[b.name]
        buf.fill_zero()
        if self._micro > 0:  # carry the shard so far (the last micro-step's reduce-scatter has joined)
            own = buf.rows(self.rank * b.shard, (self.rank + 1) * b.shard)
            self.device.copy_async(own, self.grad_shard.rows(b.shard_offset, b.shard_offset + b.shard))

    def bucket_done(self, name: str) -> None:
        """Backward has written its last gradient into bucket `name` ("head", "layers.<i>",
        "embedding"): start its collective on the communication stream."""
        last = self._micro == self._accum - 1
        if self.stage < 2 and not last:
            return
        comm, b = self.comm, self.plan.bucket(name)
        buf = self.buffers[name]
        comm.wait_for()
        self._forked = True
        s = comm.stream
        if self.stage == 0:
            comm.all_reduce(buf, stream=s)
        elif self.stage == 1:
            comm.reduce_scatter(buf.rows(self.rank * b.shard, (self.rank + 1) * b.shard), buf, stream=s)
        else:
            comm.reduce_scatter(self.grad_shard.rows(b.shard_offset, b.shard_offset + b.shard), buf, stream=s)
            if name.startswith("layers."):
                k = int(name.split(".")[1]) % 2
                comm.record(self._layer_free[k])
                self._drained.add(k)

    def end_backward(self, losses) -> None:
        """The main stream waits for every collective of this backward; on the last micro-step the
        per-token losses of all ranks are gathered (`gather_losses`). A backward that left the
        communication stream alone (stages 0 and 1 before the last micro-step) does not join it:
        in a captured backward that stream is then no part of the graph, and the main stream must
        not wait on an event recorded outside the capture."""
        if self._micro == self._accum - 1:
            self.gather_losses(losses)
        if self._forked:
            self.comm.join()

    def gather_losses(self, losses) -> None:
        """Every rank's per-token `losses` (B*T fp32), in rank order, into `losses_all`."""
        self.comm.all_gather(self.losses_all, losses.reshape(-1))

    def loss_sum(self) -> float:
        """Sum of every rank's per-token losses since micro-step 0 (gathered by `end_backward` or
        `gather_losses`), added in the order one process with all ranks' rows would; waits for
        the device, and reads `count` in the same wait."""
        self.device.copy_async(self._count_host, self._count)
        self.device.copy(self.losses_host, self.losses_all)
        self.count = int(self._count_host.array()[0])
        return float(np.sum(self.losses_host.array(), dtype=np.float64))

    @staticmethod
    def count_bits(n: int) -> np.float32:
        """The fp32 whose bits are the int32 `n`: what a rank uploads in d_loss's slot, with its
        targets, for `loss_weight` to add up."""
        return np.array([n], np.int32).view(np.float32)[0]

    def loss_weight(self, d_loss) -> None:
        """d_loss = 1/(valid targets of every rank), on the device and in place: d_loss ((1,) fp32)
        holds this rank's count as int32 bits (`count_bits`); one all-reduce adds the counts, then
        `loss_weight_from_count` writes the weight as the one-process path does on the host, and
        keeps the total for the host (`loss_sum` reads it into `count`). No host wait, so it runs
        inside a captured backward, where each replay sees the count of its own batch."""
        count = d_loss.view(INT32)
        self.comm.all_reduce(count)
        loss_weight.loss_weight_from_count(d_loss, self._count, count)

    # ---- the optimizer step ------------------------------------------------------------------------
    def _grad_piece(self, p):
        if self.stage == 2:
            return self.grad_shard.rows(p.shard_offset, p.shard_offset + p.numel)
        return self.grads[p.name].flat().rows(p.lo, p.hi)

    def _piece_table(self, table_bytes, pieces, weights=None, seed: int = 0):
        """The `adamw.MultiTensorTable` of `pieces` (None for none) in `table_bytes`: their gradients
        alone (the norm's), or with `weights` each piece as `adamw_update` would take it alone, with
        its parameter's seed and its first element's draw index (host→device copy: not in a capture)."""
        if not pieces:
            return None
        grads = [self._grad_piece(p) for p in pieces]
        if weights is None:
            return adamw.MultiTensorTable(table_bytes, grads)
        ms, vs = ([t.rows(p.shard_offset, p.shard_offset + p.numel) for p in pieces] for t in (self.m, self.v))
        return adamw.MultiTensorTable(table_bytes, grads, [weights[p.name].flat().rows(p.lo, p.hi) for p in pieces],
                                      ms, vs, [p.decays for p in pieces],
                                      [(seed + 7919 * self._index[p.name]) & 0x7FFFFFFF for p in pieces],
                                      [p.lo for p in pieces])  # fmt: skip

    def _adamw_table(self, weights: dict, seed: int):
        """The AdamW table of this rank's pieces (None for none), built when `weights` (their
        addresses) or `seed` differ from the last call's, so a table never points at moved memory."""
        key = (seed, tuple(weights[p.name].ptr for p in self._pieces))
        if key != self._table_key:
            self._table = self._piece_table(self._table_bytes, self._pieces, weights, seed)
            self._table_key = key
        return self._table

    def global_norm(self, opt_state, max_norm: float) -> None:
        """opt_state.norm_result = [‖g‖, clip scale] of the whole (summed) gradient, the same on
        every rank: squares of this rank's pieces (one multi-tensor launch + its fold, bitwise a
        `norm.global_norm_squared` per piece in plan order), all-reduced partials, then the finish."""
        partials = opt_state.norm_partials
        if self._norm_table is None:
            partials.fill_zero()
        else:
            adamw.global_norm_squared_multi(partials, self._norm_sums, self._norm_table)
        self.comm.all_reduce(partials)
        norm.global_norm_finish(opt_state.norm_result, partials, float(max_norm))

    def update(self, weights: dict, opt_state, seed: int) -> None:
        """AdamW (after `global_norm`).

        Stage 0 updates every parameter with `opt_state`'s full moments, as one process would.
        Stages 1 and 2 update this rank's pieces with the shard moments; a piece keeps the seed
        of its parameter and its element indices, so bf16 rounds stochastically as in stage 0.
        They do it in one multi-tensor launch (the first call builds its table, so make it
        outside a graph capture, as LlamaModel's warm-up step does). The all-gathers of the
        updated weights are left to `start_gather`, which the caller must run before anything
        but `encode` reads them."""
        if self.stage == 0:
            opt_state.update(weights, self.grads, seed)
            return
        table = self._adamw_table(weights, seed)
        if table is not None:
            adamw.adamw_update_multi(table, opt_state.hparams, opt_state.norm_result.rows(1, 2))

    def encode(self, encoded, inputs, wte, stack) -> None:
        """encoded (B, T, C) = wte[inputs] (B, T) while wte's all-gather is due: each rank holds its
        own shard of the updated table, stale rows elsewhere. Every rank's tokens are all-gathered,
        looked up in the part of the table this rank owns (zeros elsewhere), and a reduce-scatter
        adds the lookups up, handing each rank its own rows: exactly the updated table's (x + 0).
        The lookups are a temporary of `stack` (`lookups` gives its dtype and shape): the main
        stream waits for the reduce-scatter before anything after it, so the next temporary there
        may reuse the bytes. Call it before `start_gather`, so that these small collectives go first."""
        comm = self.comm
        comm.wait_for()
        comm.all_gather(self._tokens_all, inputs.reshape(-1), stream=comm.stream)
        comm.record(self._tokens_event)
        comm.wait(self._tokens_event)
        with stack.temporary(*self.lookups, "encode_lookups") as lookups:
            encoder.encoder_forward(lookups, self._tokens_all, wte, owned=self._owned)
            comm.wait_for()
            comm.reduce_scatter(encoded.reshape(-1), lookups.reshape(-1), stream=comm.stream)
            comm.record(self._encoded_event)
            comm.wait(self._encoded_event)

    def _gather(self, b, weight_buckets) -> None:
        buf = weight_buckets[b.name]
        self.comm.all_gather(buf, buf.rows(self.rank * b.shard, (self.rank + 1) * b.shard), stream=self.comm.stream)

    def start_gather(self, weight_buckets: dict) -> None:
        """Enqueue the all-gather of every `late` bucket (layers in order, the head, then the
        embedding) on the communication stream, after the main stream's work so far (the update),
        each followed by its event; `wait_gathered(name)` orders the main stream after one of
        them. `weight_buckets` maps each bucket name to its flat weight buffer (the plan's
        layout), which the gathers fill in place. The caller joins the communication stream
        (`comm.join()`) before its graph or step ends."""
        self.comm.wait_for()
        for b in self.late:
            self._gather(b, weight_buckets)
            self.comm.record(self._gathered[b.name])

    def wait_gathered(self, name: str) -> None:
        """Later work on the main stream waits for bucket `name`'s all-gather (`start_gather`)."""
        self.comm.wait(self._gathered[name])

    # ---- checkpoints -------------------------------------------------------------------------------
    def gather_moments(self) -> dict[str, np.ndarray] | None:
        """{"m.<name>": array, "v.<name>": array}: the full moments, as a one-process checkpoint
        holds them, on rank 0 (None on the others). A collective, bucket by bucket through one
        temporary device buffer of the largest bucket (this runs between steps, not inside one)."""
        if self.stage == 0:
            raise ValueError("gather_moments: with zero_stage 0 the moments are not sharded")
        from ..tensor import Tensor

        plan, out = self.plan, {}
        for key, t in (("m", self.m), ("v", self.v)):
            tmp = Tensor.empty(t.dtype, (max(b.size for b in plan.buckets),), self.device, name=f"{key}.gather")
            flat = np.zeros(plan.total, t.dtype.np) if self.rank == 0 else None
            for b in plan.buckets:
                self.comm.all_gather(tmp.rows(0, b.size), t.rows(b.shard_offset, b.shard_offset + b.shard))
                if flat is not None:
                    for r in range(plan.world_size):  # chunk r of the bucket is rank r's
                        flat[b.start + r * b.shard : b.start + (r + 1) * b.shard] = tmp.rows(
                            r * b.shard, (r + 1) * b.shard
                        ).numpy()
            if flat is not None:
                out.update({f"{key}.{n}": np.ascontiguousarray(a) for n, a in plan.unflatten(flat).items()})
        return out if self.rank == 0 else None

    def moment_shapes(self) -> dict[str, tuple]:
        """{"m.<name>": (shape, NumPy dtype), "v.<name>": ...}: the full moments a checkpoint holds,
        which `load_moments` reads whole before taking this rank's shard."""
        out = {}
        for key, t in (("m", self.m), ("v", self.v)):
            out.update({f"{key}.{n}": (s.shape, t.dtype.np) for n, s in self.plan.params.items()})
        return out

    def load_moments(self, moments: dict[str, np.ndarray]) -> None:
        """Take this rank's shard of full moments {"m.<name>": ..., "v.<name>": ...}."""
        for key, t in (("m", self.m), ("v", self.v)):
            full = {n: moments[f"{key}.{n}"] for n in self.plan.params}
            shard = np.zeros(self.plan.shard_size, t.dtype.np)
            for p in self._pieces:
                shard[p.shard_offset : p.shard_offset + p.numel] = full[p.name].reshape(-1)[p.lo : p.hi]
            t.copy_from_numpy(shard)


def bucket_views(plan: ShardPlan, buffers: dict) -> dict:
    """{param name: view of its shape} into per-bucket flat buffers {bucket name: (bucket.size,) Tensor}."""
    views = {}
    for b in plan.buckets:
        for p in b.params:
            lo = p.offset - b.start
            views[p.name] = buffers[b.name].rows(lo, lo + p.numel).reshape(p.shape)
    return views


def flat_buckets(plan: ShardPlan, flat) -> dict:
    """{bucket name: view} of a (plan.total,) Tensor laid out by the plan."""
    return {b.name: flat.rows(b.start, b.stop) for b in plan.buckets}


def _check_same_layout(layers) -> None:
    first = [(p.shape, p.offset - layers[0].start) for p in layers[0].params]
    for b in layers[1:]:
        if [(p.shape, p.offset - b.start) for p in b.params] != first:
            raise ValueError(
                f"DataParallel: bucket {b.name} is laid out unlike layers.0; zero_stage 2 needs equal layers"
            )
