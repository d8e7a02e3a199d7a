"""A TCP port for a test's server that no other process of the suite is handed.

``bind(("127.0.0.1", 0))`` and close returns a port from the kernel's ephemeral range,
the range every outgoing connection also draws its local port from: under pytest-xdist
another worker's clients (or its own server picked the same way) can take that port
between the pick and the server's bind ("Address already in use", seen under ``-n 2``).
So ports come from below the ephemeral range, in a block of its own for each xdist
worker, and each is checked bindable before it is handed out.
"""

from __future__ import annotations

import itertools
import os
import socket

_BASE, _BLOCK = 20000, 1000   # worker k: [20000 + 1000 k, 20000 + 1000 (k + 1))


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")   # "gwN"; unset: one process
    return int(name[2:]) if name[2:].isdigit() else 0


def _candidates():
    start = _BASE + _BLOCK * (_worker() % 12)
    # start each process at its own offset in the block: a rerun soon after does not
    # meet the previous run's ports in TIME_WAIT
    first = os.getpid() % _BLOCK
    return itertools.cycle([start + (first + i) % _BLOCK for i in range(_BLOCK)])


_ports = _candidates()


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that no other worker of this run picks."""
    for _ in range(_BLOCK):
        port = next(_ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in worker {_worker()}'s block from {_BASE}")


def free_base_port(n: int) -> int:
    """A port p with p .. p + n - 1 bindable now, all in this worker's block (mlx.launch
    counts up from ``--starting-port``)."""
    for _ in range(_BLOCK):
        base = free_port()
        if base + n > _BASE + _BLOCK * (_worker() % 12 + 1):
            continue   # the run would leave this worker's block
        socks = []
        try:
            for k in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports in worker {_worker()}'s block")
