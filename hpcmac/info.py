"""``python -m hpcmac info``: what this job runs on, printed once by rank 0."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

from hpcmac.errors import ArgumentParser
from hpcmac.lifecycle import run_cli


def _blas() -> list[str]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ["threadpoolctl not installed"]
    import numpy  # noqa: F401  (loads the BLAS so threadpoolctl sees it)
    import scipy.linalg  # noqa: F401

    lines = []
    for pool in threadpool_info():
        if pool.get("user_api") != "blas":
            continue
        lines.append(
            f"{pool.get('internal_api')} {pool.get('version')} "
            f"kernel={pool.get('architecture')} threads={pool.get('num_threads')} "
            f"({pool.get('filepath')})"
        )
    return lines or ["no BLAS found by threadpoolctl"]


def _mlx() -> str:
    try:
        import mlx.core as mx
    except Exception as exc:
        return f"not importable ({type(exc).__name__})"
    return f"{mx.__version__}, device {mx.default_device()}"


def transports(world) -> list[tuple[str, bool, str]]:
    """(name, usable, reason) for every transport, as this rank sees it (not collective)."""
    from hpcmac.comm.mpi import is_available as mpi_ok

    rows = [("mpi", *mpi_ok())]
    try:
        from hpcmac.comm import mlx as mlx_backend

        for name in ("rdma", "ring"):
            rows.append((name, *mlx_backend.is_available(name)))
    except ImportError as exc:
        rows += [("rdma", False, f"rdma: {exc}"), ("ring", False, f"ring: {exc}")]
    rows.append(("local", True, "size-1 group"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m hpcmac info", description=__doc__)
    from hpcmac.comm import add_transport_argument

    add_transport_argument(parser)
    args = parser.parse_args(argv)

    import os

    ready = _process_age()
    had_numpy = "numpy" in sys.modules
    t0 = time.perf_counter()
    import numpy

    t_numpy = None if had_numpy else time.perf_counter() - t0
    os.environ.setdefault("HPCMAC_QUIET_TRANSPORT", "1")
    from hpcmac import __version__, comm
    from hpcmac.comm import mpi_start

    t0 = time.perf_counter()
    from hpcmac.launch.hostfile import job_hostfile

    world = comm.init(args.transport, args.transport_strict, hostfile=job_hostfile())
    t_init = time.perf_counter() - t0
    MPI = mpi_start.load()
    t0 = time.perf_counter()
    import scipy.linalg

    t_scipy = time.perf_counter() - t0
    t0 = time.perf_counter()
    mlx_line = _mlx()
    t_mlx = time.perf_counter() - t0
    times = dict(ready=ready, numpy=t_numpy, init=t_init,
                 mpi=mpi_start.STARTUP.get("mpi_import_s", 0.0), scipy=t_scipy, mlx=t_mlx)
    hosts = world.allgather_obj(socket.gethostname())
    seen = world.allgather_obj([(n, ok) for n, ok, _ in transports(world)])
    all_times = world.allgather_obj(times)
    if world.rank != 0:
        return 0
    scipy = sys.modules["scipy"]
    py = f"python {platform.python_version()}, {platform.platform()}"
    print(f"hpcmac       {__version__}  ({py})")
    print(f"MPI          {MPI.Get_library_version().splitlines()[0].strip()}")
    standard = ".".join(map(str, MPI.Get_version()))
    print(f"mpi4py       {__import__('mpi4py').__version__}, MPI standard {standard}")
    print(f"ranks        {world.size} on {len(set(hosts))} host(s)")
    for r, h in enumerate(hosts):
        print(f"  rank {r:<4} {h}")
    rows = transports(world)
    for i, (name, _ok, why) in enumerate(rows):
        everywhere = all(s[i][1] for s in seen)
        state = "usable on every rank" if everywhere else ("not usable: " + (why or "on some rank"))
        print(f"transport    {name:<6} {state}")
    print(f"chosen       {world.transport}")
    from hpcmac import blas_threads

    print(f"BLAS threads {blas_threads.describe()}")
    for line in _blas():
        print(f"BLAS         {line}")
    print(f"numpy        {numpy.__version__}")
    print(f"scipy        {scipy.__version__}")
    print(f"mlx          {mlx_line}")
    if not mlx_line.startswith("not importable"):
        from hpcmac.llm.parallel.host_syncs import HYBRID_RULE

        print(f"mlx groups   {HYBRID_RULE}")
    ompi = {k: os.environ[k] for k in ("OMPI_MCA_btl", "OMPI_MCA_mtl", "OMPI_MCA_pml")
            if k in os.environ}
    for line in startup_lines(all_times, ompi, bool(mpi_start.STARTUP.get("ompi_defaults"))):
        print(line)
    return 0


def _process_age() -> float | None:
    """Seconds since this process started (Linux /proc), None elsewhere."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def startup_lines(all_times: list[dict], ompi: dict, ours: bool) -> list[str]:
    """Where a rank's start-up seconds go, slowest rank per item (pure).

    ``ompi``: the Open MPI variables in effect; ``ours``: hpcmac set them (else the
    environment or the launcher did).
    """
    def worst(key: str) -> float | None:
        vals = [t[key] for t in all_times if t[key] is not None]
        return max(vals) if vals else None

    lines = []
    if worst("ready") is not None:
        lines.append(f"start-up     {worst('ready'):.2f} s from process start to `info` running "
                     "(interpreter, hpcmac, numpy, argument parsing)")
    numpy_part = (f"import numpy {worst('numpy'):.3f} s, " if worst("numpy") is not None
                  else "")
    lines.append(f"start-up     {numpy_part}comm.init {worst('init'):.3f} s, mpi4py + MPI_Init "
                 f"{worst('mpi'):.3f} s")
    settings = " ".join(f"{k}={v}" for k, v in ompi.items())
    who = ("set by hpcmac: no RDMA device here; HPCMAC_OMPI_DEFAULTS=0 keeps Open MPI's own"
           if ours else "from the environment or the launcher")
    lines.append("start-up     Open MPI settings: "
                 + (f"{settings} ({who})" if settings else "Open MPI's own"))
    lines.append(f"start-up     not needed by HPL: import scipy.linalg {worst('scipy'):.3f} s, "
                 f"mlx {worst('mlx'):.3f} s (slowest rank for each)")
    return lines


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
