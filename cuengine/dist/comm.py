"""The Communicator interface, the world of one, and `init()` from the launcher's environment.

A Communicator runs collectives on Tensors between the ranks of a job, one process per GPU.
Collectives are enqueued on a stream (by default the device's main stream, so results are
ready for whatever comes next there); passing `stream=comm.stream` runs them on the
communication stream instead, beside the compute, with `comm.wait_for(main)` before and
`comm.join(main)` after to order the two streams without a host sync. Two events do this
for any number of collectives: a stream wait captures the event's last record at call time.
`comm.record(event)` / `comm.wait(event)` order a stream after part of them (one bucket's).
"""

from __future__ import annotations

import os
import pickle
import weakref

from .. import _checks
from ..device import device as _get_device
from ..dtypes import BF16, FP16, FP32, INT32
from .rendezvous import DistError

REDUCE_DTYPES = (FP32, BF16, FP16, INT32)
REDUCE_OPS = ("sum", "max")
DEFAULT_TIMEOUT = 300.0  # seconds: rendezvous, and a collective of the test double
# NCCL settings `init` applies unless the environment has its own. NVLS (NVLink multicast) stays off
# (the H200 hosts' rule). At least 24 channels: on the H200 pair the ZeRO-1 reduce-scatters and
# all-gathers are bandwidth-bound where backward cannot hide them, and 0.5B bf16 exposed 2.8-2.9 ms of
# communication per step with 24 or 32 channels against 3.3-3.5 ms with NCCL's own choice (8 channels:
# 6.5 ms, 4: 8.6 ms); BENCHMARKS, fourth session.
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "NCCL_MIN_NCHANNELS": "24"}


class Communicator:
    """What every backend provides.

    Attributes:
        rank, world_size, local_rank: this process's place in the job (local_rank: on its host).
        device: the Device its collectives run on.
        stream: the communication stream (a Stream of `device`).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str

    def __init__(self, rank: int, world_size: int, local_rank: int, device):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device
        self.stream = device.new_stream(priority="high")  # see Stream: beside a wide kernel, collectives go first
        self._fork, self._join = device.event(), device.event()
        self._on_close: list = []  # (weak reference to an owner, fn(owner)) for `on_close`

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank} of {self.world_size}, local {self.local_rank}, {self.device})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- stream order ------------------------------------------------------------------------
    def wait_for(self, stream=None) -> None:
        """Later work on the communication stream waits for the work enqueued so far on `stream`
        (default: the main stream): e.g. a gradient bucket that backward has just finished."""
        self._fork.record(self.device._stream(stream))
        self.stream.wait(self._fork)

    def join(self, stream=None) -> None:
        """Later work on `stream` (default: the main stream) waits for the collectives enqueued so
        far on the communication stream."""
        self._join.record(self.stream)
        self.device._stream(stream).wait(self._join)

    def record(self, event) -> None:
        """Record `event` on the communication stream after the collectives enqueued so far: a
        point that `wait` orders another stream after (e.g. one bucket's all-gather)."""
        event.record(self.stream)

    def wait(self, event, stream=None) -> None:
        """Later work on `stream` (default: the main stream) waits for the collectives enqueued
        before `record(event)`, not for those after it (`join` waits for all of them)."""
        self.device._stream(stream).wait(event)

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor, op: str = "sum", stream=None) -> None:
        """In place: tensor = op over ranks of tensor. NumPy: `x[...] = sum(x_r for r in ranks)`."""
        self._check("all_reduce", tensor, reduce=True, op=op)
        if self.world_size > 1 and tensor.nelem:
            self._all_reduce(tensor, op, stream)

    def reduce_scatter(self, out, inp, stream=None) -> None:
        """out (n,) = chunk `rank` of the sum over ranks of inp (world_size * n,).
        `out` may be that chunk of `inp` itself (in place)."""
        self._check("reduce_scatter", out, reduce=True)
        self._check("reduce_scatter", inp, reduce=True)
        self._check_sizes("reduce_scatter", out, inp)
        if self.world_size == 1:
            self._copy(out, inp, stream)
        elif out.nelem:
            self._reduce_scatter(out, inp, stream)

    def all_gather(self, out, inp, stream=None) -> None:
        """out (world_size * n,) = the concatenation of every rank's inp (n,) in rank order.
        `inp` may be this rank's chunk of `out` itself (in place). Any dtype, fp8 included."""
        self._check("all_gather", out)
        self._check("all_gather", inp)
        self._check_sizes("all_gather", inp, out)
        if self.world_size == 1:
            self._copy(out, inp, stream)
        elif inp.nelem:
            self._all_gather(out, inp, stream)

    def broadcast(self, tensor, root: int = 0, stream=None) -> None:
        """In place: every rank's tensor = root's tensor (e.g. weights initialised on one rank)."""
        self._check("broadcast", tensor)
        self._check_root(root)
        if self.world_size > 1 and tensor.nelem:
            self._broadcast(tensor, root, stream)

    def barrier(self) -> None:
        """Return once every rank has called barrier (the host waits)."""

    def broadcast_object(self, obj=None, root: int = 0):
        """Root's picklable `obj` on every rank (checkpoint metadata, data offsets); not for tensors."""
        self._check_root(root)
        return pickle.loads(pickle.dumps(obj)) if self.world_size == 1 else self._broadcast_object(obj, root)

    def on_close(self, owner, fn) -> None:
        """At `close`, before the backend goes, call `fn(owner)` if `owner` is still alive (it is
        held weakly, so registering keeps nothing alive, as long as `fn` does not hold it).

        What it is for: NCCL destroys a communicator only once every CUDA graph that captured one
        of its collectives has been destroyed (ncclCommDestroy waits for them, without a time
        limit), so a model that captured its step drops its graphs here. Such graphs cannot run
        after close anyway."""
        self._on_close.append((weakref.ref(owner), fn))

    def _run_close_hooks(self) -> None:
        hooks, self._on_close = self._on_close, []
        for ref, fn in hooks:
            owner = ref()
            if owner is not None:
                fn(owner)

    def close(self) -> None:
        """Release the backend (after the `on_close` hooks); the communicator cannot be used afterwards."""
        self._run_close_hooks()

    # ---- checks ------------------------------------------------------------------------------
    def _check(self, what, t, reduce=False, op="sum"):
        _checks.expect(t, f"{what}: tensor", dtype=REDUCE_DTYPES if reduce else None, device=self.device)
        if op not in REDUCE_OPS:
            raise ValueError(f"{what}: op must be one of {REDUCE_OPS}, got {op!r}")

    def _check_sizes(self, what, part, whole):
        if part.dtype != whole.dtype:
            raise ValueError(f"{what}: {part.name!r} is {part.dtype} but {whole.name!r} is {whole.dtype}")
        if whole.nelem != self.world_size * part.nelem:
            raise ValueError(
                f"{what}: {whole.name!r} {whole.shape} has {whole.nelem} elements, expected world_size "
                f"{self.world_size} x {part.nelem} (the elements of {part.name!r} {part.shape})"
            )

    def _check_root(self, root):
        if not 0 <= root < self.world_size:
            raise ValueError(f"root {root} outside [0, {self.world_size})")

    def _copy(self, out, inp, stream):
        if out.storage is not inp.storage or out.offset != inp.offset:
            self.device.copy_async(out, inp, stream)

    # ---- what a backend implements (world_size > 1, sizes checked, nothing empty) ------------
    def _all_reduce(self, tensor, op, stream):
        raise NotImplementedError

    def _reduce_scatter(self, out, inp, stream):
        raise NotImplementedError

    def _all_gather(self, out, inp, stream):
        raise NotImplementedError

    def _broadcast(self, tensor, root, stream):
        raise NotImplementedError

    def _broadcast_object(self, obj, root):
        raise NotImplementedError


class SoloComm(Communicator):
    """The world of one: collectives are copies or nothing, so single-GPU code needs no branch."""

    backend = "solo"

    def __init__(self, device="auto"):
        super().__init__(0, 1, 0, _get_device(device))


# ---- init ----------------------------------------------------------------------------------------
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise DistError(f"init: environment variable {name}={raw!r} is not an integer") from None


def init(backend: str | None = None, device=None, timeout: float | None = None) -> Communicator:
    """This process's Communicator, from the launcher's environment.

    Reads torchrun's contract: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Unset (or
    WORLD_SIZE=1), it is a world of one. Without RANK but under MPI (mpirun / srun with PMI),
    ranks come from mpi4py and NCCL's unique id travels by MPI broadcast.

    Args:
        backend: "nccl" (the product transport) or "fake" (the NumPy test double, cpu device);
            None reads CUENGINE_DIST_BACKEND, default "nccl".
        device: the device of a world of one (default "auto"); NCCL uses cuda:<LOCAL_RANK>.
        timeout: seconds to wait at the rendezvous (and for a collective of the test double);
            None reads CUENGINE_DIST_TIMEOUT, default 300.

    Sets NCCL_DEFAULTS (NVLink multicast off, at least 24 channels) before NCCL initialises, each
    unless already set.
    """
    for name, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(name, value)
    backend = backend or os.environ.get("CUENGINE_DIST_BACKEND", "nccl")
    if backend not in ("nccl", "fake"):
        raise ValueError(f"init: backend must be 'nccl' or 'fake', got {backend!r}")
    if timeout is None:
        timeout = float(os.environ.get("CUENGINE_DIST_TIMEOUT", DEFAULT_TIMEOUT))
    mpi = None
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        for v in ("RANK", "WORLD_SIZE"):
            if v not in os.environ:
                raise DistError(f"init: RANK and WORLD_SIZE go together (torchrun's contract), but {v} is unset")
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    elif any(v in os.environ for v in _MPI_VARS):
        from mpi4py import MPI

        mpi = MPI.COMM_WORLD
        rank, world = mpi.Get_rank(), mpi.Get_size()
        local = mpi.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    else:
        rank, world, local = 0, 1, 0
    if world < 1 or not 0 <= rank < world or local < 0:
        raise DistError(f"init: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local} is not a valid place in a job")
    if world == 1:
        return SoloComm("auto" if device is None else device)
    if backend == "fake":
        from .fake import FakeComm

        if mpi is not None:
            raise DistError("init: the fake backend rendezvous over TCP; run it with RANK/WORLD_SIZE, not MPI")
        addr, port = _master()
        return FakeComm(rank, world, local, addr, port, timeout)
    from .nccl import NcclComm

    return NcclComm.create(rank, world, local, timeout, mpi=mpi)


def _master() -> tuple[str, int]:
    for v in ("MASTER_ADDR", "MASTER_PORT"):
        if v not in os.environ:
            raise DistError(f"init: {v} is unset; with WORLD_SIZE > 1 every rank needs MASTER_ADDR and MASTER_PORT")
    return os.environ["MASTER_ADDR"], _env_int("MASTER_PORT")
