"""Worker functions for tests/test_dist.py: module-level, so `ce.dist.launch` can spawn them."""

from __future__ import annotations

import os
import time

import numpy as np

import cuengine as ce

COLLECTIVE_DTYPES = ("fp32", "bf16")


def rank_input(seed: int, rank: int, n: int, dtype: str) -> np.ndarray:
    """The array rank `rank` contributes (rounded to `dtype`); the parent recomputes it."""
    x = np.random.default_rng([seed, rank]).standard_normal(n).astype(np.float32)
    return x.astype(ce.dtype(dtype).np)


def collectives(seed: int, n: int) -> dict:
    """Every collective once per dtype on this rank's comm; returns the results as NumPy arrays."""
    comm = ce.dist.init()
    r, world, dev = comm.rank, comm.world_size, comm.device
    out = {}
    for dt in COLLECTIVE_DTYPES:
        t = ce.Tensor.from_numpy(rank_input(seed, r, world * n, dt), dev, dtype=dt)
        comm.all_reduce(t)
        out[f"all_reduce.{dt}"] = t.numpy()
        t = ce.Tensor.from_numpy(rank_input(seed, r, world * n, dt), dev, dtype=dt)
        comm.all_reduce(t, op="max")
        out[f"all_reduce_max.{dt}"] = t.numpy()
        # reduce-scatter into a separate output, and in place into this rank's chunk of the input,
        # on the communication stream ordered by events
        inp = ce.Tensor.from_numpy(rank_input(seed, r, world * n, dt), dev, dtype=dt)
        part = ce.Tensor.empty(dt, (n,), dev)
        comm.wait_for()
        comm.reduce_scatter(part, inp, stream=comm.stream)
        comm.reduce_scatter(inp.rows(r * n, (r + 1) * n), inp, stream=comm.stream)
        comm.join()
        out[f"reduce_scatter.{dt}"] = part.numpy()
        out[f"reduce_scatter_inplace.{dt}"] = inp.rows(r * n, (r + 1) * n).numpy()
        mine = ce.Tensor.from_numpy(rank_input(seed, r, n, dt), dev, dtype=dt)
        full = ce.Tensor.empty(dt, (world * n,), dev)
        comm.all_gather(full, mine)
        out[f"all_gather.{dt}"] = full.numpy()
        full2 = ce.Tensor.empty(dt, (world * n,), dev)
        full2.rows(r * n, (r + 1) * n).copy_from_numpy(rank_input(seed, r, n, dt))
        comm.all_gather(full2, full2.rows(r * n, (r + 1) * n))
        out[f"all_gather_inplace.{dt}"] = full2.numpy()
        t = ce.Tensor.from_numpy(rank_input(seed, r, n, dt), dev, dtype=dt)
        comm.broadcast(t, root=world - 1)
        out[f"broadcast.{dt}"] = t.numpy()
    q = ce.Tensor.from_numpy(rank_input(seed, r, n, "fp32"), dev, dtype="e4m3")
    q8 = ce.Tensor.empty("e4m3", (world * n,), dev)
    comm.all_gather(q8, q)
    out["all_gather.e4m3"] = q8.numpy()
    out["object"] = comm.broadcast_object({"step": 7, "rank": r} if r == 0 else None)
    comm.barrier()
    comm.close()
    return out


def environment() -> dict:
    comm = ce.dist.init()
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NCCL_NVLS_ENABLE", "NCCL_MIN_NCHANNELS")
    env = {k: os.environ.get(k) for k in keys}
    env["comm"] = (comm.rank, comm.world_size, comm.local_rank, comm.backend)
    if comm.device.is_cuda:  # the communication stream's priority beside the main stream's and the most urgent
        from cuda.bindings import driver

        env["priorities"] = (comm.stream.raw.priority, comm.device.stream.raw.priority,
                             driver.cuCtxGetStreamPriorityRange()[2])  # fmt: skip
    comm.close()
    return env


def fail(victim: int, how: str) -> str:
    """Rank `victim` raises or dies (`how`: "raise", "exit", "kill") before its first all-reduce;
    the others wait in that all-reduce and report what they see."""
    comm = ce.dist.init()
    t = ce.Tensor.from_numpy(np.ones(4, np.float32), comm.device)
    comm.barrier()
    if comm.rank == victim:
        time.sleep(0.2)  # let the others enter the all-reduce first
        if how == "raise":
            raise RuntimeError("worker failed on purpose")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), 9)
    comm.all_reduce(t)
    t.numpy()  # waits for the all-reduce (on NCCL it is only enqueued)
    return "finished"


def hang(victim: int) -> str:
    """Rank `victim` dies while the others compute forever without a collective (as ranks stuck
    inside NCCL would): only the launcher can stop them."""
    comm = ce.dist.init()
    comm.barrier()
    if comm.rank == victim:
        os._exit(5)
    while True:
        time.sleep(0.1)


def stuck() -> None:
    """Every rank waits forever after a barrier, as ranks whose NCCL collective never completes
    wait on the device: only the launcher's deadline ends them."""
    comm = ce.dist.init()
    comm.barrier()
    while True:
        time.sleep(0.1)


def mismatch() -> None:
    """Rank 0 all-reduces while the others all-gather: every rank must get a clear error."""
    comm = ce.dist.init()
    x = ce.Tensor.from_numpy(np.ones(4, np.float32), comm.device)
    if comm.rank == 0:
        comm.all_reduce(x)
    else:
        comm.all_gather(ce.Tensor.empty("fp32", (4 * comm.world_size,), comm.device), x)


def rank_grads(specs, rank: int, step: int) -> dict:
    """The gradients rank `rank` 'computes' at `step` (the parent sums them for its reference)."""
    rng = np.random.default_rng([11, rank, step])
    return {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s, _ in specs}


def init_params(specs) -> dict:
    rng = np.random.default_rng(3)
    return {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s, _ in specs}


def dp_steps(preset: str, stage: int, steps: int) -> dict:
    """DataParallel without a model: each step every rank writes its gradients bucket by bucket in
    backward order, then the norm and the update run; returns the weights and the loss sums."""
    from cuengine.alloc import DeviceMemoryStack
    from cuengine.dist.plan import ShardPlan
    from cuengine.dist.zero import DataParallel, bucket_views, flat_buckets
    from cuengine.model.config import TransformerConfig
    from cuengine.model.optimizer import AdamWState
    from cuengine.model.weights import param_specs

    comm = ce.dist.init()
    specs = param_specs(TransformerConfig.preset(preset))
    alloc = ce.TensorAllocator(comm.device)
    dp = DataParallel(comm, stage, ShardPlan(specs, comm.world_size), "fp32", alloc, tokens=6)
    wflat = alloc.allocate("fp32", "weights", (dp.plan.total,)).fill_zero()
    buckets = flat_buckets(dp.plan, wflat)
    weights = bucket_views(dp.plan, buckets)
    for n, a in init_params(specs).items():
        weights[n].copy_from_numpy(a)
    opt = AdamWState(specs if stage == 0 else [], alloc)
    order = ["head"] + [f"layers.{i}" for i in reversed(range(len(dp.plan.buckets) - 2))] + ["embedding"]
    losses = ce.Tensor.empty("fp32", (6,), comm.device)
    d_loss = ce.Tensor.empty("fp32", (1,), comm.device)
    sums, counts, loss_weights, exact = [], [], [], []
    V, C = weights["wte"].shape
    edge = dp.plan.bucket("embedding").shard // C  # the row rank 0's shard ends in (or the first of rank 1's)
    tokens, encoded = ce.Tensor.empty("int32", (1, 6), comm.device), ce.Tensor.empty("fp32", (1, 6, C), comm.device)
    stack = DeviceMemoryStack(ce.Tensor.empty(*dp.lookups, comm.device)) if stage else None  # exactly the lookups
    for step in range(steps):
        g = rank_grads(specs, comm.rank, step)
        d_loss.copy_from_numpy(np.array([dp.count_bits(comm.rank + 1 + step)]))  # this rank's valid targets
        dp.begin_backward(0, 1, d_loss)
        for b in order:
            if b.startswith("layers."):
                dp.before_layer(int(b.split(".")[1]))
            for p in dp.plan.bucket(b).params:
                dp.grads[p.name].copy_from_numpy(g[p.name])
            dp.bucket_done(b)
        losses.copy_from_numpy(np.arange(6, dtype=np.float32) + 10 * comm.rank + step)
        dp.end_backward(losses)
        sums.append(dp.loss_sum())
        counts.append(dp.count)
        loss_weights.append(d_loss.numpy()[0])
        opt.set_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, step + 1)
        dp.global_norm(opt, 1.0)
        dp.update(weights, opt, seed=42)
        if stage > 0:  # what the model's next forward does: the encoder's lookup from the shards, then the gathers
            tokens.copy_from_numpy(
                np.array([[0, V - 1, edge, edge - 1, edge + 1, (step * 7 + comm.rank) % V]], np.int32)
            )
            dp.encode(encoded, tokens, weights["wte"], stack)
        dp.start_gather(buckets)
        comm.join()
        if stage > 0:  # the lookup's bits are the gathered table's
            exact.append(bool(np.array_equal(encoded.numpy(), weights["wte"].numpy()[tokens.numpy()])))
    out = {n: t.numpy() for n, t in weights.items()}
    out["loss_sums"], out["counts"], out["loss_weights"], out["encode_exact"] = sums, counts, loss_weights, exact
    out["norm"] = opt.norm_result.numpy()
    if stage > 0:
        out["moments"] = dp.gather_moments()
        out["moment_shapes"] = dp.moment_shapes()
    comm.close()
    return out


MODEL_T = 16


def global_batch(cfg, step: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([7, step])
    x = rng.integers(0, cfg.vocab_size, (rows, MODEL_T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (rows, MODEL_T)).astype(np.int32)
    y[0, 3] = -1  # an ignored position
    return x, y


def train_model(cfg_changes: dict, opts: dict, B: int, steps, accum: int = 1, save_at=None, save_to=None,
                load=None, device="cpu") -> dict:  # fmt: skip
    """Train `steps` (a range of step numbers) on rank `comm.rank`'s rows of each global batch
    (world_size * B * accum rows), with ce.dist.init()'s communicator; optionally load a checkpoint
    first and save one after step `save_at`. Returns the losses and the final weights."""
    from cuengine.model.config import TransformerConfig

    comm = ce.dist.init(device=device)
    cfg = TransformerConfig.preset(cfg_changes.get("preset", "tiny")).replace(
        **{k: v for k, v in cfg_changes.items() if k != "preset"}
    )
    dev = comm.device if comm.world_size > 1 else ce.device(device)
    model = ce.LlamaModel(cfg, ce.TrainOptions(**opts), device=dev, comm=comm)
    model.init_weights(seed=1)
    model.allocate_run_state(B, MODEL_T)
    extra = model.load_checkpoint(load) if load else None
    world, r = comm.world_size, comm.rank
    losses = []
    for step in steps:
        x, y = global_batch(cfg, step, world * B * accum)
        if accum == 1:
            losses.append(model.train_step(x[r * B : (r + 1) * B], y[r * B : (r + 1) * B], lr=1e-2))
        else:  # as Trainer does: this rank's valid targets of all micro-batches
            parts = [slice((k * world + r) * B, (k * world + r + 1) * B) for k in range(accum)]
            n = sum(int(np.count_nonzero(y[rows] != -1)) for rows in parts)
            for k, rows in enumerate(parts):
                model.forward(x[rows])
                model.backward(x[rows], y[rows], micro_step=k, grad_accum_steps=accum, valid_tokens=n)
            losses.append(model.finish_step(1e-2, n))
        if step == save_at:
            model.save_checkpoint(save_to, extra={"step": step})
    model.sync_weights()  # ZeRO >= 1: the last update's gather is otherwise left to a next forward
    out = {"losses": losses, "extra": extra, "weights": {n: t.numpy() for n, t in model.weights.tensors.items()}}
    history = model.rs.fp8_history
    out["fp8_history"] = None if history is None else history.numpy()
    captured = len(model._graphs)
    comm.close()  # with the model alive: NCCL destroys a communicator only after the graphs of its collectives
    out["graphs"] = (captured, len(model._graphs))
    return out


def model_grads(cfg_changes: dict, B: int, device="cpu") -> dict:
    """The gradients after one backward with zero_stage 0 (all-reduced: the whole batch's)."""
    from cuengine.model.config import TransformerConfig

    comm = ce.dist.init(device=device)
    cfg = TransformerConfig.preset(cfg_changes["preset"]).replace(dtype=cfg_changes["dtype"])
    dev = comm.device if comm.world_size > 1 else ce.device(device)
    model = ce.LlamaModel(cfg, ce.TrainOptions(), device=dev, comm=comm)
    model.init_weights(seed=1)
    model.allocate_run_state(B, MODEL_T)
    x, y = global_batch(cfg, 0, comm.world_size * B)
    rows = slice(comm.rank * B, (comm.rank + 1) * B)
    model.forward(x[rows])
    model.backward(x[rows], y[rows])
    out = {n: t.numpy() for n, t in model.gradients().items()}
    comm.close()
    return out


def stepped_tiny(stage: int, dtype: str):
    """(comm, cfg, model, x, y, rows): this rank's tiny model with `zero_stage` stage after one train
    step (its graphs and tables built), and the rows of the global batch it trains on."""
    from cuengine.model.config import TransformerConfig

    comm = ce.dist.init()
    cfg = TransformerConfig.preset("tiny").replace(dtype=dtype)
    model = ce.LlamaModel(cfg, ce.TrainOptions(zero_stage=stage), device=comm.device, comm=comm)
    model.init_weights(seed=1)
    model.allocate_run_state(1, MODEL_T)
    x, y = global_batch(cfg, 0, comm.world_size)
    rows = slice(comm.rank, comm.rank + 1)
    model.train_step(x[rows], y[rows], lr=1e-2)
    return comm, cfg, model, x, y, rows


def refused_save(path: str) -> str:
    """This rank's error from save_checkpoint(path) where path is not a checkpoint; each rank must get it."""
    comm, cfg, model, x, y, rows = stepped_tiny(1, "fp32")
    try:
        model.save_checkpoint(path)
    except ValueError as err:
        return str(err)
    finally:
        comm.close()
    return "saved"


def logging_wrapper(log: list):
    """wrap(obj, name, entry): obj.name still runs, after appending entry(*its arguments) to log."""

    def wrap(obj, name, entry):
        inner = getattr(obj, name)

        def call(*a, **k):
            log.append(entry(*a, **k))
            return inner(*a, **k)

        setattr(obj, name, call)

    return wrap


def gather_order(stage: int) -> dict:
    """Two train steps of a model with `zero_stage` stage; the second one's all-gathers, waits for
    them and block forwards are logged, with the phase (forward / update) each came in."""

    comm, cfg, model, x, y, rows = stepped_tiny(stage, "fp32")
    log, phase = [], ["-"]
    wrap = logging_wrapper(log)

    wrap(comm, "all_gather", lambda out, inp, stream=None: (phase[0], "gather", out.nelem, stream is comm.stream))
    wrap(model._blocks, "forward", lambda i, r: (phase[0], "block", i))
    if model._dp is not None:
        wrap(model._dp, "wait_gathered", lambda name: (phase[0], "wait", name))
    for name in ("forward", "_adamw"):
        inner = getattr(model, name)
        setattr(model, name, lambda *a, _inner=inner, _name=name, **k: (phase.__setitem__(0, _name), _inner(*a, **k)))
    model.train_step(x[rows], y[rows], lr=1e-2)
    step_log, due = list(log), model._gather_due
    try:
        model.parameters()
        refused = None
    except ValueError as err:
        refused = str(err)
    model.sync_weights()
    out = {"log": step_log, "due": due, "refused": refused, "due_after_sync": model._gather_due,
           "weights": {n: t.numpy() for n, t in model.parameters().items()}, "L": cfg.num_layers, "T": x.shape[1],
           "embedding_size": model._plan.bucket("embedding").size}  # fmt: skip
    comm.close()
    return out


def trainer_agreement(steps: int, stop_rank: int, stop_at: int, clock_rank: int, save_seconds: float,
                      ckdir: str) -> dict:  # fmt: skip
    """A Trainer on a tiny model over ranks: rank `stop_rank` asks for a stop in its hook after step
    `stop_at` (-1: never); rank `clock_rank`'s clock runs 100 s per reading (the others' stand
    still). Returns where the run stopped, the steps it saved at and the host-waiting collectives
    it called."""
    import types

    import cuengine.train as train_mod
    from cuengine.data import TokenSource
    from cuengine.model.config import TransformerConfig

    comm = ce.dist.init()
    r = comm.rank
    ticks = [0.0]

    def monotonic():
        ticks[0] += 100.0 if r == clock_rank else 0.0
        return ticks[0]

    train_mod.time = types.SimpleNamespace(monotonic=monotonic, perf_counter=time.perf_counter)
    calls = {"broadcast_object": 0, "barrier": 0}
    for name in calls:
        inner = getattr(comm, name)

        def counted(*a, _inner=inner, _name=name, **k):
            calls[_name] += 1
            return _inner(*a, **k)

        setattr(comm, name, counted)
    cfg = TransformerConfig.preset("tiny").replace(dtype="fp32")
    model = ce.LlamaModel(cfg, ce.TrainOptions(zero_stage=1), device=comm.device, comm=comm)
    model.init_weights(seed=1)
    model.allocate_run_state(1, MODEL_T)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, 4096).astype(np.int32)
    trainer = train_mod.Trainer(model, TokenSource([tokens], "random"), batch_size=1, seq_len=MODEL_T, steps=steps,
                                lr=1e-3, checkpoint_dir=ckdir, save_seconds=save_seconds)  # fmt: skip
    saves = []
    save = trainer.save
    trainer.save = lambda: (saves.append(trainer.step), save())

    def hook(rec):
        if r == stop_rank and rec["step"] == stop_at:
            trainer.request_stop()

    trainer.hooks = [hook]
    step = trainer.run()
    out = {"step": step, "saves": saves, "stop_requested": trainer.stop_requested, "calls": calls}
    comm.close()
    return out


def deferred_gathers() -> dict:
    """Two all-gathers on the communication stream with an event between them; what `out` holds
    before any wait, after waiting for the first, and after the join."""
    comm = ce.dist.init()
    out = ce.Tensor.from_numpy(np.full(4, -1, np.int32), comm.device)
    mine = ce.Tensor.from_numpy(np.array([comm.rank], np.int32), comm.device)
    one = ce.Tensor.from_numpy(np.array([1], np.int32), comm.device)
    ev = comm.device.event()
    comm.all_gather(out.rows(0, 2), mine, stream=comm.stream)
    comm.record(ev)
    comm.all_gather(out.rows(2, 4), one, stream=comm.stream)
    mine.array()[0] = 0  # a write after the enqueue: a collective that runs late reads it
    got = {"before": out.numpy().tolist()}
    comm.wait(ev)
    got["after_first"] = out.numpy().tolist()
    comm.join()
    got["after_join"] = out.numpy().tolist()
    comm.close()
    return got


def update_launches(stage: int) -> dict:
    """The second train step of a bf16 model with `zero_stage` stage: its multi-tensor launches (norm,
    AdamW: which table) and all-gathers in order, and whether every AdamW table entry is what one
    `adamw_update` of that piece would take (addresses, size, decay flag, seed, draw offset)."""
    from cuengine.kernels import adamw, norm

    comm, cfg, model, x, y, rows = stepped_tiny(stage, "bf16")
    log, dp = [], model._dp
    names = {}
    wrap = logging_wrapper(log)

    wrap(adamw, "adamw_update_multi", lambda table, *a, **k: ("adamw_multi", names.get(id(table), "opt_state")))
    wrap(adamw, "global_norm_squared_multi", lambda partials, sums, table, **k: ("norm_multi", names.get(id(table))))
    wrap(norm, "global_norm_squared", lambda *a, **k: ("norm_piece",))
    wrap(comm, "all_gather", lambda out, inp, stream=None: ("gather", out.nelem, stream is comm.stream))
    names[id(dp._norm_table)] = "pieces"
    names[id(dp._table)] = "shard"
    model.train_step(x[rows], y[rows], lr=1e-2)

    def key(t):
        return t.ptr, t.nelem, t.dtype.name

    want, got = [], []
    if dp._table is not None:
        for p in dp._pieces:
            i = dp._index[p.name]
            m, v = (s.rows(p.shard_offset, p.shard_offset + p.numel) for s in (dp.m, dp.v))
            want.append((key(model.weights[p.name].flat().rows(p.lo, p.hi)), key(dp._grad_piece(p)), key(m), key(v),
                         p.decays, (model.opts.seed + 7919 * i) & 0x7FFFFFFF, p.lo))  # fmt: skip
        got += [(key(p), key(g), key(m), key(v), bool(wd), int(seed), int(off))
                for p, g, m, v, wd, seed, off in dp._table.entries]  # fmt: skip
    out = {"log": log, "sizes": {b.name: b.size for b in dp.plan.buckets},
           "pieces": [p.name for p in dp._pieces], "entries_match": got == want, "entries": len(got),
           "norm_grads": [key(e[1]) for e in dp._norm_table.entries] == [key(dp._grad_piece(p)) for p in dp._pieces],
           }  # fmt: skip
    comm.close()
    return out
