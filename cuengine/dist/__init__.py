"""Several GPUs: one process per GPU, NCCL collectives, ZeRO sharding plans and sharded checkpoints.

    comm = ce.dist.init()             # torchrun's environment (RANK, WORLD_SIZE, ...); a world of one if unset
    ce.dist.launch(fn, nprocs, *args) # start one process per GPU on this host, each calling init()
                                      # (deadline=seconds: a hung job fails with each rank's stack)

Why NCCL through CuPy's bindings (`cupy.cuda.nccl.NcclCommunicator`) rather than nccl4py: CuPy is
already the engine's device layer (in the `cuda` extra), and its NCCL binding takes raw device
pointers and a stream handle, which is all an engine Tensor and Stream give, so the only new
dependency is the NCCL library itself (`nvidia-nccl-cu13`, which CuPy loads). nccl4py would add a
second binding layer with its own buffer and stream conventions for the same four calls. The one
gap, bf16 missing from `cupyx.distributed`'s dtype table, does not touch us: we call
`NcclCommunicator` directly with NCCL's bf16 datatype enum.

Processes, not threads (LLMQ's lesson): its one-thread-per-GPU mode needed a CPU barrier around
every NCCL call to avoid deadlocks, and finalising NCCL could hang at exit. NVLink multicast
(NVLS) stays off: `init` and `launch` set NCCL_NVLS_ENABLE=0 before NCCL starts; `init` also asks for
at least 24 channels (comm.NCCL_DEFAULTS), unless the environment says otherwise.
"""

from .checkpoint import load_full, load_shard, read_manifest, save_shard, shard_of, write_manifest
from .comm import Communicator, SoloComm, init
from .data import RankSource, rank_batch
from .launch import WorkerError, launch
from .plan import Bucket, ParamSlot, Piece, ShardPlan, bucket_name
from .rendezvous import DistError

__all__ = [
    "Bucket", "Communicator", "DistError", "ParamSlot", "Piece", "RankSource", "ShardPlan", "SoloComm", "WorkerError",
    "bucket_name", "init", "launch", "load_full", "load_shard", "rank_batch", "read_manifest", "save_shard",
    "shard_of", "write_manifest",
]  # fmt: skip
