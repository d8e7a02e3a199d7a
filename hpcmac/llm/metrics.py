"""What ``serve`` measures, as Prometheus text (``GET /metrics``) and as JSON for the page.

Counted on the HTTP side, as requests come and go (:class:`ServeMetrics`):
requests answered by endpoint and status, prompt and completion tokens of
every request that ran, the time to the first token (from the request's submit
to its first token reaching the event loop: queueing included, as a client
sees it) and the time between tokens. Read at scrape time (:class:`_Live`):
requests waiting for a slot, running, the KV-cache tokens they hold against the
cache's size, each rank's busy fraction (:mod:`hpcmac.llm.parallel.busy`), and
the placement as labels (one ``hpcmac_rank_info`` series per rank).
All through ``prometheus-client``, in a registry of this server's own.
"""

from __future__ import annotations

import threading
import time
from collections import deque

#: seconds of the tok/s history the page plots
HISTORY_S = 600
#: histogram buckets (seconds): CPU decode steps take ~10-100 ms, first tokens longer
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class ServeMetrics:
    """This server's counters (server thread; the collector reads the rest at scrape)."""

    def __init__(self, cfg, source, ops):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.cfg, self.source, self.ops = cfg, source, ops
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hpcmac_requests", "HTTP requests answered, by endpoint "
                                "and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("hpcmac_prompt_tokens", "prompt tokens of the "
                                     "requests that ran", registry=r)
        self.completion_tokens = Counter("hpcmac_completion_tokens", "tokens generated",
                                         registry=r)
        self.cached_tokens = Counter("hpcmac_prompt_cached_tokens", "prompt tokens reused "
                                     "from the prefix cache", registry=r)
        self.finishes = Counter("hpcmac_finished", "generations ended, by reason",
                                ["reason"], registry=r)
        self.ttft = Histogram("hpcmac_time_to_first_token_seconds", "submit to first "
                              "token (queueing included)", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("hpcmac_inter_token_latency_seconds", "time between two "
                             "tokens of one stream", buckets=ITL_BUCKETS, registry=r)
        r.register(_Live(self))
        self.t_start = time.time()
        self._lock = threading.Lock()
        self._per_s: deque = deque(maxlen=HISTORY_S)  # [second, tokens] pairs

    # -- the event loop ----------------------------------------------------------------
    def token(self, dt: float, first: bool) -> None:
        (self.ttft if first else self.itl).observe(dt)
        sec = int(time.time())
        with self._lock:
            if self._per_s and self._per_s[-1][0] == sec:
                self._per_s[-1][1] += 1
            else:
                self._per_s.append([sec, 1])

    def finished(self, run, cancelled: bool = False) -> None:
        self.prompt_tokens.inc(len(run.prompt))
        self.completion_tokens.inc(len(run.ids))
        self.cached_tokens.inc(run.cached_tokens)
        self.finishes.labels("cancelled" if cancelled else run.reason or "?").inc()

    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    # -- views -------------------------------------------------------------------------
    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def history(self, seconds: int = HISTORY_S) -> list[list[int]]:
        """``[unix second, tokens generated in it]`` over the last ``seconds``, zeros
        filled in."""
        now = int(time.time())
        with self._lock:
            seen = {s: n for s, n in self._per_s}
        return [[s, seen.get(s, 0)] for s in range(now - seconds + 1, now + 1)]

    def json(self) -> dict:
        """The live figures the page polls (``GET /metrics.json``)."""
        waiting, running, kv = counts(self.source)
        slots, context = self.ops.slots or 0, self.cfg.context
        reqs: dict[str, float] = {}
        for m in self.requests.collect():
            for s in m.samples:
                if s.name.endswith("_total"):
                    k = s.labels["status"]
                    reqs[k] = reqs.get(k, 0) + s.value
        hist = self.history(60)
        return {"model": self.cfg.model_id, "time": time.time(),
                "uptime_s": time.time() - self.t_start,
                "requests": reqs, "waiting": waiting, "running": running, "slots": slots,
                "kv_tokens": kv, "kv_capacity": slots * context,
                "prompt_tokens": _value(self.prompt_tokens),
                "cached_tokens": _value(self.cached_tokens),
                "completion_tokens": _value(self.completion_tokens),
                "tok_s_10s": sum(n for _, n in hist[-11:-1]) / 10.0,
                "ttft_mean_s": _mean(self.ttft), "itl_mean_s": _mean(self.itl),
                "ranks": self.ops.rank_rows(), "history": self.history()}


def counts(source) -> tuple[int, int, int]:
    """(waiting, running, KV tokens) of a source that counts them (the survive front's
    does not: zeros)."""
    fn = getattr(source, "counts", None)
    return fn() if fn is not None else (0, 0, 0)


def _value(counter) -> float:
    return next(s.value for m in counter.collect() for s in m.samples
                if s.name.endswith("_total"))


def _mean(hist) -> float | None:
    got = {s.name.rsplit("_", 1)[-1]: s.value for m in hist.collect() for s in m.samples
           if not s.labels}
    return got["sum"] / got["count"] if got.get("count") else None


def _prefix(index):
    """The prefix cache's figures (:meth:`~hpcmac.llm.parallel.prefix.PrefixIndex.stats`,
    read between the scheduler's steps' updates: plain numbers), if there is one."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if index is None:
        return
    st = index.stats()
    for name, doc, key in (
            ("hpcmac_prefix_cache_blocks", "KV blocks the prefix cache holds", "blocks"),
            ("hpcmac_prefix_cache_capacity_blocks", "blocks it may hold", "capacity_blocks"),
            ("hpcmac_prefix_cache_bytes", "bytes its blocks take", "bytes_used"),
            ("hpcmac_prefix_cache_capacity_bytes", "bytes it may take", "capacity_bytes")):
        yield GaugeMetricFamily(name, doc, value=st[key])
    for name, doc, key in (
            ("hpcmac_prefix_cache_lookups", "prompts looked up", "lookups"),
            ("hpcmac_prefix_cache_hits", "prompts that reused blocks", "hits"),
            ("hpcmac_prefix_cache_tokens_reused", "prompt tokens not prefilled again",
             "tokens_reused"),
            ("hpcmac_prefix_cache_evictions", "blocks evicted", "evictions")):
        yield CounterMetricFamily(name, doc, value=st[key])


def _recoveries(source):
    """The survive front's recoveries (:meth:`~hpcmac.llm.survive.front.FrontSource.
    recovery_stats`), if this server is one."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fn = getattr(source, "recovery_stats", None)
    if fn is None:
        return
    st = fn()
    for name, doc, key in (
            ("hpcmac_recoveries", "lost jobs replaced (and re-admissions)", "count"),
            ("hpcmac_recovery_seconds", "seconds from each loss to the new job up", "seconds"),
            ("hpcmac_resumed_requests", "requests resubmitted with their tokens so far",
             "resumed")):
        yield CounterMetricFamily(name, doc, value=st[key])
    for name, doc, key in (
            ("hpcmac_recovery_last_seconds", "the last recovery's seconds", "last_seconds"),
            ("hpcmac_hosts_lost", "hosts dropped and not readmitted", "hosts_lost"),
            ("hpcmac_degraded", "1 while degraded or unable to serve", "degraded")):
        yield GaugeMetricFamily(name, doc, value=st[key])


class _Live:
    """The figures read at scrape time: queue, slots, KV cache, ranks, placement."""

    def __init__(self, m: ServeMetrics):
        self.m = m

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        m, ops = self.m, self.m.ops
        waiting, running, kv = counts(m.source)
        slots = ops.slots or 0
        for name, doc, v in (
                ("hpcmac_queue_depth", "requests waiting for a cache slot", waiting),
                ("hpcmac_running_sequences", "sequences in the batch", running),
                ("hpcmac_slots", "cache slots (--max-batch)", slots),
                ("hpcmac_kv_cache_tokens", "tokens the running sequences hold", kv),
                ("hpcmac_kv_cache_capacity_tokens", "slots x context", slots * m.cfg.context),
                ("hpcmac_kv_cache_usage_ratio", "KV-cache tokens held over capacity",
                 kv / (slots * m.cfg.context) if slots else 0.0)):
            yield GaugeMetricFamily(name, doc, value=v)
        busy = GaugeMetricFamily("hpcmac_rank_busy_ratio", "fraction of the last seconds "
                                 "each rank spent computing", labels=["rank", "host"])
        busy_s = GaugeMetricFamily("hpcmac_rank_busy_seconds", "seconds each rank has "
                                   "spent computing", labels=["rank", "host"])
        for row in ops.rank_rows():
            lab = [str(row["rank"]), row["host"]]
            if row["busy"] is not None:
                busy.add_metric(lab, row["busy"])
            if row["busy_s"] is not None:
                busy_s.add_metric(lab, row["busy_s"])
        yield busy
        yield busy_s
        yield from _prefix(getattr(m.source, "prefix", None))
        yield from _recoveries(m.source)
        pl = ops.placement
        if pl is None:
            return
        info = InfoMetricFamily("hpcmac_rank", "each rank's place: host, stage, tensor "
                                "rank, layers, heads", labels=["rank"])
        need = GaugeMetricFamily("hpcmac_rank_weight_bytes", "bytes each rank holds "
                                 "(weights + KV cache)", labels=["rank"])
        budget = GaugeMetricFamily("hpcmac_rank_budget_bytes", "each rank's memory budget",
                                   labels=["rank"])
        for r in range(pl.size):
            p = pl.rank(r)
            info.add_metric([str(r)], {
                "host": p.host, "stage": str(p.stage), "tp_rank": str(p.tp_rank),
                "layers": f"{p.spec.start}-{p.spec.end}", "heads": str(p.shard.n_heads),
                "kv_heads": str(p.shard.n_kv_heads),
                "layout": f"tp{pl.tp}xpp{pl.pp}", "transport": ops.transport or "local"})
            need.add_metric([str(r)], p.need)
            budget.add_metric([str(r)], p.budget)
        yield info
        yield need
        yield budget

    def describe(self):  # registered without a first collect (the source may be empty)
        return []
