"""NcclComm: the Communicator on NCCL, through CuPy's bindings (`cupy.cuda.nccl.NcclCommunicator`).

The collectives take raw device pointers and a stream, so they run on engine Tensors without
copies and are captured into CUDA graphs like any kernel. Reductions name NCCL's datatype
directly: `cupyx.distributed`'s dtype table has no bf16, but NCCL does (`ncclBfloat16`).
All-gather and broadcast move bytes (`ncclUint8`), so fp8 weights travel as they are.
"""

from __future__ import annotations

import gc
import pickle
import threading

import numpy as np

from ..device import device as _get_device
from .comm import DEFAULT_TIMEOUT, Communicator, _master
from .rendezvous import DistError, accept, connect, listen, recv_msg, send_msg

_TAG = "cuengine-nccl-1"
_NCCL_BFLOAT16 = 9  # ncclBfloat16 in nccl.h, for a CuPy that lacks the constant


def _nccl():
    from cupy.cuda import nccl

    if not nccl.available:
        raise DistError("NCCL cannot be loaded: install nvidia-nccl-cu13 (cuengine's `cuda` extra)")
    return nccl


def _reduce_types(nccl) -> dict[str, int]:
    """{engine dtype name: NCCL datatype} for the types collectives may reduce."""
    return {"fp32": nccl.NCCL_FLOAT32, "bf16": getattr(nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16),
            "fp16": nccl.NCCL_FLOAT16, "int32": nccl.NCCL_INT32}  # fmt: skip


def _exchange_unique_id(nccl, rank: int, world: int, timeout: float) -> bytes:
    """Rank 0 makes NCCL's unique id and hands it to every other rank over the TCP rendezvous."""
    addr, port = _master()
    if rank == 0:
        server = listen(addr, port, world)
        try:
            uid = nccl.get_unique_id()
            socks = accept(server, world, range(1, world), _TAG, timeout)
            for s in socks.values():
                send_msg(s, ("uid", uid))
                s.close()
        finally:
            server.close()
        return uid
    sock = connect(addr, port, rank, world, _TAG, timeout)
    try:
        kind, value = recv_msg(sock)
    except (EOFError, ConnectionError):
        raise DistError(f"rendezvous: rank 0 at {addr}:{port} closed the connection before sending NCCL's id") from None
    except TimeoutError:
        raise DistError(f"rendezvous: rank {rank} got no NCCL id from rank 0 within {timeout:.0f} s") from None
    finally:
        sock.close()
    if kind != "uid":
        raise DistError(f"rendezvous: rank 0 refused rank {rank}: {value}")
    return value


class NcclComm(Communicator):
    """Collectives over NCCL between one process per GPU. Build it with `cuengine.dist.init()`."""

    backend = "nccl"

    def __init__(
        self, rank: int, world_size: int, local_rank: int, device, nccl_comm, timeout: float = DEFAULT_TIMEOUT
    ):
        super().__init__(rank, world_size, local_rank, device)
        self._comm = nccl_comm
        self.timeout = timeout
        nccl = _nccl()
        self._sum, self._max, self._u8 = nccl.NCCL_SUM, nccl.NCCL_MAX, nccl.NCCL_UINT8
        self._types = _reduce_types(nccl)
        with device.activate():
            self._token = device.xp.zeros(1, device.xp.int32)  # what barrier reduces

    @classmethod
    def create(cls, rank: int, world_size: int, local_rank: int, timeout: float, mpi=None) -> NcclComm:
        """Join the job: pick cuda:<local_rank> (cuda:0 when the launcher shows each process one
        GPU) and make it current, get NCCL's unique id from rank 0 (TCP rendezvous, or MPI
        broadcast) and init NCCL."""
        nccl = _nccl()
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        if local_rank < count:
            index = local_rank
        elif count == 1:
            index = 0
        else:
            raise DistError(f"init: LOCAL_RANK={local_rank} but this process sees {count} GPUs")
        # This process's GPU becomes the current device, as torch.cuda.set_device does, so code that
        # uses the current device (CuPy arrays, library handles) lands on it too.
        cupy.cuda.Device(index).use()
        dev = _get_device(f"cuda:{index}")
        if mpi is not None:
            uid = mpi.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
        else:
            uid = _exchange_unique_id(nccl, rank, world_size, timeout)
        with dev.activate():
            comm = nccl.NcclCommunicator(world_size, uid, rank)
        return cls(rank, world_size, local_rank, dev, comm, timeout)

    def _launch(self, stream, call, *args):
        s = self.device._stream(stream)
        with self.device.activate():
            call(*args, s.ptr)

    def _all_reduce(self, tensor, op, stream):
        red = self._sum if op == "sum" else self._max
        self._launch(stream, self._comm.allReduce, tensor.ptr, tensor.ptr, tensor.nelem,
                     self._types[tensor.dtype.name], red)  # fmt: skip

    def _reduce_scatter(self, out, inp, stream):
        self._launch(stream, self._comm.reduceScatter, inp.ptr, out.ptr, out.nelem, self._types[out.dtype.name],
                     self._sum)  # fmt: skip

    def _all_gather(self, out, inp, stream):
        self._launch(stream, self._comm.allGather, inp.ptr, out.ptr, inp.nbytes, self._u8)

    def _broadcast(self, tensor, root, stream):
        self._launch(stream, self._comm.broadcast, tensor.ptr, tensor.ptr, tensor.nbytes, self._u8, root)

    def barrier(self) -> None:
        """An all-reduce of one int on the communication stream, waited for by the host."""
        self._launch(self.stream, self._comm.allReduce, self._token.data.ptr, self._token.data.ptr, 1,
                     self._types["int32"], self._sum)  # fmt: skip
        self.stream.synchronize()

    def _broadcast_object(self, obj, root):
        cupy = self.device.xp
        data = pickle.dumps(obj) if self.rank == root else b""
        with self.device.activate(), self.stream.raw:
            size = cupy.array([len(data)], cupy.int64)
            self._comm.broadcast(size.data.ptr, size.data.ptr, 8, self._u8, root, self.stream.ptr)
            n = int(size.get(stream=self.stream.raw)[0])
            buf = cupy.empty(max(n, 1), cupy.uint8)
            if self.rank == root:
                buf[:n].set(np.frombuffer(data, np.uint8), stream=self.stream.raw)
            self._comm.broadcast(buf.data.ptr, buf.data.ptr, n, self._u8, root, self.stream.ptr)
            host = buf[:n].get(stream=self.stream.raw)
        return pickle.loads(host.tobytes())

    def close(self) -> None:
        """Run the `on_close` hooks, wait for the device, then destroy the NCCL communicator (a
        local call: no peer needed).

        ncclCommDestroy first waits, without a time limit, until every CUDA graph that captured a
        collective of this communicator has been destroyed; so a model alive at close (with
        use_cuda_graphs) drops its graphs in its `on_close` hook. A graph that something else
        still holds makes close raise DistError after `timeout` seconds instead of hanging (the
        destroy call is left behind in a daemon thread)."""
        if self._comm is None:
            return
        self._run_close_hooks()
        gc.collect()  # graphs that only a reference cycle (e.g. a dropped model's) still holds
        self.device.synchronize()
        comm, self._comm = self._comm, None
        done, failed = threading.Event(), []

        def destroy():
            try:
                with self.device.activate():
                    comm.destroy()
            except BaseException as err:  # noqa: B036 (re-raised on the calling thread)
                failed.append(err)
            done.set()

        threading.Thread(target=destroy, name="cuengine-nccl-destroy", daemon=True).start()
        if not done.wait(self.timeout):
            raise DistError(
                f"rank {self.rank}: ncclCommDestroy did not return within {self.timeout:.0f} s: NCCL destroys a "
                "communicator only after every CUDA graph that captured its collectives is destroyed, and one is "
                "still alive; drop it before close (a LlamaModel drops its own through comm.on_close)"
            )
        if failed:
            raise failed[0]
