"""``python -m hpcmac.bench.comm``: OSU-style microbenchmarks per transport vs raw mpi4py.

Run under mpirun (at least 2 ranks for latency and bandwidth)::

    tools/mpirun 2 .venv/bin/python -m hpcmac.bench.comm [--json FILE] [--quick]

* latency: ping-pong between ranks 0 and 1, half the round trip (1 B .. 1 MiB);
* bandwidth: rank 0 streams a window of isends to rank 1, which answers each
  window with a 4-byte ack (1 KiB .. 64 MiB);
* bcast, allreduce (sum of float64), allgather: time per call on all ranks,
  the slowest rank's mean (8 B .. 1 MiB per rank).

Every number for the shim is measured in the same run as raw mpi4py on the
same buffers, interleaved round by round (raw, shim, shim, raw, ...); every
iteration is timed and a row shows the median over all iterations of all
rounds (the timer adds ~0.1 us to each latency sample, raw and shim alike).
The MLX transports (ring, rdma) are measured on collectives only: their
point-to-point goes over MPI under mpirun.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import sys
import time
from functools import partial

import numpy as np

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import check_on_root, output_path
from hpcmac.lifecycle import run_cli

KiB, MiB = 1 << 10, 1 << 20


def _sizes(lo: int, hi: int, step: int = 2) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= step
    return out


def _fmt_size(n: int) -> str:
    if n >= MiB:
        return f"{n // MiB} MiB"
    if n >= KiB:
        return f"{n // KiB} KiB"
    return f"{n} B"


# -- kernels: each returns seconds for its loop; rank 0's number is the one used ---------

def pingpong(send, recv, buf: np.ndarray, iters: int, rank: int) -> list[float]:
    """Half of each round trip between ranks 0 and 1, one sample per iteration."""
    if rank > 1:
        return [0.0]
    peer, clock = 1 - rank, time.perf_counter
    samples = [0.0] * iters
    if rank == 0:
        for i in range(iters):
            t = clock()
            send(buf, peer, 1)
            recv(buf, peer, 1)
            samples[i] = (clock() - t) / 2
    else:
        for i in range(iters):
            t = clock()
            recv(buf, peer, 1)
            send(buf, peer, 1)
            samples[i] = (clock() - t) / 2
    return samples


def stream(isend, irecv, waitall, send, recv, buf: np.ndarray, window: int, iters: int,
           rank: int) -> list[float]:
    """Seconds per window of isends from rank 0 to 1 and its ack (OSU osu_bw pattern)."""
    if rank > 1:
        return [0.0]
    ack = np.zeros(1, dtype=np.int32)
    clock, samples = time.perf_counter, [0.0] * iters
    for i in range(iters):
        t = clock()
        if rank == 0:
            waitall([isend(buf, 1, 2) for _ in range(window)])
            recv(ack, 1, 3)
        else:
            waitall([irecv(buf, 0, 2) for _ in range(window)])
            send(ack, 0, 3)
        samples[i] = clock() - t
    return samples


def collective(call, iters: int) -> list[float]:
    """Seconds per call, one sample per call."""
    clock, samples = time.perf_counter, [0.0] * iters
    for i in range(iters):
        t = clock()
        call()
        samples[i] = clock() - t
    return samples


class Raw:
    """Raw mpi4py on COMM_WORLD, the reference."""

    name = "raw mpi4py"

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.send, self.recv = self.comm.Send, self.comm.Recv
        self.isend, self.irecv = self.comm.Isend, self.comm.Irecv
        self.waitall = MPI.Request.Waitall

    def ops(self, buf: np.ndarray, out: np.ndarray, gathered: np.ndarray) -> dict:
        c, MPI = self.comm, self.MPI
        return {"bcast": lambda: c.Bcast(buf, 0),
                "allreduce": lambda: c.Allreduce(buf, out, MPI.SUM),
                "allgather": lambda: c.Allgather(buf, gathered)}


class Shim:
    """A ``hpcmac.comm`` Group."""

    def __init__(self, group):
        self.g, self.name = group, group.transport
        self.send, self.recv = group.send, group.recv
        self.isend, self.irecv = group.isend, group.irecv
        self.waitall = group.waitall

    def ops(self, buf: np.ndarray, out: np.ndarray, gathered: np.ndarray) -> dict:
        g = self.g
        return {"bcast": lambda: g.bcast(buf, 0),
                "allreduce": lambda: g.allreduce(buf, "sum", out),
                "allgather": lambda: g.allgather(buf, gathered)}


def _median_rounds(world, fns: list, rounds: int) -> list[float]:
    """Run each fn once per round, alternating their order; per fn the median of all its
    samples (robust to a rank being descheduled on a shared machine), slowest rank's."""
    times = [[] for _ in fns]
    for fn in fns:  # warm-up: first touches, connection set-up, lazy allocations
        world.barrier()
        fn()
    for k in range(rounds):
        order = range(len(fns)) if k % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            world.barrier()
            times[i].extend(fns[i]())
    med = np.array([statistics.median(t) for t in times])
    return [float(x) for x in world.allreduce(med, "max")]


def _iters(size: int, quick: bool, small: int, large: int) -> int:
    n = small if size <= 8 * KiB else max(large, int(small * 8 * KiB / size))
    return max(2, n // 10) if quick else n


def run(world, impls: list, p2p_impls: list, args) -> dict:
    """All measurements; collective over ``world``. Returns the report dict."""
    rank, rounds = world.rank, args.rounds
    report: dict = {"latency": [], "bandwidth": [], "collectives": []}
    if world.size >= 2:
        for size in _sizes(1, args.max_latency):
            buf = np.zeros(size, dtype=np.uint8)
            iters = _iters(size, args.quick, 1000, 50)
            fns = [partial(pingpong, m.send, m.recv, buf, iters, rank) for m in p2p_impls]
            t = _median_rounds(world, fns, rounds)
            report["latency"].append({"bytes": size, **{m.name: t[i] * 1e6
                                                        for i, m in enumerate(p2p_impls)}})
        for size in _sizes(args.min_bandwidth, args.max_bandwidth):
            buf = np.zeros(size, dtype=np.uint8)
            window = max(1, min(64, (64 * MiB) // size))
            # up to 40 windows, at most ~256 MiB per measurement (4 windows when --quick)
            iters = max(2, min(4 if args.quick else 40, (256 * MiB) // (size * window)))
            fns = [partial(stream, m.isend, m.irecv, m.waitall, m.send, m.recv, buf, window,
                           iters, rank) for m in p2p_impls]
            t = _median_rounds(world, fns, rounds)
            report["bandwidth"].append({"bytes": size, "window": window, **{
                m.name: size * window / t[i] / 1e6 for i, m in enumerate(p2p_impls)}})
    for op in ("bcast", "allreduce", "allgather"):
        for size in _sizes(8, args.max_collective, 4):
            buf = np.ones(size // 8, dtype=np.float64)
            out = np.empty_like(buf)
            gathered = np.empty((world.size, *buf.shape), dtype=buf.dtype)
            iters = _iters(size, args.quick, 200, 10)
            fns = [partial(collective, impl.ops(buf, out, gathered)[op], iters) for impl in impls]
            t = _median_rounds(world, fns, rounds)
            report["collectives"].append({"op": op, "bytes": size, **{
                impl.name: t[i] * 1e6 for i, impl in enumerate(impls)}})
    return report


def verdict(report: dict) -> dict:
    """The performance criterion: shim mpi vs raw mpi4py in the same run."""
    out: dict = {}
    big = [r for r in report["bandwidth"] if r["bytes"] >= 64 * KiB]
    if big:
        ratios = [r["mpi"] / r["raw mpi4py"] for r in big]
        out["bandwidth_ratio_min_ge_64KiB"] = min(ratios)
        out["bandwidth_ratio_median_ge_64KiB"] = statistics.median(ratios)
        out["bandwidth_within_5pct"] = bool(statistics.median(ratios) >= 0.95)
    small = [r for r in report["latency"] if r["bytes"] <= KiB]
    if small:
        added = [r["mpi"] - r["raw mpi4py"] for r in small]
        out["latency_added_us_median_le_1KiB"] = statistics.median(added)
        out["latency_added_us_max_le_1KiB"] = max(added)
        out["latency_within_2us"] = bool(statistics.median(added) <= 2.0)
    return out


def print_tables(report: dict, names: list[str], p2p_names: list[str], info: dict) -> None:
    ref = "raw mpi4py"
    print(f"# hpcmac comm benchmark: {info['ranks']} ranks on {info['hosts']} host(s), "
          f"{info['mpi']}; per-iteration medians over {info['rounds']} interleaved rounds")
    if report["latency"]:
        print("\n## ping-pong latency, us (half round trip, ranks 0 <-> 1)")
        print(f"{'size':>8} " + " ".join(f"{n:>12}" for n in p2p_names) + f" {'added':>8}")
        for r in report["latency"]:
            added = r["mpi"] - r[ref]
            print(f"{_fmt_size(r['bytes']):>8} " + " ".join(f"{r[n]:12.2f}" for n in p2p_names)
                  + f" {added:8.2f}")
        print("\n## streaming bandwidth, MB/s (window of isends, rank 0 -> 1)")
        print(f"{'size':>8} {'window':>6} " + " ".join(f"{n:>12}" for n in p2p_names)
              + f" {'ratio':>6}")
        for r in report["bandwidth"]:
            print(f"{_fmt_size(r['bytes']):>8} {r['window']:>6} "
                  + " ".join(f"{r[n]:12.1f}" for n in p2p_names) + f" {r['mpi'] / r[ref]:6.3f}")
    print("\n## collectives, us per call (slowest rank; allreduce = sum of float64)")
    print(f"{'op':>10} {'size':>8} " + " ".join(f"{n:>12}" for n in names)
          + " " + " ".join(f"{n + '/raw':>10}" for n in names if n != ref))
    for r in report["collectives"]:
        print(f"{r['op']:>10} {_fmt_size(r['bytes']):>8} "
              + " ".join(f"{r[n]:12.2f}" for n in names)
              + " " + " ".join(f"{r[n] / r[ref]:10.2f}" for n in names if n != ref))
    v = report.get("verdict", {})
    if v:
        print("\n## criterion: shim mpi vs raw mpi4py, same run")
        if "bandwidth_ratio_median_ge_64KiB" in v:
            print(f"bandwidth >= 64 KiB: median ratio {v['bandwidth_ratio_median_ge_64KiB']:.3f}, "
                  f"min {v['bandwidth_ratio_min_ge_64KiB']:.3f} (goal >= 0.95): "
                  f"{'PASS' if v['bandwidth_within_5pct'] else 'FAIL'}")
        if "latency_added_us_median_le_1KiB" in v:
            print(f"latency added <= 1 KiB: median {v['latency_added_us_median_le_1KiB']:.2f} us, "
                  f"max {v['latency_added_us_max_le_1KiB']:.2f} us (goal <= 2 us): "
                  f"{'PASS' if v['latency_within_2us'] else 'FAIL'}")
    for name, why in info["skipped"].items():
        print(f"not measured: {name} ({why})")


def _size_arg(text: str) -> int:
    t = text.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": KiB, "M": MiB}.get(t[-1:], 1)
    try:
        return int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64K, 1M)") from None


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m hpcmac.bench.comm", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=output_path,
                        metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--transports", default="mpi,ring,rdma",
                        help="shim transports to measure when usable (default: mpi,ring,rdma)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--quick", action="store_true", help="few iterations, small sizes (tests)")
    parser.add_argument("--max-latency", type=_size_arg, default=None, help="default 1M")
    parser.add_argument("--min-bandwidth", type=_size_arg, default=KiB, help="default 1K")
    parser.add_argument("--max-bandwidth", type=_size_arg, default=None, help="default 64M")
    parser.add_argument("--max-collective", type=_size_arg, default=None, help="default 1M")
    args = parser.parse_args(argv)
    quick = args.quick
    args.max_latency = args.max_latency or (4 * KiB if quick else MiB)
    args.max_bandwidth = args.max_bandwidth or (256 * KiB if quick else 64 * MiB)
    args.max_collective = args.max_collective or (4 * KiB if quick else MiB)
    if args.rounds < 1:
        raise UsageError(f"--rounds must be >= 1, got {args.rounds}")
    from hpcmac import comm

    wanted = [t.strip() for t in args.transports.split(",") if t.strip()]
    for t in wanted:
        if t not in ("mpi", "ring", "rdma"):
            raise UsageError(f"--transports: {t!r} is not one of mpi, ring, rdma")
    from hpcmac.launch.hostfile import job_hostfile

    hostfile = job_hostfile()
    world = comm.init("mpi", announce=False, hostfile=hostfile)
    check_on_root(world, args.json, "--json")  # before any measurement
    comm.announce()
    impls, skipped = [Raw()], {}
    for t in wanted:
        try:
            group = world if t == "mpi" else comm.init(t, strict=True, hostfile=hostfile)
            impls.append(Shim(group))
        except UsageError as exc:  # agreed on every rank by init
            skipped[t] = str(exc)
    p2p = [m for m in impls if m.name in ("raw mpi4py", "mpi")]
    if "mpi" not in wanted:
        p2p = []
    if world.size < 2:
        skipped["latency, bandwidth"] = "need 2 ranks"
    from mpi4py import MPI

    info = {"ranks": world.size, "hosts": len(set(world.allgather_obj(socket.gethostname()))),
            "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "python": platform.python_version(), "machine": platform.platform(),
            "rounds": args.rounds, "skipped": skipped}
    report = run(world, impls, p2p, args)
    report["verdict"] = verdict(report) if p2p else {}
    if world.rank == 0:
        print_tables(report, [m.name for m in impls], [m.name for m in p2p], info)
        if args.json:
            from hpcmac.io.outputs import write_atomic

            write_atomic(args.json, json.dumps({"info": info, **report}, indent=1), what="--json")
            print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
