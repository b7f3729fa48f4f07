"""cuengine.dist: the sharding plan, the NumPy test-double communicator across real processes,
launch() and its failure handling, sharded checkpoints N -> M, the data-sharding rule; and the
same collectives on NCCL (gpu marker, two GPUs)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close

import cuengine as ce
from cuengine import dist
from cuengine.model.config import TransformerConfig
from cuengine.model.weights import param_specs

sys.path.insert(0, str(Path(__file__).parent))
import dist_worker  # noqa: E402

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUENGINE_DIST_BACKEND",
            "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "NCCL_MIN_NCHANNELS")  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for k in ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def specs(preset="tiny", **changes):
    return param_specs(TransformerConfig.preset(preset).replace(**changes))


SPEC_CASES = {
    "qwen2-tied": dict(preset="tiny"),
    "llama-untied": dict(preset="tiny-llama"),
    "odd-sizes": dict(
        preset="tiny-llama", hidden_size=40, head_size=10, intermediate_size=72, vocab_size=251, num_layers=3
    ),
}


# ---- the plan --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", SPEC_CASES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_plan_owns_every_element_exactly_once(case, world):
    plan = dist.ShardPlan(specs(**SPEC_CASES[case]), world)
    count = {n: np.zeros(s.numel, np.int32) for n, s in plan.params.items()}
    shard_seen = [np.zeros(plan.shard_size, np.int32) for _ in range(world)]
    for r in range(world):
        for p in plan.pieces(r):
            count[p.name][p.lo : p.hi] += 1
            shard_seen[r][p.shard_offset : p.shard_offset + p.numel] += 1
    for name, c in count.items():
        assert c.min() == 1 and c.max() == 1, f"{name}: elements owned {c.min()}..{c.max()} times"
    assert all(s.max() <= 1 for s in shard_seen), "two pieces overlap in a shard buffer"
    assert sum(int(s.sum()) for s in shard_seen) == sum(s.numel for s in plan.params.values())


@pytest.mark.parametrize("case", SPEC_CASES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_plan_alignment_and_equal_shards(case, world):
    plan = dist.ShardPlan(specs(**SPEC_CASES[case]), world)
    assert plan.total == world * plan.shard_size
    for s in plan.params.values():
        assert s.offset % 16 == 0, s
    for b in plan.buckets:
        assert b.shard % 16 == 0 and b.size == world * b.shard
        assert b.shard_offset % 16 == 0
        for p in b.params:  # inside its bucket, no overlap
            assert b.start <= p.offset and p.offset + p.numel <= b.stop
    for r in range(world):
        for p in plan.pieces(r):
            assert p.shard_offset % 16 == 0 and (p.lo % 16 == 0 or p.lo == 0), p
    offs = sorted((s.offset, s.offset + s.numel) for s in plan.params.values())
    assert all(a[1] <= b[0] for a, b in zip(offs, offs[1:])), "parameters overlap in the flat buffer"


@pytest.mark.parametrize("case", SPEC_CASES)
def test_plan_buckets_are_embedding_layers_head(case):
    sp = specs(**SPEC_CASES[case])
    cfg = TransformerConfig.preset(SPEC_CASES[case]["preset"])
    plan = dist.ShardPlan(sp, 3)
    L = SPEC_CASES[case].get("num_layers", cfg.num_layers)
    assert [b.name for b in plan.buckets] == ["embedding"] + [f"layers.{i}" for i in range(L)] + ["head"]
    for name, _, _ in sp:
        b = plan.bucket_of(name)
        assert name in {p.name for p in b.params}
        if name.startswith("layers."):
            assert b.name == "layers." + name.split(".")[1]
    assert {p.name for p in plan.bucket("head").params} == ({"lnf_w"} if "lm_head" not in plan.params
                                                           else {"lnf_w", "lm_head"})  # fmt: skip
    # the buckets tile the flat buffer in order, and the shard buffer in the same order
    assert plan.buckets[0].start == 0 and plan.buckets[-1].stop == plan.total
    for a, b in zip(plan.buckets, plan.buckets[1:]):
        assert a.stop == b.start and a.shard_offset + a.shard == b.shard_offset
    # pieces of one bucket are the pieces of all, restricted to it
    allp = plan.pieces(1)
    for b in plan.buckets:
        assert plan.pieces(1, b.name) == [p for p in allp if plan.bucket_of(p.name) is b]


def test_plan_flatten_shard_unshard_roundtrip():
    plan = dist.ShardPlan(specs("tiny-llama", hidden_size=40, head_size=10, intermediate_size=72, vocab_size=251), 3)
    rng = np.random.default_rng(0)
    full = {n: rng.standard_normal(s.shape).astype(np.float32) for n, s in plan.params.items()}
    flat = plan.flatten(full)
    shards = [plan.shard(flat, r) for r in range(3)]
    for r, sh in enumerate(shards):
        assert sh.shape == (plan.shard_size,)
        for p in plan.pieces(r):
            np.testing.assert_array_equal(sh[p.shard_offset : p.shard_offset + p.numel],
                                          full[p.name].reshape(-1)[p.lo : p.hi])  # fmt: skip
    np.testing.assert_array_equal(plan.unshard(shards), flat)
    for n, a in plan.unflatten(flat).items():
        np.testing.assert_array_equal(a, full[n])
    pad = np.ones(plan.total, bool)
    for s in plan.params.values():
        pad[s.offset : s.offset + s.numel] = False
    assert not flat[pad].any(), "padding must be zero"


def test_plan_manifest_and_errors():
    plan = dist.ShardPlan(specs(), 2)
    assert dist.ShardPlan.from_manifest(plan.to_manifest()) == plan
    m = plan.to_manifest()
    m["offsets"]["wte"] = 8
    with pytest.raises(ValueError, match="saved layout differs"):
        dist.ShardPlan.from_manifest(m)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        dist.ShardPlan(specs(), 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        plan.pieces(2)
    with pytest.raises(ValueError, match="expected 2 shards"):
        plan.unshard([np.zeros(plan.shard_size, np.float32)])
    with pytest.raises(ValueError, match="'wte' has shape"):
        plan.flatten({n: np.zeros((1,), np.float32) for n in plan.params})


# ---- init and the world of one ---------------------------------------------------------------
def test_init_keeps_the_users_nccl_settings(clean_env):
    clean_env.setenv("NCCL_MIN_NCHANNELS", "4")
    dist.init(device="cpu").close()
    assert os.environ["NCCL_MIN_NCHANNELS"] == "4"


def test_init_without_environment_is_a_world_of_one(clean_env):
    comm = dist.init(device="cpu")
    assert isinstance(comm, dist.SoloComm)
    assert (comm.rank, comm.world_size, comm.local_rank) == (0, 1, 0)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NCCL_MIN_NCHANNELS"] == "24"
    x = ce.Tensor.from_numpy(np.arange(8, dtype=np.float32), "cpu")
    comm.all_reduce(x)
    np.testing.assert_array_equal(x.numpy(), np.arange(8))
    out = ce.Tensor.empty("fp32", (8,), "cpu")
    comm.reduce_scatter(out, x)
    np.testing.assert_array_equal(out.numpy(), np.arange(8))
    comm.all_gather(out, x)
    np.testing.assert_array_equal(out.numpy(), np.arange(8))
    assert comm.broadcast_object({"a": 1}) == {"a": 1}
    comm.barrier()
    clean_env.setenv("WORLD_SIZE", "1")
    clean_env.setenv("RANK", "0")
    assert isinstance(dist.init(device="cpu"), dist.SoloComm)


def test_init_environment_errors(clean_env):
    clean_env.setenv("RANK", "1")
    with pytest.raises(dist.DistError, match="WORLD_SIZE is unset"):
        dist.init()
    clean_env.setenv("WORLD_SIZE", "two")
    with pytest.raises(dist.DistError, match="WORLD_SIZE='two' is not an integer"):
        dist.init()
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("RANK", "2")
    with pytest.raises(dist.DistError, match="not a valid place"):
        dist.init()
    clean_env.setenv("RANK", "1")
    with pytest.raises(dist.DistError, match="MASTER_ADDR is unset"):
        dist.init(backend="fake")
    with pytest.raises(ValueError, match="backend must be 'nccl' or 'fake'"):
        dist.init(backend="gloo")


def test_collective_argument_errors(clean_env):
    comm = dist.init(device="cpu")
    x = ce.Tensor.from_numpy(np.zeros(8, np.float32), "cpu", name="x")
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(x, op="prod")
    with pytest.raises(ValueError, match=r"all_reduce: tensor: expected dtype .* got tensor 'q' e4m3"):
        comm.all_reduce(ce.Tensor.empty("e4m3", (8,), "cpu", name="q"))
    with pytest.raises(ValueError, match=r"'x' \(8,\) has 8 elements, expected world_size 1 x 4"):
        comm.reduce_scatter(ce.Tensor.empty("fp32", (4,), "cpu", name="o"), x)
    with pytest.raises(ValueError, match="'o' is bf16 but 'x' is fp32"):
        comm.all_gather(x, ce.Tensor.empty("bf16", (8,), "cpu", name="o"))
    with pytest.raises(ValueError, match="root 1 outside"):
        comm.broadcast_object(1, root=1)


def test_rendezvous_timeout_names_the_address(clean_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        clean_env.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(dist.DistError, match=f"rank 1 could not reach rank 0 at 127.0.0.1:{port} within 1 s"):
        dist.init(backend="fake", timeout=1.0)
    assert time.monotonic() - t0 < 5


def test_rendezvous_rank0_waits_for_missing_ranks(clean_env):
    for k, v in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port())).items():
        clean_env.setenv(k, v)
    t0 = time.monotonic()
    with pytest.raises(dist.DistError, match=r"rank 0 waited 1 s for ranks \[1, 2\] of 3 to connect"):
        dist.init(backend="fake", timeout=1.0)
    assert time.monotonic() - t0 < 5


def _port():
    return dist.rendezvous.free_port()


def test_init_under_mpi_reads_mpi4py(clean_env):
    class FakeMPIComm:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

        def Get_rank(self):
            return self.rank

        def Get_size(self):
            return self.size

        def Split_type(self, kind):
            return FakeMPIComm(0, self.size)

    class FakeMPI:
        COMM_TYPE_SHARED = 1
        COMM_WORLD = FakeMPIComm(0, 1)

    mod = type(sys)("mpi4py")
    mod.MPI = FakeMPI
    clean_env.setitem(sys.modules, "mpi4py", mod)
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert isinstance(dist.init(device="cpu"), dist.SoloComm)
    FakeMPI.COMM_WORLD = FakeMPIComm(1, 2)
    with pytest.raises(dist.DistError, match="not MPI"):
        dist.init(backend="fake")


# ---- the test double across processes, and launch() -------------------------------------------
def expected_collectives(seed, n, world):
    exp = {}
    for dt in dist_worker.COLLECTIVE_DTYPES:
        npdt = ce.dtype(dt).np
        ins = [dist_worker.rank_input(seed, r, world * n, dt).astype(np.float64) for r in range(world)]
        total = np.sum(ins, axis=0)
        exp[f"all_reduce.{dt}"] = [total] * world
        exp[f"all_reduce_max.{dt}"] = [np.max(ins, axis=0)] * world
        exp[f"reduce_scatter.{dt}"] = [total[r * n : (r + 1) * n] for r in range(world)]
        exp[f"reduce_scatter_inplace.{dt}"] = exp[f"reduce_scatter.{dt}"]
        gathered = np.concatenate([dist_worker.rank_input(seed, r, n, dt) for r in range(world)]).astype(npdt)
        exp[f"all_gather.{dt}"] = [gathered] * world
        exp[f"all_gather_inplace.{dt}"] = [gathered] * world
        exp[f"broadcast.{dt}"] = [dist_worker.rank_input(seed, world - 1, n, dt)] * world
    q = [ce.Tensor.from_numpy(dist_worker.rank_input(seed, r, n, "fp32"), "cpu", dtype="e4m3").numpy()
         for r in range(world)]  # fmt: skip
    exp["all_gather.e4m3"] = [np.concatenate(q)] * world
    return exp


def check_collectives(results, seed, n, world):
    exp = expected_collectives(seed, n, world)
    assert len(results) == world
    for r, got in enumerate(results):
        assert got["object"] == {"step": 7, "rank": 0}
        for key, want in exp.items():
            dt = key.split(".")[1]
            if dt == "e4m3":
                np.testing.assert_array_equal(got[key].view(np.uint8), want[r].view(np.uint8), err_msg=key)
            else:
                assert_close(got[key], want[r], dt, what=f"rank {r} {key}")


@pytest.mark.parametrize("world", [2, 3])
def test_fake_collectives_match_numpy(world):
    results = dist.launch(dist_worker.collectives, world, 5, 37, backend="fake", timeout=60)
    check_collectives(results, 5, 37, world)


def test_fake_collectives_round_bf16_once():
    """The double's bf16 sum: fp32 in rank order, one rounding (not NCCL's rounding)."""
    results = dist.launch(dist_worker.collectives, 3, 1, 64, backend="fake", timeout=60)
    ins = [dist_worker.rank_input(1, r, 3 * 64, "bf16").astype(np.float32) for r in range(3)]
    want = ((ins[0] + ins[1]) + ins[2]).astype(ce.dtype("bf16").np)
    np.testing.assert_array_equal(results[2]["all_reduce.bf16"].view(np.uint16), want.view(np.uint16))


def test_launch_sets_the_environment_and_returns_per_rank_results():
    envs = dist.launch(dist_worker.environment, 3, backend="fake", timeout=60)
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1
    for r, e in enumerate(envs):
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"]) == (str(r), "3", str(r))
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["NCCL_NVLS_ENABLE"] == "0" and e["NCCL_MIN_NCHANNELS"] == "24"
        assert e["comm"] == (r, 3, r, "fake")


def test_launch_argument_errors():
    with pytest.raises(ValueError, match="nprocs must be an int >= 1"):
        dist.launch(dist_worker.environment, 0)


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_a_failing_worker_stops_the_others_with_a_clear_error(how):
    t0 = time.monotonic()
    with pytest.raises(dist.WorkerError) as info:
        dist.launch(dist_worker.fail, 3, 1, how, backend="fake", timeout=60, grace=20)
    elapsed = time.monotonic() - t0
    err = info.value
    first = {"raise": "rank 1 raised RuntimeError: worker failed on purpose",
             "exit": "rank 1 died (exit code 3) without a result",
             "kill": "rank 1 died (killed by SIGKILL) without a result"}[how]  # fmt: skip
    assert str(err).startswith("launch: " + first), str(err)
    if how == "raise":
        assert "Traceback" in str(err) and "worker failed on purpose" in str(err)
    # the others noticed through the communicator and exited on their own, well within the grace
    for r in (0, 2):
        assert "DistError" in err.failures[r] and "rank 1 disconnected" in err.failures[r], err.failures[r]
    assert elapsed < 20, f"took {elapsed:.1f} s"


def test_launcher_stops_workers_that_cannot_notice():
    t0 = time.monotonic()
    with pytest.raises(dist.WorkerError, match="rank 1 died \\(exit code 5\\)") as info:
        dist.launch(dist_worker.hang, 3, 1, backend="fake", timeout=60, grace=1.0)
    assert time.monotonic() - t0 < 20
    assert info.value.failures[0] == info.value.failures[2] == "was stopped by the launcher 1 s after the first failure"


def test_launch_deadline_stops_stuck_workers_and_shows_where_they_wait():
    """Ranks that wait forever (as in an NCCL collective some rank never joins) fail at the
    deadline, with each one's Python stack, instead of hanging the caller."""
    t0 = time.monotonic()
    with pytest.raises(dist.WorkerError, match=r"ranks \[0, 1\] were stopped at the deadline, 8 s") as info:
        dist.launch(dist_worker.stuck, 2, backend="fake", timeout=60, deadline=8)
    assert 8 <= time.monotonic() - t0 < 30
    assert info.value.failures == {0: "was still running", 1: "was still running"}
    for r in (0, 1):
        stack = str(info.value).split(f"--- rank {r} Python stack (most recent call first) ---\n")[1]
        assert "dist_worker.py" in stack and "in stuck" in stack, stack


def test_mismatched_collectives_raise_on_every_rank():
    with pytest.raises(dist.WorkerError) as info:
        dist.launch(dist_worker.mismatch, 2, backend="fake", timeout=60)
    for r in (0, 1):
        msg = info.value.failures[r]
        assert "ranks disagree at collective #2" in msg, msg
        assert "rank 0 called all_reduce" in msg and "rank 1 called all_gather" in msg


# ---- sharded checkpoints N -> M ----------------------------------------------------------------
@pytest.mark.parametrize("n_from,n_to", [(1, 2), (2, 1), (2, 3), (3, 2), (4, 4), (3, 1)])
def test_checkpoint_reshards_n_to_m(tmp_path, n_from, n_to):
    sp = specs("tiny-llama", hidden_size=40, head_size=10, intermediate_size=72, vocab_size=251, num_layers=3)
    old, new = dist.ShardPlan(sp, n_from), dist.ShardPlan(sp, n_to)
    rng = np.random.default_rng(n_from * 10 + n_to)
    full = {k: {n: rng.standard_normal(s.shape).astype(dt) for n, s in old.params.items()}
            for k, dt in (("m", np.float32), ("v", ce.dtype("bf16").np))}  # fmt: skip
    for r in range(n_from):
        dist.save_shard(tmp_path, old, r, {k: old.shard(old.flatten(f), r) for k, f in full.items()})
    dist.write_manifest(tmp_path, old, full)
    loaded = [dist.load_shard(tmp_path, new, r) for r in range(n_to)]
    for k, f in full.items():
        assert loaded[0][k].dtype == f["wte"].dtype
        np.testing.assert_array_equal(new.unshard([s[k] for s in loaded]), new.flatten(f))
        for r in range(n_to):
            np.testing.assert_array_equal(loaded[r][k], dist.shard_of(new, r, f))
    gathered = dist.load_full(tmp_path)
    for k, f in full.items():
        for n, a in f.items():
            np.testing.assert_array_equal(gathered[k][n], a)


def test_checkpoint_errors(tmp_path):
    sp = specs()
    plan = dist.ShardPlan(sp, 2)
    with pytest.raises(ValueError, match="holds no shards.json"):
        dist.load_shard(tmp_path, plan, 0)
    with pytest.raises(ValueError, match=r"'m' has shape \(3,\), expected"):
        dist.save_shard(tmp_path, plan, 0, {"m": np.zeros(3, np.float32)})
    dist.save_shard(tmp_path, plan, 0, {"m": np.zeros(plan.shard_size, np.float32)})
    dist.write_manifest(tmp_path, plan, ["m"])
    with pytest.raises(ValueError, match="lacks optimizer.rank00001-of-00002.safetensors"):
        dist.load_shard(tmp_path, plan, 0)
    dist.save_shard(tmp_path, plan, 1, {"m": np.zeros(plan.shard_size, np.float32)})
    other = dist.ShardPlan(specs("tiny-llama"), 2)
    with pytest.raises(ValueError, match="other parameters"):
        dist.load_shard(tmp_path, other, 0)


def test_a_refused_save_is_refused_on_every_rank(tmp_path):
    """A path that is not a checkpoint is refused on each rank before any collective: rank 0 alone refusing would
    leave the others in the save's barrier until the timeout."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    res = dist.launch(dist_worker.refused_save, 2, str(tmp_path / "mine"), backend="fake", timeout=20, deadline=120)
    assert all("holds files that are not a checkpoint's (notes.txt)" in r for r in res), res
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


# ---- data sharding -------------------------------------------------------------------------------
def test_rank_batches_split_the_global_batch_and_resume():
    from cuengine.data import TokenSource

    tokens = np.arange(5000, dtype=np.int32) % 251

    def source():
        return TokenSource([tokens], "t", seed=3)

    single, ranks = source(), [source() for _ in range(3)]
    for step in range(4):
        x, y = single.batch(6, 16)
        parts = [dist.rank_batch(ranks[r], 2, 16, r, 3) for r in range(3)]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
        rows = {tuple(row) for p in parts for row in p[0]}
        assert len(rows) == 6, "ranks must read distinct windows"
        if step == 1:
            state = ranks[0].state()
            assert all(s.state() == state for s in ranks)
    # resume on 2 ranks (B=3 each: the same global batch) from the state after step 1
    resumed = [source() for _ in range(2)]
    for s in resumed:
        s.load_state(state)
    replay = source()
    replay.load_state(state)
    for _ in range(2):
        x, _ = replay.batch(6, 16)
        np.testing.assert_array_equal(np.concatenate([dist.rank_batch(resumed[r], 3, 16, r, 2)[0]
                                                      for r in range(2)]), x)  # fmt: skip
    with pytest.raises(ValueError, match="rank 2 outside"):
        dist.rank_batch(single, 2, 16, 2, 2)
    # RankSource: the same rule behind the TokenSource interface
    wrapped = [dist.RankSource(source(), r, 2) for r in range(2)]
    for w in wrapped:
        w.load_state(state)
    np.testing.assert_array_equal(
        np.concatenate([w.batch(3, 16)[1] for w in wrapped]), source_after(state).batch(6, 16)[1]
    )
    assert wrapped[1].state() == wrapped[0].source.state() and wrapped[0].name == "t"
    with pytest.raises(ValueError, match="RankSource: rank 2 outside"):
        dist.RankSource(single, 2, 2)


def source_after(state):
    from cuengine.data import TokenSource

    s = TokenSource([np.arange(5000, dtype=np.int32) % 251], "t", seed=3)
    s.load_state(state)
    return s


# ---- NCCL on two GPUs ------------------------------------------------------------------------------
def _gpus() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")
# A hung NCCL job fails at this deadline with each rank's Python stack (launch's `deadline`);
# a run of the tiny model takes seconds.
NCCL_DEADLINE = 240


@pytest.mark.gpu
@two_gpus
def test_nccl_collectives_match_numpy():
    results = dist.launch(dist_worker.collectives, 2, 5, 1000, backend="nccl", timeout=120, deadline=NCCL_DEADLINE)
    check_collectives(results, 5, 1000, 2)


@pytest.mark.gpu
@two_gpus
def test_nccl_launch_environment():
    envs = dist.launch(dist_worker.environment, 2, backend="nccl", timeout=120, deadline=NCCL_DEADLINE)
    assert [e["comm"] for e in envs] == [(0, 2, 0, "nccl"), (1, 2, 1, "nccl")]
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and e["NCCL_MIN_NCHANNELS"] == "24" for e in envs)
    # collectives run at the device's most urgent stream priority, the main stream at the default
    assert all(e["priorities"][0] == e["priorities"][2] < e["priorities"][1] == 0 for e in envs)


@pytest.mark.gpu
@two_gpus
def test_nccl_dead_worker_does_not_hang_the_other():
    """Rank 0 waits inside an NCCL all-reduce that rank 1 never joins: the launcher stops it."""
    t0 = time.monotonic()
    with pytest.raises(dist.WorkerError, match="rank 1 died \\(exit code 3\\)") as info:
        dist.launch(dist_worker.fail, 2, 1, "exit", backend="nccl", timeout=120, grace=3.0, deadline=NCCL_DEADLINE)
    assert time.monotonic() - t0 < 60
    assert "stopped by the launcher" in info.value.failures[0]


class _GraphBoundNccl:
    """Stands in for CuPy's NcclCommunicator: destroy() waits while a CUDA graph that captured one of
    its collectives is alive, as ncclCommDestroy does (without a time limit)."""

    def __init__(self):
        self.graph_gone = threading.Event()

    def drop_graph(self):
        self.graph_gone.set()

    def destroy(self):
        self.graph_gone.wait()


def _nccl_comm_on_cpu(nccl_comm):
    nccl = pytest.importorskip("cupy.cuda.nccl")
    if not nccl.available:
        pytest.skip("NCCL cannot be loaded")
    from cuengine.dist.nccl import NcclComm

    return NcclComm(0, 2, 0, ce.device("cpu"), nccl_comm, timeout=1.0)


def test_nccl_close_drops_graphs_through_on_close_then_destroys():
    """close() runs the on_close hooks before ncclCommDestroy, so a model's graphs go first."""
    raw = _GraphBoundNccl()

    class Model:  # what LlamaModel registers: drop the graphs that hold collectives
        def __init__(self):
            self.graphs = {"backward": raw}

    model = Model()
    comm = _nccl_comm_on_cpu(raw)
    comm.on_close(model, lambda m: m.graphs.pop("backward").drop_graph())
    t0 = time.monotonic()
    comm.close()
    assert time.monotonic() - t0 < 1 and model.graphs == {} and comm._comm is None
    comm.close()  # twice is fine


def test_nccl_close_raises_instead_of_hanging_while_a_graph_lives():
    raw = _GraphBoundNccl()
    comm = _nccl_comm_on_cpu(raw)
    t0 = time.monotonic()
    with pytest.raises(dist.DistError, match="rank 0: ncclCommDestroy did not return within 1 s: .* graph"):
        comm.close()
    assert time.monotonic() - t0 < 10
    raw.drop_graph()  # lets the destroy thread finish


def test_on_close_holds_its_owner_weakly():
    comm = dist.SoloComm("cpu")
    calls = []

    class Owner:
        pass

    kept, dropped = Owner(), Owner()
    comm.on_close(kept, lambda o: calls.append("kept"))
    comm.on_close(dropped, lambda o: calls.append("dropped"))
    del dropped
    comm.close()
    assert calls == ["kept"]


# ---- DataParallel without a model --------------------------------------------------------------
def reference_steps(preset, world, steps):
    """One process: the summed gradients (in rank order, fp32, as the double sums), full AdamW."""
    from cuengine.model.optimizer import AdamWState

    sp = specs(preset)
    alloc = ce.TensorAllocator(ce.device("cpu"))
    weights = {n: ce.Tensor.from_numpy(a, "cpu") for n, a in dist_worker.init_params(sp).items()}
    grads = {n: ce.Tensor.empty("fp32", s, "cpu") for n, s, _ in sp}
    opt = AdamWState(sp, alloc)
    for step in range(steps):
        gs = [dist_worker.rank_grads(sp, r, step) for r in range(world)]
        for n in grads:
            acc = gs[0][n]
            for g in gs[1:]:
                acc = acc + g[n]
            grads[n].copy_from_numpy(acc)
        opt.set_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, step + 1)
        opt.global_norm(grads, 1.0)
        opt.update(weights, grads, seed=42)
    return {n: t.numpy() for n, t in weights.items()}, opt


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
def test_adamw_on_pieces_rounds_like_the_whole_tensor(dev):
    """A rank updates its pieces of a parameter; with index_offset bf16 rounds as the whole would."""
    from cuengine.kernels import adamw

    rng = np.random.default_rng(0)
    n, cuts = 1000, [0, 296, 304, 1000]
    host = {k: rng.standard_normal(n).astype(np.float32) for k in ("p", "g", "m")}
    host["v"] = np.abs(rng.standard_normal(n)).astype(np.float32)
    hp = ce.Tensor.from_numpy(adamw.make_hparams(1e-2, 0.9, 0.95, 1e-8, 0.1, 3), dev)

    def tensors():
        return [ce.Tensor.from_numpy(host[k], dev, dtype="bf16") for k in ("p", "g", "m", "v")]

    whole = tensors()
    adamw.adamw_update(*whole, hp, None, True, 77)
    parts = tensors()
    for a, b in zip(cuts, cuts[1:]):
        adamw.adamw_update(*[t.rows(a, b) for t in parts], hp, None, True, 77, index_offset=a)
    for w, p in zip(whole, parts):
        np.testing.assert_array_equal(p.numpy().view(np.uint16), w.numpy().view(np.uint16))
    shifted = tensors()
    adamw.adamw_update(*[t.rows(296, 1000) for t in shifted], hp, None, True, 77)  # no offset: other draws
    assert not np.array_equal(shifted[0].numpy()[296:].view(np.uint16), whole[0].numpy()[296:].view(np.uint16))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], indirect=True)
def test_loss_weight_from_count_is_the_host_weight(dev):
    """d_loss = 1/max(count, 1) with the bits the one-GPU path uploads, also in place over the count."""
    from cuengine.kernels.loss_weight import loss_weight_from_count

    for n in (0, 1, 3, 31, 4096, 1_000_003, 2**24 + 1, 2**31 - 1):
        count = ce.Tensor.from_numpy(np.array([n], np.int32), dev)
        d_loss, out = ce.Tensor.empty("fp32", (1,), dev), ce.Tensor.empty("int32", (1,), dev)
        loss_weight_from_count(d_loss, out, count)
        host = np.zeros(1, np.float32)
        host[...] = 1.0 / max(n, 1)  # what LlamaModel uploads on one GPU
        assert d_loss.numpy().view(np.uint32)[0] == host.view(np.uint32)[0], n
        assert out.numpy()[0] == n
        loss_weight_from_count(count.view("fp32"), None, count)  # the count's own slot, as the upload carries it
        assert count.view("fp32").numpy().view(np.uint32)[0] == host.view(np.uint32)[0], n
    with pytest.raises(ValueError, match="loss_weight_from_count: count: expected dtype"):
        loss_weight_from_count(d_loss, None, d_loss)
    with pytest.raises(ValueError, match="loss_weight_from_count: d_loss: expected dtype"):
        loss_weight_from_count(out, None, out)


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_stages_agree_with_one_process(world):
    steps = 3
    runs = {stage: dist.launch(dist_worker.dp_steps, world, "tiny-llama", stage, steps, backend="fake", timeout=120)
            for stage in (0, 1, 2)}  # fmt: skip
    ref, ref_opt = reference_steps("tiny-llama", world, steps)
    base = runs[0][0]
    for stage, results in runs.items():
        for r, res in enumerate(results):
            # every rank holds the same weights, equal bit for bit across the stages
            for n, a in ref.items():
                np.testing.assert_array_equal(res[n], base[n], err_msg=f"stage {stage} rank {r} {n}")
                np.testing.assert_allclose(res[n], a, rtol=1e-6, atol=1e-7, err_msg=f"stage {stage} {n}")
            np.testing.assert_array_equal(res["norm"], base["norm"])
            # the host adds all ranks' per-token losses
            want = [sum(float(np.sum(np.arange(6) + 10 * q + s)) for q in range(world)) for s in range(steps)]
            assert res["loss_sums"] == want
            # the loss weight: 1/(every rank's valid targets), made on the device; the host reads the count
            counts = [sum(q + 1 + s for q in range(world)) for s in range(steps)]
            assert res["counts"] == counts
            assert [w.view(np.uint32) for w in res["loss_weights"]] == [
                np.float32(1 / c).view(np.uint32) for c in counts
            ]
            # ZeRO: the encoder's lookup from the shards (the gather still due) is the gathered table's rows
            assert res["encode_exact"] == ([True] * steps if stage else []), (stage, r)
    assert_close(base["norm"], ref_opt.norm_result.numpy(), "fp32", what="norm")
    # the gathered shard moments are the one-process moments
    for stage in (1, 2):
        moments = runs[stage][0]["moments"]
        assert runs[stage][1]["moments"] is None
        assert {k: (a.shape, a.dtype) for k, a in moments.items()} == runs[stage][0]["moment_shapes"]
        for n in ref:
            np.testing.assert_allclose(moments[f"m.{n}"], ref_opt.m[n].numpy(), rtol=1e-6, atol=1e-9)
            np.testing.assert_allclose(moments[f"v.{n}"], ref_opt.v[n].numpy(), rtol=1e-6, atol=1e-12)


# ---- LlamaModel on several ranks (the NumPy double on cpu) ---------------------------------------
FP32 = {"preset": "tiny", "dtype": "fp32"}


def train(world, B, steps, opts=None, cfg=FP32, **kw):
    """One process, no launcher: the reference."""
    assert world == 1
    return dist_worker.train_model(cfg, opts or {}, B, steps, **kw)


def _launch_kw(world, cfg, opts, B, steps, accum=1, save_at=None, save_to=None, load=None):
    res = dist.launch(dist_worker.train_model, world, cfg, opts, B, steps, accum, save_at, save_to, load,
                      backend="fake", timeout=120)  # fmt: skip
    for r in res[1:]:  # every rank reports the same global loss and holds the same weights
        assert r["losses"] == res[0]["losses"]
        for n, a in r["weights"].items():
            np.testing.assert_array_equal(a, res[0]["weights"][n], err_msg=n)
    return res[0]


def assert_losses_close(got, want, rtol):
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=rtol, atol=0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_two_ranks_of_b2_train_like_one_rank_of_b4(clean_env, preset):
    cfg = {"preset": preset, "dtype": "fp32"}
    one = train(1, 4, range(3), cfg=cfg)
    two = _launch_kw(2, cfg, {}, 2, range(3))
    assert_losses_close(two["losses"], one["losses"], 1e-5)
    # AdamW's m/sqrt(v) magnifies the last-bit differences of summing per rank where a gradient is
    # nearly zero, so weights agree only to about lr * 1e-2 after a few steps
    for n, a in one["weights"].items():
        np.testing.assert_allclose(two["weights"][n], a, rtol=0, atol=1e-4, err_msg=n)


def test_two_ranks_sum_to_the_gradient_of_the_whole_batch(clean_env):
    one = dist_worker.model_grads(FP32, 4)
    two = dist.launch(dist_worker.model_grads, 2, FP32, 2, backend="fake", timeout=120)
    for n, g in one.items():
        for r in range(2):
            assert_close(two[r][n], g, "fp32", what=f"rank {r} {n}", scale=max(float(np.abs(g).max()), 1e-3))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_stages_equal_plain_data_parallel(clean_env, dtype):
    """On the double every stage reduces in the same order, and a shard rounds its bf16 weights
    and moments with the draws of the whole tensor, so the stages agree bit for bit."""
    cfg = {"preset": "tiny", "dtype": dtype}
    base = _launch_kw(2, cfg, {"zero_stage": 0}, 2, range(3))
    for stage in (1, 2):
        run = _launch_kw(2, cfg, {"zero_stage": stage}, 2, range(3))
        assert run["losses"] == base["losses"], f"zero_stage {stage}"
        for n, a in base["weights"].items():
            np.testing.assert_array_equal(run["weights"][n], a, err_msg=f"zero_stage {stage} {n}")


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_zero_stages_equal_plain_data_parallel_with_fp8_copies(clean_env, preset):
    """FP8 matmuls (and the FP8 LM head): with ZeRO >= 1 each layer's E4M3 copies are re-made in the
    next forward after its gather, the embedding's (a tied head) in the update; same bits as stage 0."""
    cfg, opts = {"preset": preset, "dtype": "bf16"}, {"matmul_dtype": "e4m3", "lmhead_fp8": True}
    base = _launch_kw(2, cfg, dict(opts, zero_stage=0), 2, range(3))
    for stage in (1, 2):
        run = _launch_kw(2, cfg, dict(opts, zero_stage=stage), 2, range(3))
        assert run["losses"] == base["losses"], f"zero_stage {stage}"
        for n, a in base["weights"].items():
            np.testing.assert_array_equal(run["weights"][n], a, err_msg=f"zero_stage {stage} {n}")


def test_delayed_fp8_scaling_on_two_ranks(clean_env, tmp_path):
    """fp8_amax_history on two ranks: every micro-step's abs-maxes are the max over the ranks, so both ranks
    hold one history (and the checkpoint rank 0 writes is every rank's: a resume gives the uninterrupted run's
    bits), ZeRO-1 gives the bits of stage 0, and the losses stay near current scaling's."""
    cfg, opts = {"preset": "tiny", "dtype": "bf16"}, {"matmul_dtype": "e4m3", "fp8_amax_history": 2}
    ranks = dist.launch(dist_worker.train_model, 2, cfg, opts, 2, range(4), 1, 1, str(tmp_path / "ck"), None,
                        backend="fake", timeout=120)  # fmt: skip
    np.testing.assert_array_equal(ranks[1]["fp8_history"], ranks[0]["fp8_history"])
    assert ranks[0]["fp8_history"][:, 2].all()  # two micro-steps' abs-maxes, not zero
    resumed = _launch_kw(2, cfg, opts, 2, range(2, 4), load=str(tmp_path / "ck"))
    assert resumed["losses"] == ranks[0]["losses"][2:]
    base = _launch_kw(2, cfg, dict(opts, zero_stage=0), 2, range(4))
    run = _launch_kw(2, cfg, dict(opts, zero_stage=1), 2, range(4))
    assert run["losses"] == base["losses"]
    for n, a in base["weights"].items():
        np.testing.assert_array_equal(run["weights"][n], a, err_msg=n)
    current = _launch_kw(2, cfg, {"matmul_dtype": "e4m3", "fp8_amax_history": 0}, 2, range(4))
    assert current["losses"][0] == base["losses"][0]
    assert current["losses"][1:] != base["losses"][1:]  # the delayed scales were used
    assert_losses_close(base["losses"], current["losses"], 2e-3)


@pytest.mark.parametrize(
    "opts",
    [{"lmhead_chunks": 2, "recompute_rmsnorm": True, "recompute_ffn_layers": 1},
     {"lmhead_chunks": 2, "recompute_block": True, "matmul_dtype": "e4m3"}],
    ids=["lean-chunked-head", "block-recompute-fp8"],
)  # fmt: skip
def test_zero_stages_equal_plain_data_parallel_with_recompute_and_a_chunked_head(clean_env, opts):
    """The memory presets' recompute (SwiGLU by default, RMSNorm and the first layer's up projection, or
    the whole block) with an LM head in two chunks on two ranks: the bits of keeping every activation,
    and under ZeRO stages 1 and 2 the bits of stage 0."""
    cfg = {"preset": "tiny-llama", "dtype": "bf16"}
    base = _launch_kw(2, cfg, dict(opts, zero_stage=0), 2, range(3))
    kept = {k: v for k, v in opts.items() if not k.startswith("recompute")}
    plain = _launch_kw(2, cfg, dict(kept, zero_stage=0, recompute_swiglu=False), 2, range(3))
    assert base["losses"] == plain["losses"]
    for n, a in plain["weights"].items():
        np.testing.assert_array_equal(base["weights"][n], a, err_msg=f"recompute {n}")
    for stage in (1, 2):
        run = _launch_kw(2, cfg, dict(opts, zero_stage=stage), 2, range(3))
        assert run["losses"] == base["losses"], f"zero_stage {stage}"
        for n, a in base["weights"].items():
            np.testing.assert_array_equal(run["weights"][n], a, err_msg=f"zero_stage {stage} {n}")


def test_fake_runs_communication_stream_collectives_only_when_waited_for(clean_env):
    """The double runs a collective on the communication stream only when a stream waits for it,
    so a forgotten wait reads stale bytes on cpu as it could on a GPU."""
    res = dist.launch(dist_worker.deferred_gathers, 2, backend="fake", timeout=60)
    for got in res:  # the first gather ran at the wait, after both ranks had overwritten their input with 0
        assert got == {"before": [-1] * 4, "after_first": [0, 0, -1, -1], "after_join": [0, 0, 1, 1]}, got


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_the_update_leaves_every_gather_to_the_next_forward(clean_env, stage):
    """ZeRO >= 1: the update gathers nothing; the next forward gathers every rank's tokens for its
    encoder lookup, then issues the layers', the head's and the embedding's gathers on the
    communication stream before its first block, and waits for layer i's just before block i (not
    for all of them at its start) and for the embedding's after the head's. Until then
    `parameters()` refuses, and `sync_weights()` makes the weights whole (the same on both ranks)."""
    res = dist.launch(dist_worker.gather_order, 2, stage, backend="fake", timeout=120)
    for r in res[1:]:
        for n, a in res[0]["weights"].items():
            np.testing.assert_array_equal(r["weights"][n], a, err_msg=n)
    got = res[0]
    L, log = got["L"], [e for e in got["log"] if e[1] != "gather" or e[3]]  # (the losses' gather is on main)
    gathers = [(i, e) for i, e in enumerate(log) if e[1] == "gather"]
    if stage == 0:
        assert not gathers and not got["due"] and got["refused"] is None
        return
    # the tokens (2 ranks x 1 row x T), then the first update's layers, head and embedding, all in the forward
    sizes = [e[2] for _, e in gathers]
    assert [e[0] for _, e in gathers] == ["forward"] * (L + 3), log
    assert sizes[0] == 2 * got["T"] and sizes[-1] == got["embedding_size"], log
    assert got["due"] and "sync_weights" in got["refused"] and not got["due_after_sync"]
    blocks = {e[2]: i for i, e in enumerate(log) if e[1] == "block" and e[0] == "forward"}
    waits = {e[2]: i for i, e in enumerate(log) if e[1] == "wait"}
    assert max(i for i, e in gathers if e[0] == "forward") < blocks[0]
    for i in range(L):
        assert (blocks[i - 1] if i else 0) < waits[f"layers.{i}"] < blocks[i], log
    assert waits["embedding"] > waits["head"] > blocks[L - 1]


def test_trainer_agrees_on_a_stop_without_a_host_wait_per_step(clean_env, tmp_path):
    """A stop asked for on rank 1 alone (its hook, after step 3) stops every rank after step 4 with
    the same checkpoint; no step waits on the host for a collective (no broadcast_object; one
    barrier per checkpoint, inside save_checkpoint)."""
    res = dist.launch(dist_worker.trainer_agreement, 2, 8, 1, 3, -1, 0.0, str(tmp_path / "ck"), backend="fake",
                      timeout=120)  # fmt: skip
    for got in res:
        assert got["step"] == 4 and got["stop_requested"] and got["saves"] == [4], got
        assert got["calls"] == {"broadcast_object": 0, "barrier": 1}, got


def test_trainer_timed_checkpoints_on_every_rank_at_the_same_step(clean_env, tmp_path):
    """Rank 1's clock says a save is due after every step, rank 0's never does: both save at the same
    steps, each one step after the post that carried it."""
    res = dist.launch(dist_worker.trainer_agreement, 2, 5, -1, -1, 1, 50.0, str(tmp_path / "ck"), backend="fake",
                      timeout=120)  # fmt: skip
    assert res[0]["saves"] == res[1]["saves"] == [2, 3, 4, 5], res
    assert all(r["step"] == 5 and not r["stop_requested"] for r in res)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_graphed_steps_on_ranks_equal_eager_steps_and_close_drops_the_graphs(clean_env, stage):
    """use_cuda_graphs with ranks and 3 micro-steps (first, middle and last graphs): the double's hub
    checks that every rank calls the same collectives, and the run equals the eager one bit for bit.
    Closing the communicator drops the model's graphs: on NCCL, ncclCommDestroy waits for every graph
    that captured a collective to be destroyed, and with the model alive it hung (the ZeRO-1 + graphs
    case on the H200 pair)."""
    opts = {"zero_stage": stage}
    eager = _launch_kw(2, FP32, opts, 1, range(3), accum=3)
    graphed = _launch_kw(2, FP32, dict(opts, use_cuda_graphs=True), 1, range(3), accum=3)
    assert graphed["losses"] == eager["losses"]
    for n, a in eager["weights"].items():
        np.testing.assert_array_equal(graphed["weights"][n], a, err_msg=n)
    captured, left = graphed["graphs"]
    assert captured > 0 and left == 0, graphed["graphs"]


def test_bf16_two_ranks_match_one_rank(clean_env):
    cfg = {"preset": "tiny", "dtype": "bf16"}
    one = train(1, 4, range(3), cfg=cfg)
    two = _launch_kw(2, cfg, {"zero_stage": 1}, 2, range(3))
    assert_close(two["losses"], one["losses"], "bf16", what="losses")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_accumulation_across_ranks(clean_env, stage):
    one = train(1, 2, range(3), accum=2)
    two = _launch_kw(2, FP32, {"zero_stage": stage}, 1, range(3), accum=2)
    assert_losses_close(two["losses"], one["losses"], 1e-5)


def test_checkpoint_saved_on_two_ranks_resumes_on_one_and_back(clean_env, tmp_path):
    ck = str(tmp_path / "ck")
    two = _launch_kw(2, FP32, {"zero_stage": 1}, 2, range(4), save_at=1, save_to=ck)
    one = train(1, 4, range(2, 4), load=ck)
    assert one["extra"] == {"step": 1}
    assert_losses_close(one["losses"], two["losses"][2:], 1e-5)
    # and a one-process checkpoint resumes on two ranks with sharded gradients and moments
    ck1 = str(tmp_path / "ck1")
    one_full = train(1, 4, range(4), save_at=1, save_to=ck1)
    back = _launch_kw(2, FP32, {"zero_stage": 2}, 2, range(2, 4), load=ck1)
    assert_losses_close(back["losses"], one_full["losses"][2:], 1e-5)


def test_model_and_communicator_must_share_a_device(clean_env):
    class Elsewhere:
        world_size, rank, device = 2, 0, object()

    with pytest.raises(ValueError, match="the communicator on"):
        ce.LlamaModel(TransformerConfig.preset("tiny"), device="cpu", comm=Elsewhere())
    with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2"):
        ce.TrainOptions(zero_stage=3)


# ---- LlamaModel on two GPUs over NCCL --------------------------------------------------------------
def _nccl_train(opts, B, steps, cfg, **kw):
    args = dict(accum=1, save_at=None, save_to=None, load=None)
    args.update(kw)
    res = dist.launch(dist_worker.train_model, 2, cfg, opts, B, steps, args["accum"], args["save_at"], args["save_to"],
                      args["load"], "cuda", backend="nccl", timeout=120, deadline=NCCL_DEADLINE)  # fmt: skip
    assert res[1]["losses"] == res[0]["losses"], "the ranks disagree about the global loss"
    return res[0]


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nccl_two_gpus_of_b4_match_one_gpu_of_b8(clean_env, dtype):
    cfg = {"preset": "tiny", "dtype": dtype}
    one = dist_worker.train_model(cfg, {}, 8, range(20), device="cuda")
    two = _nccl_train({"zero_stage": 1}, 4, range(20), cfg)
    if dtype == "fp32":
        assert_losses_close(two["losses"], one["losses"], 1e-5)
    else:
        assert_close(two["losses"], one["losses"], "bf16", what="losses")


ZERO_CASES = {"zero1": ({"zero_stage": 1}, 1), "zero2": ({"zero_stage": 2}, 1),
              "zero1+graphs": ({"zero_stage": 1, "use_cuda_graphs": True}, 1),
              "zero2+graphs": ({"zero_stage": 2, "use_cuda_graphs": True}, 1),
              "zero1+graphs+accum3": ({"zero_stage": 1, "use_cuda_graphs": True}, 3),
              "zero2+graphs+accum3": ({"zero_stage": 2, "use_cuda_graphs": True}, 3)}  # fmt: skip


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("case", list(ZERO_CASES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_nccl_zero_stages_equal_plain_data_parallel(clean_env, dtype, case):
    """One case per test, against plain data parallel; with 3 micro-steps against the same stage
    without graphs (stage 2 adds the ranks' sums every micro-step, another rounding order than
    stage 0's one sum). The graph cases once hung in comm.close(): ncclCommDestroy waits for every
    CUDA graph that captured a collective, and the model (with its graphs) was still alive; the
    model now drops them through comm.on_close (checked on rank 0; a rank that hangs hits the deadline)."""
    cfg = {"preset": "tiny", "dtype": dtype}
    opts, accum = ZERO_CASES[case]
    base_opts = {"zero_stage": 0} if accum == 1 else {"zero_stage": opts["zero_stage"]}
    base = _nccl_train(base_opts, 4 // accum, range(10), cfg, accum=accum)
    run = _nccl_train(opts, 4 // accum, range(10), cfg, accum=accum)
    assert run["graphs"][1] == 0 and (run["graphs"][0] > 0) == bool(opts.get("use_cuda_graphs")), run["graphs"]
    assert_losses_close(run["losses"], base["losses"], 1e-6)


@pytest.mark.gpu
@two_gpus
def test_nccl_fp8_two_gpus_train(clean_env):
    cfg = {"preset": "tiny", "dtype": "bf16"}
    one = dist_worker.train_model(cfg, {"matmul_dtype": "e4m3"}, 8, range(5), device="cuda")
    two = _nccl_train({"zero_stage": 1, "matmul_dtype": "e4m3"}, 4, range(5), cfg)
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=5e-2)


@pytest.mark.gpu
@two_gpus
def test_nccl_zero1_fp8_graphs_gather_in_the_forward(clean_env):
    """ZeRO-1 with FP8 copies (the head's too) and CUDA graphs: the forward's graph holds the layers'
    gathers, per-layer event waits and re-quantization; the same losses as plain data parallel."""
    cfg = {"preset": "tiny", "dtype": "bf16"}
    opts = {"matmul_dtype": "e4m3", "lmhead_fp8": True, "use_cuda_graphs": True}
    base = _nccl_train(dict(opts, zero_stage=0), 4, range(8), cfg)
    run = _nccl_train(dict(opts, zero_stage=1), 4, range(8), cfg)
    assert run["graphs"][0] > 0 and run["graphs"][1] == 0, run["graphs"]
    assert_losses_close(run["losses"], base["losses"], 1e-6)


@pytest.mark.gpu
@two_gpus
def test_nccl_trainer_agrees_on_a_stop(clean_env, tmp_path):
    """The Trainer's stop agreement on NCCL (device all-reduce, pinned read-back one step later)."""
    res = dist.launch(dist_worker.trainer_agreement, 2, 8, 1, 3, -1, 0.0, str(tmp_path / "ck"), backend="nccl",
                      timeout=120, deadline=NCCL_DEADLINE)  # fmt: skip
    for got in res:
        assert got["step"] == 4 and got["saves"] == [4] and got["calls"]["broadcast_object"] == 0, got


@pytest.mark.gpu
@two_gpus
def test_nccl_checkpoint_of_two_gpus_resumes_on_one(clean_env, tmp_path):
    ck = str(tmp_path / "ck")
    two = _nccl_train({"zero_stage": 1}, 4, range(6), FP32, save_at=2, save_to=ck)
    one = dist_worker.train_model(FP32, {}, 8, range(3, 6), load=ck, device="cuda")
    assert_losses_close(one["losses"], two["losses"][3:], 1e-5)


def test_cli_train_on_two_ranks_matches_one_process_and_resumes(clean_env, tmp_path):
    """`cuengine train --gpus 2` (here through the NumPy double) trains on the same global batches
    as one process with twice the batch, and resumes with the same --gpus to the same losses."""
    import json

    from cuengine import cli

    clean_env.setenv("CUENGINE_DIST_BACKEND", "fake")
    common = ["train", "--device", "cpu", "--preset", "tiny", "--seq-len", "32", "--steps", "6", "--warmup", "1",
              "--eval-every", "3", "--eval-batches", "1", "--sample-tokens", "0", "--dtype", "fp32"]  # fmt: skip

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "log.jsonl").read_text().splitlines()]

    assert cli.main(common + ["--batch-size", "4", "--out", str(tmp_path / "one")]) == 0
    assert cli.main(common + ["--batch-size", "2", "--gpus", "2", "--out", str(tmp_path / "two")]) == 0
    assert_losses_close(losses(tmp_path / "two"), losses(tmp_path / "one"), 1e-5)
    assert json.loads((tmp_path / "two" / "run.json").read_text())["gpus"] == 2
    half = common + ["--batch-size", "2", "--gpus", "2", "--out", str(tmp_path / "half")]
    assert cli.main(half + ["--stop-after", "3"]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "half"), "--resume"]) == 2  # another --gpus: refused
    assert cli.main(["train", "--out", str(tmp_path / "half"), "--resume", "--gpus", "2"]) == 0
    assert_losses_close(losses(tmp_path / "half"), losses(tmp_path / "one"), 1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_norm_and_update_are_one_multi_tensor_launch_each(clean_env, stage):
    """The norm is one multi-tensor launch over this rank's pieces (no launch per piece) at every
    stage. Stages 1 and 2: the update is one AdamW launch over them and gathers nothing (the next
    forward does); each table entry is the piece as `adamw_update` takes it alone (its parameter's
    seed and draw offset), which is what makes the update bitwise the per-piece one."""
    res = dist.launch(dist_worker.update_launches, 2, stage, backend="fake", timeout=120)
    for got in res:
        log = [e for e in got["log"] if e[0] != "gather" or e[2]]  # (the losses' gather is on main)
        update = log[log.index(("norm_multi", "pieces")) + 1 :]
        assert ("norm_piece",) not in log and log.count(("norm_multi", "pieces")) == 1, log
        assert got["norm_grads"]
        if stage == 0:
            assert update == [("adamw_multi", "opt_state")], log
            continue
        assert update == [("adamw_multi", "shard")], log
        assert got["pieces"][0] == "wte" and got["entries_match"] and got["entries"] == len(got["pieces"])
