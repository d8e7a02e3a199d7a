"""Planning a parallel run: which layers ``[start, end)`` each rank holds, and what fits.

This module is pure index and byte arithmetic, no communication and no weights
read, so it is unit-tested without MPI; :func:`agree` alone is collective. The
runtime (:mod:`.runtime`) gathers each rank's host and memory once and the
placement (:func:`hpcmac.llm.parallel.placement.place`) calls these functions
with those global inputs, so every rank holds the same split or raises the same
:class:`~hpcmac.errors.UsageError`.

The default split is proportional to each rank's memory budget: it minimises
the largest ``load_r / budget_r`` over the ranks, where the load is what the
stage reads for each token (its layers, plus the final norm and head on the
last stage), subject to every stage's bytes (the embedding on the first stage
too) fitting its budget; among the splits reaching that minimum it takes the
most even one (smallest sum of squares). See :func:`proportional_counts`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hpcmac.errors import UsageError

GIB = 1 << 30


@dataclass(frozen=True)
class StageSpec:
    """One rank's share of the model (global: every rank holds the whole list)."""

    rank: int
    start: int  # first layer held (global layer index)
    end: int  # one past the last layer held
    first: bool  # holds the token embedding
    last: bool  # holds the final norm and the LM head

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        extra = "+".join(x for x, on in (("embed", self.first), ("head", self.last)) if on)
        tail = f" +{extra}" if extra else ""
        return f"rank {self.rank}: layers [{self.start}, {self.end}){tail}"


def stages_from_counts(counts: Sequence[int]) -> list[StageSpec]:
    """The stages holding ``counts[r]`` consecutive layers each, in rank order."""
    out, start = [], 0
    for r, c in enumerate(counts):
        out.append(StageSpec(r, start, start + c, r == 0, r == len(counts) - 1))
        start += c
    return out


def check_ranks(n_layers: int, n_ranks: int) -> None:
    """Raise UsageError when ``n_ranks`` stages cannot each get at least one layer."""
    if n_ranks < 1:
        raise UsageError(f"need at least one rank, got {n_ranks}")
    if n_ranks > n_layers:
        raise UsageError(
            f"{n_ranks} ranks but the model has only {n_layers} layers: "
            f"run with at most {n_layers} ranks (each pipeline stage needs a layer)"
        )


def even_counts(n_layers: int, n_ranks: int) -> list[int]:
    """Layers per rank as even as possible; the first ``n_layers % n_ranks`` ranks get one more."""
    check_ranks(n_layers, n_ranks)
    q, rem = divmod(n_layers, n_ranks)
    return [q + (1 if r < rem else 0) for r in range(n_ranks)]


def parse_split(text: str, n_layers: int, n_ranks: int) -> list[int]:
    """Parse ``--split 10,10,6,4`` into layer counts, checked against the model and world.

    Raises UsageError (one line) when the text is not positive integers, their
    number is not the rank count, or they do not sum to the layer count.
    """
    check_ranks(n_layers, n_ranks)
    parts = [p.strip() for p in str(text).split(",")]
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise UsageError(
            f"--split {text!r}: expected comma-separated layer counts such as 10,10,6,4"
        ) from None
    if any(c < 1 for c in counts):
        raise UsageError(f"--split {text!r}: every stage needs at least one layer")
    if len(counts) != n_ranks:
        raise UsageError(
            f"--split {text!r} has {len(counts)} stages but the job has {n_ranks} ranks"
        )
    if sum(counts) != n_layers:
        raise UsageError(
            f"--split {text!r} sums to {sum(counts)} layers but the model has {n_layers}"
        )
    return counts


def stage_bytes(
    counts: Sequence[int],
    layer_bytes: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
) -> list[int]:
    """Weight bytes per rank for the split ``counts`` (layers + embedding/head where held)."""
    out, start = [], 0
    for r, c in enumerate(counts):
        b = sum(layer_bytes[start : start + c])
        if r == 0:
            b += embed_bytes
        if r == len(counts) - 1:
            b += head_bytes
        out.append(int(b))
        start += c
    return out


def proportional_counts(
    layer_bytes: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    budgets: Sequence[float],
) -> list[int]:
    """Layer counts per rank proportional to ``budgets`` (bytes), embedding and head included.

    Parameters
    ----------
    layer_bytes : bytes of each layer, in order (global; layers may differ, e.g.
        dense first layers of a mixture-of-experts model).
    embed_bytes, head_bytes : bytes of the embedding (first stage) and of the
        final norm plus LM head (last stage; a tied head counts here too, as the
        last stage must hold its own copy).
    budgets : memory budget of each rank in bytes (global), all > 0.

    Returns the counts minimising the largest ``load_r / budgets[r]``, where the
    load is what a stage reads for every token (its layers, and the head on the
    last stage), among the splits where every stage's bytes (the embedding too)
    fit its budget: the stages then take time in proportion to their memory,
    and the embedding, which costs memory but no time (one row per token), is
    not paid for with layers. When no split fits, the counts minimising the
    largest ``bytes_r / budgets[r]`` (the check before loading then refuses).
    Ties go to the smallest sum of squared fractions.
    """
    n, p = len(layer_bytes), len(budgets)
    check_ranks(n, p)
    if any(b <= 0 for b in budgets):
        raise UsageError(f"memory budgets must be positive, got {list(budgets)}")
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + int(b))

    def held(r: int, i: int, j: int) -> float:
        extra = (embed_bytes if r == 0 else 0) + (head_bytes if r == p - 1 else 0)
        return prefix[j] - prefix[i] + extra

    def load(r: int, i: int, j: int) -> float:
        return (prefix[j] - prefix[i] + (head_bytes if r == p - 1 else 0)) / budgets[r]

    counts = _minmax_split(n, p, load, lambda r, i, j: held(r, i, j) <= budgets[r])
    if counts is None:
        counts = _minmax_split(n, p, lambda r, i, j: held(r, i, j) / budgets[r],
                               lambda r, i, j: True)
    return counts


def _minmax_split(n: int, p: int, cost, allowed) -> list[int] | None:
    """Contiguous split of n layers over p ranks (>= 1 each) minimising the largest
    ``cost(r, i, j)`` over allowed stages ``[i, j)``, then the sum of squared costs."""
    inf = float("inf")

    def c(r: int, i: int, j: int) -> float:
        return cost(r, i, j) if allowed(r, i, j) else inf

    # pass 1: the smallest achievable maximum
    best = [[inf] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for r in range(1, p + 1):
        for j in range(r, n - (p - r) + 1):
            best[r][j] = min(max(best[r - 1][i], c(r - 1, i, j)) for i in range(r - 1, j))
    if best[p][n] == inf:
        return None
    limit = best[p][n] * (1 + 1e-12)
    # pass 2: among splits within that maximum, the most even (least sum of squares)
    sq = [[inf] * (n + 1) for _ in range(p + 1)]
    arg = [[-1] * (n + 1) for _ in range(p + 1)]
    sq[0][0] = 0.0
    for r in range(1, p + 1):
        for j in range(r, n - (p - r) + 1):
            for i in range(r - 1, j):
                f = c(r - 1, i, j)
                if f > limit or sq[r - 1][i] == inf:
                    continue
                v = sq[r - 1][i] + f * f
                if v < sq[r][j] * (1 - 1e-12):
                    sq[r][j], arg[r][j] = v, i
    counts, j = [], n
    for r in range(p, 0, -1):
        i = arg[r][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def check_fit(
    stages: Sequence[StageSpec],
    need: Sequence[int],
    budgets: Sequence[float],
    hosts: Sequence[str] | None = None,
) -> None:
    """Raise UsageError naming the first rank whose ``need`` bytes exceed its budget."""
    for s, nb, b in zip(stages, need, budgets):
        if nb > b:
            where = f" on {hosts[s.rank]}" if hosts else ""
            raise UsageError(
                f"stage {s.rank}{where} (layers [{s.start}, {s.end})"
                f"{' + embedding' if s.first else ''}{' + head' if s.last else ''}) needs "
                f"{nb / GIB:.2f} GiB but its memory budget is {b / GIB:.2f} GiB: "
                "add ranks or hosts, or move layers with --split"
            )


# -- memory budgets ---------------------------------------------------------------


@dataclass(frozen=True)
class HostMemory:
    """One hostfile entry, reduced to what stage planning reads."""

    name: str
    slots: int
    memory_gb: float | None


def read_hostfile(path: str) -> list[HostMemory]:
    """Hosts (name, slots, memory_gb) of a JSON hostfile, read and checked by
    :func:`hpcmac.launch.hostfile.load` (the hpcmac schema and ``mlx.launch``'s)."""
    from hpcmac.launch.hostfile import load

    return [HostMemory(h.name, h.slots, h.memory_gb) for h in load(path).hosts]


def _same_host(a: str, b: str) -> bool:
    return a == b or a.split(".")[0] == b.split(".")[0]


def rank_budgets(
    rank_hosts: Sequence[str],
    rank_avail: Sequence[int],
    hostfile: Sequence[HostMemory] | None = None,
) -> list[float]:
    """Memory budget in bytes of each rank (global).

    Parameters
    ----------
    rank_hosts : host name of each rank, in rank order.
    rank_avail : available memory in bytes measured by each rank on its host.
    hostfile : hosts with ``memory_gb`` (GiB); a host's memory is divided among
        the ranks on it. Ranks are matched to hosts by name; when some rank's
        host is not in the hostfile, the i-th distinct host (in rank order) is
        taken to be the hostfile's i-th host, as mpirun fills hosts in order. A
        rank without a ``memory_gb`` falls back to the measured memory.
    """
    p = len(rank_hosts)
    per_host: dict[str, int] = {}
    for h in rank_hosts:
        per_host[h] = per_host.get(h, 0) + 1
    measured = [rank_avail[r] / per_host[rank_hosts[r]] for r in range(p)]
    if not hostfile:
        return measured
    entry: list[HostMemory | None] = []
    for h in rank_hosts:
        match = [e for e in hostfile if _same_host(e.name, h)]
        entry.append(match[0] if match else None)
    if any(e is None for e in entry):
        # names differ (ssh aliases, addresses): the i-th distinct host of the
        # ranks is the hostfile's i-th host, as mpirun places ranks by slot
        distinct = list(dict.fromkeys(rank_hosts))
        pos = {h: i for i, h in enumerate(distinct)}
        entry = [hostfile[pos[h]] if pos[h] < len(hostfile) else None for h in rank_hosts]
    counts: dict[str, int] = {}
    for e in entry:
        if e is not None:
            counts[e.name] = counts.get(e.name, 0) + 1
    out = []
    for r, e in enumerate(entry):
        if e is None or e.memory_gb is None:
            out.append(measured[r])
        else:
            out.append(e.memory_gb * GIB / counts[e.name])
    return out


def available_memory() -> int:
    """Bytes of memory available to a new process on this machine (local)."""
    from hpcmac.limits import system_available

    return system_available()


# -- agreeing on errors -----------------------------------------------------------------


def agree(group, fn: Callable[[], Any], ranks: str = "all") -> Any:
    """Collective: run ``fn`` (on every rank, or on rank 0 only with ``ranks="root"``).

    A UsageError on any rank is raised on every rank (naming the rank and host
    when it happened on some ranks only), so all ranks exit 2 together.
    Returns ``fn``'s value (rank 0's, broadcast, with ``ranks="root"``).
    """
    out, err = None, None
    if ranks == "all" or group.rank == 0:
        try:
            out = fn()
        except UsageError as exc:
            err = str(exc)
    if ranks == "root":
        err, out = group.bcast_obj((err, out), 0)
        if err:
            raise UsageError(err)
        return out
    errs = group.allgather_obj((err, socket.gethostname()))
    bad = [(r, e, h) for r, (e, h) in enumerate(errs) if e]
    if bad:
        r, e, h = bad[0]
        if len(bad) == group.size and len({x for _, x, _ in bad}) == 1:
            raise UsageError(e)
        raise UsageError(f"rank {r} on {h}: {e}")
    return out


# -- planning ----------------------------------------------------------------------------


def kv_bytes_per_token_layer(cfg) -> int:
    """Bytes of KV cache one token takes in one layer (float32): the cache's own count,
    :meth:`hpcmac.llm.model.cache.KVCache.token_bytes`."""
    from hpcmac.llm.model.cache import KVCache

    return KVCache.token_bytes(cfg)


def weight_bytes(model, quantize: int | None = None,
                 group_size: int = 64) -> tuple[list[int], int, int]:
    """Bytes of each layer, of the embedding and of the norm + head, as loaded (headers only).

    ``hpcmac.llm.model.weights.stage_nbytes`` of each piece, with the checkpoint opened
    once; ``quantize``/``group_size`` as there. ``model``: a path or short name, or a
    checkpoint already opened with ``open_checkpoint``.
    """
    from hpcmac.llm.model.weights import open_checkpoint, stage_nbytes

    ckpt = model if hasattr(model, "numel") else open_checkpoint(model)
    n_layers = ckpt.config().n_layers

    def nbytes(start: int, end: int, first: bool, last: bool) -> int:
        return stage_nbytes(ckpt, start, end, first, last, quantize, group_size)

    layers = [nbytes(i, i + 1, False, False) for i in range(n_layers)]
    return layers, nbytes(0, 0, True, False), nbytes(0, 0, False, True)
