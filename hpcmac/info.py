"""``python -m hpcmac info``: what this job runs on, printed once by rank 0."""

from __future__ import annotations

import platform
import socket

from hpcmac.errors import ArgumentParser, run_cli


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

    import numpy
    import scipy

    os.environ.setdefault("HPCMAC_QUIET_TRANSPORT", "1")
    from hpcmac import __version__, comm

    world = comm.init(args.transport, args.transport_strict)
    from mpi4py import MPI

    hosts = world.allgather_obj(socket.gethostname())
    seen = world.allgather_obj([(n, ok) for n, ok, _ in transports(world)])
    if world.rank != 0:
        return 0
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
    print(f"mlx          {_mlx()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
