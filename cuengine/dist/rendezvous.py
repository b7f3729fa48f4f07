"""The TCP rendezvous at MASTER_ADDR:MASTER_PORT: rank 0 listens, every other rank connects.

Only small things travel here (NCCL's 128-byte unique id; for the test double, its collectives),
as length-prefixed pickles. Every wait has a deadline, and a rank that cannot reach rank 0, or
a rank 0 that is not joined by everyone, raises DistError saying who waited for whom and where.
Pickle is fine on this channel because its peers are the ranks of one job; it must not face an
untrusted network.
"""

from __future__ import annotations

import pickle
import socket
import struct
import time

_HEADER = struct.Struct("<Q")


class DistError(RuntimeError):
    """A distributed run cannot go on: a peer is gone, late, or disagrees about what to do."""


def send_msg(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket):
    """The next message; EOFError when the peer closed, TimeoutError past the socket's timeout."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, n))


def listen(addr: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on `port`, bound to `addr` when it is an address of this host, else to
    every interface (MASTER_ADDR may be a name that resolves elsewhere, e.g. behind NAT)."""
    for host in (addr, ""):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            s.close()
            if host == "":
                raise DistError(f"rendezvous: rank 0 cannot listen on port {port}: {err}") from None
            continue
        s.listen(backlog)
        return s
    raise AssertionError("unreachable")


def accept(server: socket.socket, world_size: int, ranks, tag: str, timeout: float) -> dict[int, socket.socket]:
    """Accept one connection from each rank in `ranks`; {rank: socket}. Each peer says hello with
    (tag, rank, world_size), and a peer of another job or backend is refused."""
    deadline = time.monotonic() + timeout
    want, socks = set(ranks), {}
    try:
        while want - set(socks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(want - set(socks))
                message = (f"rendezvous: rank 0 waited {timeout:.0f} s for ranks {missing} of {world_size} to connect; "
                           "did they start, with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE?")  # fmt: skip
                for s in socks.values():  # tell those who came why nothing happens
                    try:
                        send_msg(s, ("error", message))
                    except OSError:
                        pass
                raise DistError(message)
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(max(deadline - time.monotonic(), 1.0))
            try:
                hello = recv_msg(conn)
            except (EOFError, TimeoutError, OSError, pickle.UnpicklingError):
                conn.close()
                continue
            if not (isinstance(hello, tuple) and len(hello) == 3 and hello[0] == tag):
                conn.close()
                continue
            _, rank, world = hello
            if world != world_size or rank not in want or rank in socks:
                send_msg(conn, ("error", f"rank 0 has WORLD_SIZE={world_size} and expects ranks {sorted(want)}; "
                                         f"got rank {rank} with WORLD_SIZE={world}"))  # fmt: skip
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[rank] = conn
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    return socks


def connect(addr: str, port: int, rank: int, world_size: int, tag: str, timeout: float) -> socket.socket:
    """Connect to rank 0, retrying until `timeout` (rank 0 may start later), and say hello."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=max(min(deadline - time.monotonic(), 5.0), 0.1))
            break
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise DistError(
                f"rendezvous: rank {rank} could not reach rank 0 at {addr}:{port} within {timeout:.0f} s ({last}); "
                "is rank 0 running, and do all ranks share MASTER_ADDR and MASTER_PORT?"
            )
        time.sleep(0.05)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    send_msg(sock, (tag, rank, world_size))
    return sock


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (the launcher's MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
