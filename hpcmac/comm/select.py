"""``init(transport="auto", strict=False)``: choose a transport, agree on it, cache the group."""

from __future__ import annotations

import os
import sys

from hpcmac.comm.base import Group
from hpcmac.errors import UsageError

TRANSPORTS = ("auto", "mpi", "rdma", "ring", "local")

_cached: dict[str, Group] = {}


def transport_from_env(default: str = "auto") -> str:
    return os.environ.get("HPCMAC_TRANSPORT", default) or default


def check_transport(name: str) -> str:
    if name not in TRANSPORTS:
        raise UsageError(f"unknown transport {name!r}; expected one of: {', '.join(TRANSPORTS)}")
    return name


def init(transport: str | None = None, strict: bool | None = None) -> Group:
    """Collective over the launcher's world: the Group for ``transport`` (cached).

    ``transport`` None reads ``HPCMAC_TRANSPORT`` (default "auto"); ``strict``
    None reads ``HPCMAC_TRANSPORT_STRICT``. "auto" takes rdma when every rank
    can use it, else mpi.
    """
    name = check_transport(transport or transport_from_env())
    if strict is None:
        strict = os.environ.get("HPCMAC_TRANSPORT_STRICT", "0") not in ("", "0", "false", "no")
    key = f"{name}:{int(bool(strict))}"
    if key in _cached:
        return _cached[key]
    group = _choose(name, bool(strict))
    _cached[key] = group
    return group


def _choose(name: str, strict: bool) -> Group:
    if name == "local":
        from hpcmac.comm.local import LocalGroup

        return LocalGroup()
    from hpcmac.comm.mpi import MPIGroup, is_available

    ok, why = is_available()
    if not ok:
        if strict or name != "auto":
            raise UsageError(why)
        from hpcmac.comm.local import LocalGroup

        _log(f"transport: local ({why})")
        return LocalGroup()
    world = MPIGroup()
    if name in ("mpi", "auto"):
        rejected = []
        if name == "auto":
            rejected.append(_mlx_reason(world, "rdma"))
            rejected = [r for r in rejected if r]
        if world.rank == 0 and os.environ.get("HPCMAC_QUIET_TRANSPORT") != "1":
            _log("transport: mpi" + (f" ({'; '.join(rejected)})" if rejected else ""))
        return world
    # ring / rdma: MLX distributed, bootstrapped over MPI
    reason = _mlx_reason(world, name)
    if reason:
        if strict:
            raise UsageError(reason)
        if world.rank == 0:
            _log(f"transport: mpi ({reason})")
        return world
    from hpcmac.comm import mlx as mlx_backend

    return mlx_backend.init_group(name, world)


def _mlx_reason(world: Group, name: str) -> str:
    """Agreed over ``world``: '' when every rank can use MLX ``name``, else a reason."""
    try:
        from hpcmac.comm import mlx as mlx_backend

        ok, why = mlx_backend.is_available(name)
    except ImportError as exc:
        ok, why = False, f"{name}: {exc}"
    verdicts = world.allgather_obj((ok, why))
    for good, reason in verdicts:
        if not good:
            return reason
    return ""


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
