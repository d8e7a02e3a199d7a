"""``python -m hpcmac.launch.selftest``: check a freshly launched job end to end.

Run it under the launcher (``python -m hpcmac.launch --hostfile F -- python -m
hpcmac.launch.selftest``). Every rank reports its host; then, for
``--seconds`` (at least one round), an allreduce of ``--mib`` MiB checked
against the closed form and a ring exchange of as many bytes (rank r sends to
r+1, skipped with ``--no-p2p``) checked element by element, so bytes cross
every link of a ring. Rank 0 prints one
line per host and a final line ending ``PASSED``; a wrong value aborts the job.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

import numpy as np

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.lifecycle import run_cli


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = ArgumentParser(prog="python -m hpcmac.launch.selftest", description=__doc__)
    ap.add_argument("--mib", type=float, default=4.0, help="ring exchange size per round (MiB)")
    ap.add_argument("--seconds", type=float, default=0.0,
                    help="keep exchanging for this long (for fault drills)")
    ap.add_argument("--transport", default=None, help="hpcmac transport (default: auto)")
    ap.add_argument("--no-p2p", action="store_true",
                    help="only the allreduce (what the transport itself carries)")
    a = ap.parse_args(argv)
    if a.mib < 0 or a.seconds < 0:
        raise UsageError("--mib and --seconds must not be negative")
    return a


def main(argv: list[str] | None = None) -> int:
    """Collective: every rank of the job must run it."""
    a = _args(argv)
    from hpcmac import comm
    from hpcmac.launch.hostfile import job_hostfile

    g = comm.init(a.transport, hostfile=job_hostfile())
    host = socket.gethostname()
    hosts = g.allgather_obj(host)
    if g.rank == 0:
        for r, h in enumerate(hosts):
            print(f"rank {r} on {h}", flush=True)
    n = max(1, int(a.mib * 2**20 / 8))
    send = np.arange(n, dtype=np.float64) + g.rank * 1e6  # (n,)
    recv = np.empty_like(send)
    left, right = (g.rank - 1) % g.size, (g.rank + 1) % g.size
    expect = np.arange(n, dtype=np.float64) + left * 1e6
    v = np.full(n, float(g.rank + 1))  # (n,)
    rounds, moved = 0, 0
    t0 = time.perf_counter()
    while True:
        total = g.allreduce(v, op="sum")
        if not np.all(total == g.size * (g.size + 1) / 2):
            bad = int(np.argmax(total != g.size * (g.size + 1) / 2))
            print(f"error: allreduce on {host} rank {g.rank}: element {bad} is {total[bad]}, "
                  f"expected {g.size * (g.size + 1) / 2}", file=sys.stderr)
            g.abort(3)
        if g.size > 1 and not a.no_p2p:
            req = g.irecv(recv, left)
            g.send(send, right)
            req.wait()
            if not np.array_equal(recv, expect):
                bad = int(np.argmax(recv != expect))
                print(f"error: ring exchange on {host} rank {g.rank} from rank {left}: "
                      f"element {bad} is {recv[bad]}, expected {expect[bad]}", file=sys.stderr)
                g.abort(3)
            moved += send.nbytes
        rounds += 1
        # agree on stopping so every rank makes the same number of rounds
        done = np.array([time.perf_counter() - t0 >= a.seconds], dtype=np.float64)
        if g.allreduce(done, op="min")[0] > 0:
            break
    elapsed = time.perf_counter() - t0
    g.barrier()
    if g.rank == 0:
        rate = moved / elapsed / 1e9 if elapsed > 0 else 0.0
        print(f"selftest: {g.size} ranks on {len(set(hosts))} hosts, {rounds} rounds of a "
              f"{v.nbytes / 2**20:.0f} MiB allreduce, {moved / 2**20:.0f} MiB per rank around "
              f"the ring ({rate:.2f} GB/s) ... PASSED", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
