"""A cluster to predict: nodes (their rates), ranks per node, and the links between them.

Built from command-line names (``--machine m3-ultra --nodes 4 --link tb5-rdma``)
or from a hostfile (hosts with ``machine``, ``memory_gb``, ``slots``; a
top-level ``"link"`` naming the link type), then overridden by measurements:
a calibration JSON (``python -m hpcmac.plan calibrate``) for the nodes and a
``python -m hpcmac.bench.comm --json`` report for the link. Pure apart from
reading those files; every problem is one :class:`~hpcmac.errors.UsageError` line.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

from hpcmac.errors import UsageError
from hpcmac.plan import machines as mc
from hpcmac.plan.machines import Link, Rates

#: ranks on one host talk through shared memory when nothing was measured
SHARED_MEMORY = Link("shared-memory", 1e-6, 10e9, "assumed")


@dataclass(frozen=True)
class Node:
    """One host: its rates and how many ranks it runs."""

    name: str
    rates: Rates
    slots: int = 1


@dataclass(frozen=True)
class Cluster:
    """Nodes in launch order, the link type between nodes, and the one inside a node."""

    nodes: tuple[Node, ...]
    link: Link
    local: Link = SHARED_MEMORY
    blas_threads: int | None = None   # per rank; None: the node's cores split by its ranks

    @property
    def ranks(self) -> int:
        return sum(n.slots for n in self.nodes)

    def placement(self, nranks: int) -> list[int]:
        """Node index of each rank: by slot, in host order (mpirun's default mapping)."""
        out: list[int] = []
        for i, n in enumerate(self.nodes):
            out += [i] * n.slots
        if nranks > len(out):
            raise UsageError(f"{nranks} ranks asked for but the cluster has {len(out)} slots "
                             "(add hosts or raise 'slots')")
        return out[:nranks]

    def threads(self, node: Node, ranks_here: int) -> int:
        """BLAS threads per rank on ``node`` (as hpcmac.hpl chooses them)."""
        if self.blas_threads:
            return self.blas_threads
        return max(1, node.rates.cores // max(1, ranks_here))

    def with_nodes(self, k: int) -> Cluster:
        """The same kind of cluster cut or grown to ``k`` nodes (repeats the last node)."""
        nodes = list(self.nodes[:k])
        while len(nodes) < k:
            last = self.nodes[-1]
            nodes.append(replace(last, name=f"{last.name}+{len(nodes)}"))
        return replace(self, nodes=tuple(nodes))


def _calibrated(rates: Rates, cal: dict[str, Any], where: str) -> Rates:
    """``rates`` with the measured values of a calibration JSON put in."""
    def table(key: str) -> dict[int, float]:
        raw = cal.get(key)
        if not isinstance(raw, dict) or not raw:
            raise UsageError(f"{where}: field {key!r} should be an object of cores -> value "
                             "(write it with: python -m hpcmac.plan calibrate --json FILE)")
        try:
            return {int(k): float(v) for k, v in raw.items()}
        except (TypeError, ValueError):
            raise UsageError(f"{where}: field {key!r} has a non-numeric entry") from None

    kw: dict[str, Any] = {"dgemm": table("dgemm_gflops"), "mem_bw": table("mem_bw_gbs"),
                          "name": str(cal.get("name", rates.name)), "source": "calibrated"}
    if "dgemm_k" in cal:
        kw["dgemm_k"] = table("dgemm_k")
    if "cores" in cal:
        kw["cores"] = int(cal["cores"])
    if "memory_gb" in cal:
        kw["memory_gb"] = float(cal["memory_gb"])
    panel = cal.get("panel")
    if isinstance(panel, dict):
        kw["panel_col_s"] = float(panel.get("col_s", rates.panel_col_s))
        if panel.get("gflops"):
            kw["panel_gflops"] = float(panel["gflops"])
    for key in ("layer_s", "token_s", "stream_eff"):
        if key in cal:
            kw[key] = float(cal[key])
    tensor = cal.get("tensor")
    if tensor is not None:
        try:
            kw["reduce_s"] = float(tensor["reduce_s"])
            kw["tp_step_s"] = float(tensor["step_s"])
            kw["tp_sync_frac"] = float(tensor["sync_frac"])
        except (TypeError, ValueError, KeyError):
            raise UsageError(f"{where}: field 'tensor' should be an object with numbers "
                             "'reduce_s', 'step_s' and 'sync_frac' (write it with: python -m "
                             "hpcmac.plan calibrate --json FILE)") from None
        if not all(math.isfinite(kw[k]) and kw[k] >= 0
                   for k in ("reduce_s", "tp_step_s", "tp_sync_frac")):
            raise UsageError(f"{where}: field 'tensor': 'reduce_s', 'step_s' and "
                             "'sync_frac' must be numbers >= 0")
        if "hop_s" in tensor:  # the pipeline's, from the same job (absent in older files)
            try:
                hop = float(tensor["hop_s"])
            except (TypeError, ValueError):
                hop = math.nan
            if not (math.isfinite(hop) and hop >= 0):
                raise UsageError(f"{where}: field 'tensor': 'hop_s' must be a number >= 0")
            kw["hop_s"] = hop
    for key, name in (("read_bw_gbs", "read_bw"), ("sgemm_gflops", "sgemm")):
        if key in cal:
            kw[name] = table(key)
    return replace(rates, **kw)


def read_json(path: str, what: str) -> Any:
    """A hostfile or calibration, read by the bounded reader (a regular file of at most
    1 MiB, strict UTF-8: ``/dev/zero`` or a FIFO is refused at once) and parsed strictly."""
    from hpcmac.io.inputs import parse_json, read_text

    return parse_json(read_text(path, what), str(path))


def calibration_rates(path: str) -> Rates:
    """A node measured by ``python -m hpcmac.plan calibrate --json``."""
    cal = read_json(path, "calibration")
    if not isinstance(cal, dict):
        raise UsageError(f"{path}: expected a JSON object from 'python -m hpcmac.plan calibrate'")
    base = Rates(name="calibrated", cores=1, memory_gb=0.0, dgemm={1: 1.0}, mem_bw={1: 1.0})
    rates = _calibrated(base, cal, path)
    if rates.memory_gb <= 0:
        raise UsageError(f"{path}: field 'memory_gb' missing or not positive")
    return rates


def comm_link(path: str, name: str = "measured") -> tuple[Link, int]:
    """(alpha-beta link, hosts) from a ``python -m hpcmac.bench.comm --json`` report.

    alpha: median half round trip of messages <= 64 bytes; beta: the median
    streaming bandwidth of messages >= 1 MiB (else the largest measured).
    """
    rep = read_json(path, "bench.comm report")
    if not isinstance(rep, dict) or not rep.get("latency") or not rep.get("bandwidth"):
        raise UsageError(f"{path}: no 'latency'/'bandwidth' rows; measure with 2 ranks: "
                         "mpirun -np 2 python -m hpcmac.bench.comm --json FILE")
    key = "mpi" if "mpi" in rep["latency"][0] else "raw mpi4py"
    try:
        small = [r[key] for r in rep["latency"] if r["bytes"] <= 64]
        rows = sorted(rep["bandwidth"], key=lambda r: r["bytes"])
        big = [r[key] for r in rows if r["bytes"] >= 1 << 20] or [rows[-1][key]]
        alpha = statistics.median(small) * 1e-6
        beta = statistics.median(big) * 1e6
    except (KeyError, TypeError, statistics.StatisticsError):
        raise UsageError(f"{path}: latency/bandwidth rows lack bytes or {key!r} values") from None
    hosts = int((rep.get("info") or {}).get("hosts", 1))
    return Link(name, alpha, beta, f"measured ({path})"), hosts


def _one_node_rates(machine: str | None, calibration: str | None, memory_gb: float | None,
                    where: str) -> Rates:
    if calibration:
        rates = calibration_rates(calibration)
        return replace(rates, memory_gb=memory_gb) if memory_gb else rates
    if not machine:
        raise UsageError(f"{where}: no machine: give --machine NAME (one of "
                         f"{', '.join(mc.MACHINES)}) or --calibration FILE")
    try:
        m = mc.machine(machine)
    except KeyError as exc:
        raise UsageError(f"{where}: {exc.args[0]}") from None
    return mc.rates_of(m, memory_gb)


def _link(name: str | None, where: str) -> Link | None:
    if name is None:
        return None
    try:
        return mc.link(name)
    except KeyError as exc:
        raise UsageError(f"{where}: {exc.args[0]}") from None


def build(*, machine: str | None = None, nodes: int = 1, link: str | None = None,
          memory_gb: list[float] | None = None, slots: int = 1, hostfile: str | None = None,
          calibration: str | None = None, comm: str | None = None,
          blas_threads: int | None = None) -> Cluster:
    """The cluster the command line describes (see the module docstring)."""
    if slots < 1:
        raise UsageError(f"--slots must be >= 1, got {slots}")
    measured, measured_hosts = comm_link(comm) if comm else (None, 0)
    if hostfile:
        cl = _from_hostfile(hostfile, machine, link, calibration)
    else:
        if nodes < 1:
            raise UsageError(f"--nodes must be >= 1, got {nodes}")
        mems = memory_gb or [None]
        if len(mems) not in (1, nodes):
            raise UsageError(f"--memory-gb: {len(mems)} values for {nodes} nodes "
                             "(give one, or one per node)")
        mems = mems * nodes if len(mems) == 1 else mems
        ns = tuple(Node(f"node{i}", _one_node_rates(machine, calibration, mems[i], "--machine"),
                        slots) for i in range(nodes))
        lk = _link(link, "--link")
        if lk is None:
            if nodes > 1 and not (measured and measured_hosts > 1):
                raise UsageError(f"{nodes} nodes but no link type: give --link NAME (one of "
                                 f"{', '.join(mc.LINKS)}) or --comm FILE measured across hosts")
            lk = SHARED_MEMORY
        cl = Cluster(ns, lk)
    if measured is not None:
        if measured_hosts > 1:
            cl = replace(cl, link=measured)
        else:
            cl = replace(cl, local=measured)
    if blas_threads is not None:
        if blas_threads < 1:
            raise UsageError(f"--blas-threads must be >= 1, got {blas_threads}")
        cl = replace(cl, blas_threads=blas_threads)
    return cl


def _from_hostfile(path: str, machine: str | None, link: str | None,
                   calibration: str | None) -> Cluster:
    from hpcmac.launch import hostfile as hfmod

    raw = read_json(path, "hostfile")
    hf = hfmod.parse(raw, path)
    problems = hfmod.validate(hf)
    if problems:
        raise UsageError(f"{path}: {problems[0]}")
    hosts_raw = raw["hosts"] if isinstance(raw, dict) else raw
    nodes = []
    for h, hr in zip(hf.hosts, hosts_raw):
        where = f"{path}: host {h.name!r}"
        name = hr.get("machine", machine) if isinstance(hr, dict) else machine
        if not name and not calibration:
            raise UsageError(f"{where}: no field 'machine' (one of {', '.join(mc.MACHINES)}); "
                             "add it, or give --machine NAME or --calibration FILE")
        if not isinstance(name, (str, type(None))):
            raise UsageError(f"{where}: field 'machine' should be a string, found {name!r}")
        rates = _one_node_rates(name if not calibration else None, calibration, h.memory_gb,
                                where)
        if h.memory_gb is None and not name and not calibration:
            raise UsageError(f"{where}: no field 'memory_gb' and no 'machine' to take it from")
        nodes.append(Node(h.name, rates, h.slots))
    lk_name = link or (raw.get("link") if isinstance(raw, dict) else None)
    lk = _link(lk_name, f"{path}: field 'link'") if lk_name else None
    if lk is None:
        if len(nodes) > 1:
            raise UsageError(f"{path}: no field 'link' (one of {', '.join(mc.LINKS)}); "
                             "add it, or give --link NAME or --comm FILE")
        lk = SHARED_MEMORY
    return Cluster(tuple(nodes), lk)
