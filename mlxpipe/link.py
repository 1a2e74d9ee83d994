"""The ranks' own link under ``mlx.launch``: a TCP connection from every rank to rank 0, blocking sockets.

mlx's ring backend moves data on socket threads that loop on non-blocking ``recv`` while a receive is pending,
so a rank waiting at one of its collectives spins a core (bench/RESULTS.md); and its set-up makes a
rank that connects before its neighbour listens sleep a whole second. Over this link a rank that waits sleeps
in the kernel, and any thread may gather. Under ``mlx.launch --backend ring`` the ranks need no mlx at all to
find each other (:func:`join`): rank 0 listens where the ring's hostfile says rank 0 listens (mlx's ring is
then never set up), the others connect there. Under other backends :mod:`mlxpipe.distributed` sets it up
through mlx (rank 0 tells every rank its :func:`listen` card, the others :func:`connect`).

A :class:`Star` gathers in one round: every other rank sends rank 0 its frame, rank 0 sends every rank all
frames. Frames are length-prefixed. A rank that went away (its process died, its host dropped off) shows as
end of file or a reset: :class:`Lost`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import struct
import time
from typing import Any

__all__ = ["Lost", "Star", "accept", "card", "connect", "join", "listen", "ring_hosts"]

_LENGTH = struct.Struct("!Q")
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead peer is an error here, never a SIGPIPE
CONNECT_SECONDS = 10.0  # for every rank to reach rank 0, or the job stays on mlx's own gather
JOIN_SECONDS = 60.0  # for every rank to start (ssh, another host) and reach rank 0, or the job fails


class Lost(ConnectionError):
    """A rank closed its end of the link, or the link broke."""


class Star:
    """Frames gathered over TCP: rank 0 holds a connection to every rank (``peers[r - 1]`` is rank r's), the
    others one to rank 0."""

    def __init__(self, rank: int, size: int, peers: list[socket.socket]) -> None:
        self.rank, self.size, self.peers = rank, size, peers

    def gather(self, frame: bytes) -> list[bytes]:
        """Every rank's ``frame``, in rank order; raises :class:`Lost` when a rank went away."""
        try:
            if self.rank:
                _send(self.peers[0], frame)
                return _unpack(_receive(self.peers[0], 0))
            frames = [frame] + [_receive(peer, r) for r, peer in enumerate(self.peers, 1)]
            blob = _pack(frames)
            for peer in self.peers:
                _send(peer, blob)
            return frames
        except OSError as exc:
            self.close()  # the others learn it at once, as when this process ends
            if isinstance(exc, Lost):
                raise
            raise Lost(str(exc) or type(exc).__name__) from None

    def close(self) -> None:
        """Close every connection (a thread blocked on one wakes up)."""
        for peer in self.peers:
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)
            peer.close()


def ring_hosts() -> list[str] | None:
    """The ring backend's hostfile (``MLX_HOSTFILE``, written by ``mlx.launch``): each rank's first
    ``ip:port``, in rank order; None without one (another backend, or a job of one rank)."""
    try:
        with open(os.environ.get("MLX_HOSTFILE", "")) as f:
            hosts = [str(rank[0]) for rank in json.load(f)]
    except (OSError, ValueError, TypeError, IndexError, KeyError):
        return None
    return hosts if len(hosts) > 1 and all(":" in h for h in hosts) else None


def join(rank: int, hosts: list[str], seconds: float = JOIN_SECONDS) -> Star:
    """The link among the ring's ranks, made without mlx: rank 0 listens on its hostfile address, the
    others connect to it. Raises :class:`Lost` when some rank does not come within ``seconds``."""
    address, _, port = hosts[0].rpartition(":")
    address = address.strip("[]")
    job = {"port": int(port), "hosts": [address], "node": "", "token": _digest(hosts)}
    if rank == 0:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            server = socket.create_server((address, int(port)), family=family, backlog=128)
        except OSError as exc:
            raise Lost(f"rank 0 cannot listen on {hosts[0]}: {exc.strerror or exc}") from None
        peers = accept(server, job, len(hosts), seconds)
        if peers is None:
            raise Lost(f"not every rank reached rank 0 at {hosts[0]} within {seconds:.0f} s")
        return Star(0, len(hosts), peers)
    sock = connect(job, rank, seconds, pause=0.05)
    if sock is None:
        raise Lost(f"rank {rank} could not reach rank 0 at {hosts[0]} within {seconds:.0f} s")
    return Star(rank, len(hosts), [sock])


def _digest(hosts: list[str]) -> str:
    # What every rank of the job knows alike: a connection from another job's rank is turned away.
    return hashlib.sha256(json.dumps(hosts).encode()).hexdigest()[:32]


def listen() -> tuple[socket.socket, dict[str, Any]]:
    """Rank 0: a listening socket on every interface, and the card that tells the others how to reach it."""
    if socket.has_dualstack_ipv6():
        server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
    else:
        server = socket.create_server(("", 0), backlog=128)
    return server, card(int(server.getsockname()[1]))


def card(port: int) -> dict[str, Any]:
    """Where rank 0 can be reached: the addresses the launcher gave it first, then its host name's."""
    hosts: list[str] = []
    # The ring backend's hostfile: a list of "ip:port" per rank.
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    with contextlib.suppress(OSError, ValueError, TypeError, IndexError), open(hostfile) as f:
        hosts += [address.rsplit(":", 1)[0].strip("[]") for address in json.load(f)[0]]
    if os.environ.get("MLX_JACCL_COORDINATOR"):
        hosts.append(os.environ["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0])
    hosts.append(os.environ.get("NCCL_HOST_IP", ""))
    with contextlib.suppress(OSError):
        found = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
        hosts += [str(info[4][0]) for info in found]
    unique = list(dict.fromkeys(h for h in hosts if h))
    return {"port": port, "hosts": unique, "node": socket.gethostname(), "token": secrets.token_hex(16)}


def connect(
    card: dict[str, Any], rank: int, seconds: float = CONNECT_SECONDS, pause: float = 0.1
) -> socket.socket | None:
    """Rank ``rank`` > 0: a connection to rank 0 that rank 0 has recognised, or None (tries again every
    ``pause`` seconds: rank 0 may not listen yet)."""
    hosts = list(card["hosts"])
    if card["node"] == socket.gethostname():
        hosts.append("127.0.0.1")  # the same host: loopback always works
    hello = json.dumps({"token": card["token"], "rank": rank}).encode()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for host in hosts:
            sock = None
            try:
                sock = socket.create_connection((host, card["port"]), timeout=2.0)
                _send(sock, hello)
                # The right rank 0, not another listener:
                if _receive(sock, 0, limit=4096) == card["token"].encode():
                    sock.settimeout(None)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return sock
            except (OSError, ValueError):
                pass
            if sock is not None:
                sock.close()
        time.sleep(pause)
    return None


def accept(
    server: socket.socket, card: dict[str, Any], size: int, seconds: float = CONNECT_SECONDS
) -> list[socket.socket] | None:
    """Rank 0: one recognised connection from each rank 1 … ``size`` - 1, in rank order, or None."""
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + seconds
    try:
        while len(peers) < size - 1:
            server.settimeout(max(0.0, deadline - time.monotonic()))
            sock, _ = server.accept()
            try:
                sock.settimeout(2.0)
                hello = json.loads(_receive(sock, 0, limit=4096))
                rank = int(hello["rank"])
                if hello["token"] != card["token"] or not 0 < rank < size or rank in peers:
                    raise ValueError("not a rank of this job")
                _send(sock, card["token"].encode())
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                peers[rank] = sock
            except (OSError, ValueError, KeyError, TypeError):
                sock.close()
    except OSError:  # the deadline passed
        for sock in peers.values():
            sock.close()
        return None
    finally:
        server.close()
    return [peers[r] for r in range(1, size)]


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data, _NOSIGNAL)


def _receive(sock: socket.socket, rank: int, limit: int | None = None) -> bytes:
    (n,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size, rank))
    if limit is not None and n > limit:  # a greeting from something that is not a rank
        raise ValueError("frame too long")
    return _exactly(sock, n, rank)


def _exactly(sock: socket.socket, n: int, rank: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise Lost(f"rank {rank} closed its connection")
        got += k
    return bytes(buf)


def _pack(frames: list[bytes]) -> bytes:
    return _LENGTH.pack(len(frames)) + b"".join(_LENGTH.pack(len(f)) for f in frames) + b"".join(frames)


def _unpack(blob: bytes) -> list[bytes]:
    (count,) = _LENGTH.unpack_from(blob)
    sizes = [_LENGTH.unpack_from(blob, _LENGTH.size * (1 + i))[0] for i in range(count)]
    at = _LENGTH.size * (1 + count)
    frames = []
    for n in sizes:
        frames.append(blob[at : at + n])
        at += n
    return frames
