"""A silent peer ends the job in seconds, whatever the kernel's TCP settings.

With Linux's default ``net.ipv4.tcp_retries2=15`` a blackholed link (packets
dropped, no error) leaves MPI's TCP connections retransmitting for about 15
minutes, and a stopped (SIGSTOP) rank is never noticed at all. So every rank
of a multi-rank job runs a small thread that sends a UDP datagram to its
peers every ``period`` seconds and watches theirs; a peer silent for
``timeout`` seconds (``HPCMAC_HEARTBEAT_TIMEOUT``, default 30; 0 switches the
watch off) ends this rank with one line naming both ranks and hosts::

    error: rank 1 (mac2.local): no heartbeat from rank 2 (mac3.local) for 30 s: the link
    between them or that host is down (HPCMAC_HEARTBEAT_TIMEOUT=30)

and exit code 1, without MPI_Finalize; the launcher then ends the other ranks
(both ends of a dead link notice it). The datagrams take the same path as
MPI's traffic where the hostfile says so (the job's hostfile, handed to ``start``: the peer's
address on the cable between the two hosts, else its ``ips``); ranks on one
host use the loopback address. Jobs of more than :data:`ALL_PAIRS` ranks
watch their ring neighbours and the ranks at power-of-two distances only.

A rank that finishes says goodbye first (:func:`stop`, called before
MPI_Finalize), so a peer that waits long in MPI_Finalize (which holds the GIL,
silencing this thread) is not taken for dead.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

from hpcmac.comm.base import Group

#: jobs up to this many ranks watch every pair
ALL_PAIRS = 64
_MAGIC = b"hpcHB1"
_HELLO, _BYE = 1, 2
_PACKET = struct.Struct("!6s8sBi")  # magic, job cookie, kind, rank

_running: list[_Watch] = []


def timeout_from_env() -> float:
    """``HPCMAC_HEARTBEAT_TIMEOUT`` in seconds (default 30; 0 = off); bad values: default."""
    raw = os.environ.get("HPCMAC_HEARTBEAT_TIMEOUT", "").strip()
    try:
        value = float(raw) if raw else 30.0
    except ValueError:
        return 30.0
    return value if value == value and value >= 0 else 30.0


def peers_of(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` watches (and sends to): all others in small jobs, else its ring
    neighbours and the ranks at power-of-two distances both ways (pure)."""
    if size <= ALL_PAIRS:
        return [r for r in range(size) if r != rank]
    out = set()
    step = 1
    while step < size:
        out.add((rank + step) % size)
        out.add((rank - step) % size)
        step *= 2
    out.discard(rank)
    return sorted(out)


def _host_in(hf, hostname: str) -> str | None:
    """The hostfile's name for the machine called ``hostname`` (by name or ssh), or None."""
    short = hostname.split(".")[0]
    for h in hf.hosts:
        machine = h.ssh.split("@")[-1]
        if hostname in (h.name, machine) or short in (h.name, machine.split(".")[0]):
            return h.name
    return None


def _address(hf, me: str | None, peer: str | None, peer_hostname: str,
             same_host: bool) -> str | None:
    """Where to send ``peer``'s heartbeats: loopback on one host, the cable between the
    hosts, the peer's management address, else its host name resolved."""
    if same_host:
        return "127.0.0.1"
    if hf is not None and me is not None and peer is not None:
        lk = hf.link_between(me, peer)
        if lk is not None:
            return lk.end_of(peer).addr
        ips = hf.host(peer).ips
        if ips:
            return ips[0]
    try:
        addr = socket.gethostbyname(peer_hostname)
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


class _Watch:
    def __init__(self, group: Group, period: float, timeout: float, hf=None):
        self.rank = group.rank
        self.period, self.timeout = period, timeout
        hostname = socket.gethostname()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        port = self.sock.getsockname()[1]
        cookie = os.urandom(8) if group.rank == 0 else None
        # collective: every rank of the group takes part
        cookie = group.bcast_obj(cookie, 0)
        everyone = group.allgather_obj((hostname, port))
        self.cookie = cookie
        self.hosts = [h for h, _ in everyone]
        names = [_host_in(hf, h) if hf is not None else None for h in self.hosts]
        me = names[group.rank]
        self.targets: dict[int, tuple[str, int]] = {}
        for r in peers_of(group.rank, group.size):
            addr = _address(hf, me, names[r], self.hosts[r], self.hosts[r] == hostname)
            if addr is not None:
                self.targets[r] = (addr, everyone[r][1])
        now = time.monotonic()
        self.last = {r: now for r in self.targets}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="hpcmac-heartbeat")
        self.thread.start()

    def _send(self, kind: int) -> None:
        data = _PACKET.pack(_MAGIC, self.cookie, kind, self.rank)
        for addr in self.targets.values():
            try:
                self.sock.sendto(data, addr)
            except OSError:  # unreachable now: silence is what the peer will judge
                pass

    def _run(self) -> None:
        next_send = 0.0
        while not self.stopped.is_set():
            now = time.monotonic()
            if now >= next_send:
                self._send(_HELLO)
                next_send = now + self.period
            self.sock.settimeout(max(0.01, next_send - now))
            try:
                self._take(self.sock.recvfrom(64)[0])
                # everything queued while this thread could not run (GIL held elsewhere)
                self.sock.setblocking(False)
                while True:
                    self._take(self.sock.recvfrom(64)[0])
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                return
            now = time.monotonic()
            for rank, seen in list(self.last.items()):
                if now - seen > self.timeout and not self.stopped.is_set():
                    self._fail(rank, now - seen)

    def _take(self, data: bytes) -> None:
        if len(data) != _PACKET.size:
            return
        magic, cookie, kind, rank = _PACKET.unpack(data)
        if magic == _MAGIC and cookie == self.cookie and rank in self.last:
            if kind == _BYE:
                del self.last[rank]
            else:
                self.last[rank] = time.monotonic()

    def _fail(self, rank: int, silent: float) -> None:
        from hpcmac.interrupts import die

        die(f"error: rank {self.rank} ({self.hosts[self.rank]}): no heartbeat from rank "
            f"{rank} ({self.hosts[rank]}) for {silent:.0f} s: the link between them or that "
            f"host is down (HPCMAC_HEARTBEAT_TIMEOUT={self.timeout:g})", 1)

    def stop(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        for _ in range(2):  # datagrams may be lost: say it twice
            self._send(_BYE)
        try:  # wake our own thread from recvfrom (else the join waits up to a period: ~0.5 s
            # of every job's exit); a datagram of the wrong size is ignored by _take
            self.sock.sendto(b"", ("127.0.0.1", self.sock.getsockname()[1]))
        except OSError:
            pass
        self.thread.join(timeout=2 * self.period + 1)
        self.sock.close()


def start(group: Group, period: float = 1.0, timeout: float | None = None,
          hostfile=None) -> None:
    """Collective over ``group``: start watching its ranks (no-op for one rank, or when
    ``HPCMAC_HEARTBEAT_TIMEOUT=0``). Idempotent per process. ``hostfile`` (global): the
    job's parsed hostfile, when it has one (heartbeats then take the cables)."""
    timeout = timeout_from_env() if timeout is None else timeout
    if group.size <= 1 or timeout <= 0 or _running:
        return
    period = min(period, timeout / 4)
    from hpcmac.comm import cleanup

    cleanup.before_finalize(stop)
    _running.append(_Watch(group, period, timeout, hostfile))


def stop() -> None:
    """Say goodbye to the peers and stop watching (before MPI_Finalize; idempotent)."""
    while _running:
        _running.pop().stop()


def running() -> bool:
    return bool(_running)


