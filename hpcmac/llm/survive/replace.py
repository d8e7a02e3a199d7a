"""Re-placement after a loss (pure): which host was lost, the hosts left, their placement.

:func:`lost_hosts` reads the job's last log lines (Open MPI's launcher, the
heartbeat, the watchdog) for the host that went; :func:`survivors_hostfile`
is the hostfile without it; :func:`replace_on` places the model on what is
left with the one pure function (:func:`~hpcmac.llm.parallel.placement.place`),
keeping the tensor width asked for where it can (a tensor group's sums are
then the fault-free run's, so greedy streams continue bit for bit) and
falling back to a pipeline over every rank left -- or raises one
:class:`~hpcmac.errors.UsageError` line saying what no longer fits.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace as dc_replace

from hpcmac.errors import UsageError
from hpcmac.llm.parallel.placement import Cluster, LayoutFlags, Placement, place
from hpcmac.llm.parallel.plan import GIB, HostMemory

# who is to blame in each kind of line: the silent or dead peer, not the one that noticed
_BLAME = [
    re.compile(r"no heartbeat from rank \d+ \(([^)\s]+)\)"),
    re.compile(r"waited [\d.]+ s for rank \d+ on (\S+?)[\s,;:]"),
    re.compile(r"rank \d+ with PID \d+ on node (\S+?) exited"),
    re.compile(r"on node (\S+?) (?:exited on signal|has exited|was killed)"),
    re.compile(r"lost connection to (?:the )?(?:node|daemon) (?:on )?(\S+?)[\s,.;:]"),
    re.compile(r"^\W*Peer host:\s+(\S+)"),  # Open MPI: a peer disconnected
]


def _canon(hosts: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Every way a host is written (name, ssh name, first label) -> its hostfile name."""
    out = {}
    for name, ssh in hosts:
        for alias in (name, ssh, ssh.split(".")[0], name.split(".")[0]):
            out.setdefault(alias, name)
    return out


def evidence(lines: Sequence[str], host: str, hosts: Sequence[tuple[str, str]]) -> list[str]:
    """The lines of ``lines`` that blame ``host`` (for /health and the log)."""
    canon = _canon(hosts)
    return [line.strip() for line in lines
            if any(canon.get(m.group(1).rstrip(".,;:")) == host
                   for pat in _BLAME for m in pat.finditer(line))]


def lost_hosts(lines: Sequence[str], hosts: Sequence[tuple[str, str]]) -> list[str]:
    """The hostfile names of the hosts the log blames, most blamed first (``hosts``: the
    job's (name, ssh) pairs). A host named by most lines is the lost one: with a
    blackholed host every peer reports it, and it reports each of them once."""
    canon = _canon(hosts)
    votes: Counter[str] = Counter()
    for line in lines:
        for pat in _BLAME:
            for m in pat.finditer(line):
                h = canon.get(m.group(1).rstrip(".,;:"))
                if h is not None:
                    votes[h] += 1
    if not votes:
        return []
    top = max(votes.values())
    return [h for h, v in votes.most_common() if v == top]


def survivors_hostfile(data: dict, keep: Sequence[str]) -> dict:
    """The hostfile JSON ``data`` with only the hosts ``keep`` and the links between them."""
    keep = set(keep)
    out = dict(data)
    out["hosts"] = [h for h in data["hosts"] if h["name"] in keep]
    if "links" in data:
        out["links"] = [lk for lk in data["links"]
                        if all(e["host"] in keep for e in lk["ends"])]
    return out


def candidates(n: int, flags: LayoutFlags) -> list[tuple[int, LayoutFlags]]:
    """(ranks, flags) to try on ``n`` ranks, in order: the flags as given when they fit
    ``n``; the asked tensor width with as many stages as fit; a pipeline over all."""
    out: list[tuple[int, LayoutFlags]] = []
    tp, pp = flags.tp, flags.pp
    if tp and pp and tp * pp == n:
        out.append((n, flags))
    elif not tp and not pp:
        out.append((n, dc_replace(flags, split=None)))
    if tp and tp > 1 and n // tp >= 1:
        out.append((tp * (n // tp), LayoutFlags(tp, n // tp, flags.tp_split, None)))
    out.append((n, LayoutFlags(1, n)))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def replace_on(cfg, sizes, hosts: Sequence[HostMemory], flags: LayoutFlags, *,
               kv_tokens: int, sequences: int, avail: int,
               lost: Sequence[str] = ()) -> tuple[Placement, LayoutFlags, list[str]]:
    """The placement on ``hosts`` (their slots, in order; ``avail``: bytes assumed free on
    a host without ``memory_gb``): (placement, the flags that give it, the hosts it uses).
    UsageError naming what is missing when no candidate fits."""
    ranks = [h.name for h in hosts for _ in range(max(1, h.slots))]
    if not ranks:
        raise UsageError("no host is left to serve on")
    first: str | None = None
    for n, fl in candidates(len(ranks), flags):
        use = ranks[:n]
        names = list(dict.fromkeys(use))
        cluster = Cluster(tuple(use), tuple(avail for _ in use),
                          tuple(h for h in hosts if h.name in names), "")
        try:
            return (place(cfg, sizes, cluster, fl, kv_tokens=kv_tokens, sequences=sequences),
                    fl, names)
        except UsageError as exc:
            first = first or str(exc)
    gone = f" after losing {', '.join(lost)}" if lost else ""
    total = sum((h.memory_gb or avail / GIB) for h in hosts)
    raise UsageError(f"the model does not fit the {len(hosts)} host(s) left{gone} "
                     f"({', '.join(h.name for h in hosts)}; {total:.2f} GiB in all): {first}")
