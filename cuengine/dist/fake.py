"""FakeComm: a TEST DOUBLE of the Communicator that runs the collectives in NumPy, not a transport.

It exists so that CI, on the cpu device, can run the sharding, bucketing and checkpoint logic in
real separate processes through the same interface NCCL serves on GPUs. It is slow (every
collective is a round trip of pickled arrays through rank 0) and has none of NCCL's rounding:
sums run in fp32 in rank order and round once to the tensor's dtype. Do not train with it.

Rank 0 runs a hub thread at MASTER_ADDR:MASTER_PORT; every rank, rank 0 included, sends it each
collective and waits for its part of the result. The hub checks that all ranks called the same
collective with the same dtype and size (a mismatch raises DistError on every rank instead of a
hang), and when a rank disconnects or does not show up within the timeout it tells the others,
which raise DistError.

Stream order is modelled the way a GPU may run it at its latest: a collective enqueued on the
communication stream (`stream=comm.stream`) runs, reading its input and writing its output, only
when some stream is made to wait for it (`join`, or `wait` on an event `record`ed after it), or
at a host wait (barrier, broadcast_object, close). Collectives on the main stream run at once.
So code that reads a result without waiting for it reads stale bytes here too, and the tests that
compare against one process see it. Every rank runs the same program, so every rank runs its
deferred collectives in the same order at the same points, which keeps the hub's order check.
"""

from __future__ import annotations

import selectors
import threading
import time

import numpy as np

from ..device import device as _get_device
from .comm import Communicator
from .rendezvous import DistError, accept, connect, listen, recv_msg, send_msg

_TAG = "cuengine-fake-1"


class FakeComm(Communicator):
    """Collectives in NumPy between processes on the cpu device (a test double; see the module)."""

    backend = "fake"

    def __init__(self, rank: int, world_size: int, local_rank: int, addr: str, port: int, timeout: float):
        super().__init__(rank, world_size, local_rank, _get_device("cpu"))
        self.timeout = timeout
        self._seq = 0
        self._deferred: list = []  # communication-stream collectives not yet run, in stream order
        self._ran = 0  # how many of them ran
        self._marks: dict = {}  # event -> how many had been enqueued when it was recorded
        self._hub = None
        if rank == 0:
            self._hub = _Hub(listen(addr, port, world_size), world_size, timeout)
            self._hub.start()
        self._sock = connect(addr, port, rank, world_size, _TAG, timeout)
        self._sock.settimeout(timeout + 5.0)  # the hub reports its own timeout first
        self._call("init")

    def _call(self, name: str, payload=None, **meta):
        if self._sock is None:
            raise DistError(f"rank {self.rank}: {name} on a closed communicator")
        self._seq += 1
        try:
            send_msg(self._sock, (name, self._seq, meta, payload))
            kind, value = recv_msg(self._sock)
        except (EOFError, ConnectionError):
            raise DistError(f"rank {self.rank}: lost rank 0 (the hub) during {name} #{self._seq}: "
                            "rank 0 exited or died") from None  # fmt: skip
        except TimeoutError:
            raise DistError(f"rank {self.rank}: no answer to {name} #{self._seq} within {self.timeout:.0f} s") from None
        if kind == "error":
            raise DistError(f"rank {self.rank}: {value}")
        return value

    @staticmethod
    def _describe(t):
        return {"dtype": t.dtype.name, "n": t.nelem}

    # ---- stream order (see the module) ----------------------------------------------------------
    def _enqueue(self, stream, run) -> None:
        if stream is self.stream:
            self._deferred.append(run)
        else:
            run()

    def _run_deferred(self, upto: int | None = None) -> None:
        """Run the deferred collectives, all of them or the first `upto` ever enqueued."""
        upto = self._ran + len(self._deferred) if upto is None else upto
        while self._ran < upto:
            self._ran += 1
            self._deferred.pop(0)()

    def record(self, event) -> None:
        self._marks[event] = self._ran + len(self._deferred)
        super().record(event)

    def wait(self, event, stream=None) -> None:
        self._run_deferred(self._marks.get(event, 0))
        super().wait(event, stream)

    def join(self, stream=None) -> None:
        self._run_deferred()
        super().join(stream)

    # ---- collectives ---------------------------------------------------------------------------
    def _all_reduce(self, tensor, op, stream):
        def run():
            tensor.array()[...] = self._call("all_reduce", tensor.array(), op=op, **self._describe(tensor))

        self._enqueue(stream, run)

    def _reduce_scatter(self, out, inp, stream):
        def run():
            out.array().reshape(-1)[...] = self._call("reduce_scatter", inp.array().reshape(-1), **self._describe(out))

        self._enqueue(stream, run)

    def _all_gather(self, out, inp, stream):
        def run():
            out.array().reshape(-1)[...] = self._call("all_gather", inp.array().reshape(-1), **self._describe(inp))

        self._enqueue(stream, run)

    def _broadcast(self, tensor, root, stream):
        def run():
            mine = tensor.array() if self.rank == root else None
            tensor.array()[...] = self._call("broadcast", mine, root=root, **self._describe(tensor))

        self._enqueue(stream, run)

    def _broadcast_object(self, obj, root):
        self._run_deferred()
        return self._call("broadcast_object", obj if self.rank == root else None, root=root)

    def barrier(self) -> None:
        self._run_deferred()
        self._call("barrier")

    def close(self) -> None:
        """A collective: every rank closes together (a rank that leaves early is an error). The
        `on_close` hooks run first, as NCCL's close runs them."""
        if self._sock is None:
            return
        self._run_close_hooks()
        try:
            self._run_deferred()
            self._call("close")
        finally:
            self._sock.close()
            self._sock = None
            if self._hub is not None:
                self._hub.join(timeout=5.0)


def _reduce(arrays: list[np.ndarray], op: str) -> np.ndarray:
    dt = arrays[0].dtype
    work = np.int32 if dt == np.int32 else np.float32
    acc = arrays[0].astype(work)
    with np.errstate(over="ignore"):
        for a in arrays[1:]:
            acc = acc + a.astype(work) if op == "sum" else np.maximum(acc, a.astype(work))
    return acc.astype(dt)


class _Hub(threading.Thread):
    """Rank 0's thread: gathers one message per rank, checks they agree, answers each rank."""

    def __init__(self, server, world_size: int, timeout: float):
        super().__init__(name="cuengine-fake-hub", daemon=True)
        self.server, self.world, self.timeout = server, world_size, timeout
        self.socks: dict[int, object] = {}

    def run(self):
        try:
            self.socks = accept(self.server, self.world, range(self.world), _TAG, self.timeout)
        except DistError:
            return  # the ranks that did connect time out with their own message
        finally:
            self.server.close()
        for s in self.socks.values():
            s.settimeout(self.timeout)
        try:
            while True:
                msgs = self._gather()
                if msgs is None or not self._answer(msgs):
                    return
        finally:
            for s in self.socks.values():
                s.close()

    def _order(self):
        """Every rank's socket, rank 0's last: its process may exit as soon as it has its answer,
        and this thread with it."""
        return sorted(self.socks.items(), key=lambda item: item[0] == 0)

    def _fail(self, message: str, skip=()) -> None:
        for r, s in self._order():
            if r not in skip:
                try:
                    send_msg(s, ("error", message))
                except OSError:
                    pass

    def _gather(self):
        msgs: dict[int, tuple] = {}
        sel = selectors.DefaultSelector()
        for r, s in self.socks.items():
            sel.register(s, selectors.EVENT_READ, r)
        deadline = time.monotonic() + self.timeout
        try:
            while len(msgs) < self.world:
                left = deadline - time.monotonic()
                ready = sel.select(timeout=max(left, 0)) if left > 0 else []
                if not ready:
                    missing = sorted(set(self.socks) - set(msgs))
                    what = next(iter(msgs.values()))[0] if msgs else "a collective"
                    self._fail(f"ranks {missing} did not join {what} within {self.timeout:.0f} s", skip=missing)
                    return None
                for key, _ in ready:
                    r = key.data
                    try:
                        msgs[r] = recv_msg(key.fileobj)
                    except (EOFError, ConnectionError, TimeoutError):
                        waiting = sorted(q for q, m in msgs.items())
                        ops = {m[0] for m in msgs.values()} or {"their next collective"}
                        self._fail(f"rank {r} disconnected (it exited or died) while ranks {waiting} waited in "
                                   f"{'/'.join(sorted(ops))}", skip=(r,))  # fmt: skip
                        return None
                    sel.unregister(key.fileobj)
        finally:
            sel.close()
        return msgs

    def _answer(self, msgs: dict[int, tuple]) -> bool:
        calls = {r: (m[0], m[2]) for r, m in msgs.items()}
        if len({repr(c) for c in calls.values()}) > 1:
            seen = "; ".join(f"rank {r} called {op}{meta}" for r, (op, meta) in sorted(calls.items()))
            self._fail(f"ranks disagree at collective #{msgs[0][1]}: {seen}")
            return False
        op, _, meta, _ = msgs[0]
        payloads = [msgs[r][3] for r in range(self.world)]
        if op in ("all_reduce", "reduce_scatter"):
            total = _reduce(payloads, meta.get("op", "sum"))
            parts = np.split(total, self.world) if op == "reduce_scatter" else [total] * self.world
        elif op == "all_gather":
            parts = [np.concatenate(payloads)] * self.world
        elif op in ("broadcast", "broadcast_object"):
            parts = [payloads[meta["root"]]] * self.world
        else:  # init, barrier, close
            parts = [None] * self.world
        for r, s in self._order():
            send_msg(s, ("ok", parts[r]))
        return op != "close"
