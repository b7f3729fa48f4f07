"""`launch(fn, nprocs, *args)`: one process per GPU on this host, watched until all are done.

Workers are spawned (never forked: CUDA does not survive a fork) with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and NCCL_NVLS_ENABLE=0,
all set before the interpreter starts, so nothing in the worker can initialise NCCL without them.
`fn` calls `cuengine.dist.init()` itself, exactly as under torchrun.

A rank that raises or dies must not leave the others hanging in a collective that will never
complete (NCCL waits forever on the GPU). The parent watches every worker; after the first
failure the others get `grace` seconds to exit on their own (the test double and a failed
rendezvous raise DistError), then are terminated, and `launch` raises WorkerError naming the
rank that failed first and what happened to each of the others.

A collective that some rank never joins fails nobody: NCCL waits on the GPU, and the host waits
on the GPU. `deadline` bounds the whole job for that case: past it, each worker still running
writes its Python stack (faulthandler, on SIGUSR1), is stopped, and WorkerError shows where each
one was waiting.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

from .rendezvous import DistError, free_port


class WorkerError(DistError):
    """A worker of `launch` failed. `failures` maps each rank that did not return to a description."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(fn, args, conn, stack_path) -> None:
    stacks = open(stack_path, "w")  # noqa: SIM115 (faulthandler writes to it until the process ends)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    code = 0
    try:
        result = fn(*args)
        conn.send(("ok", result))
    except BaseException as err:  # noqa: B036 (the parent reports it; SystemExit and Ctrl-C included)
        # a DistError is a consequence of another rank's failure, not a cause of its own
        conn.send(("error", f"{type(err).__name__}: {err}", traceback.format_exc(), isinstance(err, DistError)))
        code = 1
    conn.close()
    # Leave without the interpreter's teardown, as a forked worker does: finalising a CuPy NCCL
    # communicator that was never closed (ncclCommDestroy in its __dealloc__) waits forever while
    # a CUDA graph that captured its collectives is still alive, and teardown order is arbitrary.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_text(code) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch(fn, nprocs: int, *args, backend: str | None = None, timeout: float | None = None,
           grace: float = 10.0, deadline: float | None = None) -> list:  # fmt: skip
    """Run `fn(*args)` in `nprocs` new processes, ranks 0..nprocs-1 of one job on this host.

    Args:
        fn: a picklable (module-level) function; it calls `cuengine.dist.init()` for its comm.
        nprocs: the number of processes (one per GPU).
        args: picklable arguments, the same for every rank.
        backend: sets CUENGINE_DIST_BACKEND for the workers ("nccl", or "fake" for CPU tests).
        timeout: sets CUENGINE_DIST_TIMEOUT (rendezvous; collectives of the test double).
        grace: seconds the other workers get to exit by themselves after the first failure,
            before they are terminated.
        deadline: seconds the whole job may run (None: no limit); the workers still running then
            are stopped, and WorkerError carries each one's Python stack.

    Returns the list of each rank's return value, in rank order. Raises WorkerError when a
    worker raises, dies or outlives the deadline; every worker has exited by then.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be an int >= 1, got {nprocs!r}")
    ctx = mp.get_context("spawn")
    env = {"WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "NCCL_NVLS_ENABLE": "0"}  # fmt: skip
    if backend is not None:
        env["CUENGINE_DIST_BACKEND"] = backend
    if timeout is not None:
        env["CUENGINE_DIST_TIMEOUT"] = str(timeout)
    procs, conns = [], []
    stacks = tempfile.mkdtemp(prefix="cuengine-launch-")
    paths = [os.path.join(stacks, f"rank{r}.stack") for r in range(nprocs)]
    start = time.monotonic()
    try:
        for r in range(nprocs):
            recv_end, send_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(fn, args, send_end, paths[r]), name=f"cuengine-rank{r}",
                            daemon=False)  # fmt: skip
            with _environ({**env, "RANK": str(r), "LOCAL_RANK": str(r)}):
                p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        return _watch(procs, conns, grace, paths, deadline, start)
    finally:
        _stop(procs)
        shutil.rmtree(stacks, ignore_errors=True)


def _stop(procs) -> list[int]:
    """Terminate, then kill, every worker still running; the ranks that had to be stopped."""
    stopped = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stopped:
        procs[r].terminate()
    for r in stopped:
        procs[r].join(5.0)
        if procs[r].is_alive():
            procs[r].kill()
            procs[r].join()
    return stopped


def _stacks(procs, ranks, paths, wait: float = 3.0) -> dict[int, str]:
    """{rank: its Python stack} of the running workers `ranks`, which faulthandler writes on SIGUSR1."""
    for r in ranks:
        with contextlib.suppress(OSError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    end, out = time.monotonic() + wait, {}
    while True:
        for r in ranks:
            with contextlib.suppress(OSError), open(paths[r]) as f:
                out[r] = f.read().strip()
        if all(out.get(r) for r in ranks) or time.monotonic() > end:
            return {r: out.get(r) or "(no stack written)" for r in ranks}
        time.sleep(0.1)


def _watch(procs, conns, grace: float, paths, deadline: float | None, start: float) -> list:
    messages: dict[int, tuple] = {}  # rank -> ("ok", result) or ("error", text, traceback)
    open_conns = {c: r for r, c in enumerate(conns)}
    failures: dict[int, str] = {}
    causes: dict[int, tuple] = {}  # rank -> (a consequence of another failure?, when seen, traceback)
    first = None  # when the first failure was seen

    def settle():
        """Record every rank that has exited, and whose message (if any) has been read, without
        returning a result."""
        nonlocal first
        for r, p in enumerate(procs):
            if r in failures or p.exitcode is None or r in open_conns.values():
                continue
            msg = messages.get(r)
            if msg is not None and msg[0] == "ok":
                continue
            if msg is not None:
                failures[r], causes[r] = f"raised {msg[1]}", (msg[3], time.monotonic(), msg[2])
            else:
                failures[r], causes[r] = (
                    f"died ({_exit_text(p.exitcode)}) without a result",
                    (False, time.monotonic(), None),
                )
            if first is None:
                first = time.monotonic()

    late: dict[int, str] = {}  # rank -> its stack, for the workers still running at the deadline
    while True:
        finished = not open_conns and all(p.exitcode is not None for p in procs)
        settle()
        if finished:
            break
        running = [r for r, p in enumerate(procs) if p.exitcode is None]
        if deadline is not None and running and time.monotonic() - start > deadline:
            late = _stacks(procs, running, paths)
            for r in _stop(procs):
                done = messages.get(r, ("",))[0] == "ok"
                failures[r] = "had sent its result but not exited" if done else "was still running"
            for c in open_conns:
                c.close()
            open_conns.clear()
            break
        if first is not None and time.monotonic() - first > grace:
            for r in _stop(procs):
                if r not in messages:
                    failures[r] = f"was stopped by the launcher {grace:.0f} s after the first failure"
            for c in open_conns:
                c.close()
            open_conns.clear()
            continue
        for c in wait(list(open_conns) + [p.sentinel for p in procs if p.exitcode is None], timeout=0.2):
            if c in open_conns:
                r = open_conns.pop(c)
                try:
                    messages[r] = c.recv()
                except (EOFError, OSError):
                    pass
                c.close()
    if late:
        lines = [f"ranks {sorted(late)} were stopped at the deadline, {deadline:.0f} s after the start (a collective "
                 "that some rank never joins, or a host waiting on the device, hangs forever)"]  # fmt: skip
        lines += [f"rank {r} {what}" for r, what in sorted(failures.items())]
        text = "launch: " + "; ".join(lines)
        text += "".join(
            f"\n--- rank {r} Python stack (most recent call first) ---\n{st}" for r, st in sorted(late.items())
        )
        raise WorkerError(text, failures)
    if failures:
        rank = min(causes, key=lambda q: causes[q][:2])  # the earliest cause, before any consequence
        tb = causes[rank][2]
        lines = [f"rank {rank} {failures[rank]}"]
        lines += [f"rank {r} {what}" for r, what in sorted(failures.items()) if r != rank]
        text = "launch: " + "; ".join(lines)
        if tb:
            text += f"\n--- rank {rank} traceback ---\n{tb}"
        raise WorkerError(text, failures)
    return [messages[r][1] for r in range(len(procs))]
