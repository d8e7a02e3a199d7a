"""What a pipeline run returns: each sequence's tokens and timings, each rank's counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SeqResult:
    """What one sequence produced, with its timings (seconds since the run started)."""

    index: int
    prompt_tokens: list[int]
    tokens: list[int]
    finish: str  # "eos", "length", "stop" or "interrupted"
    t_admit: float
    t_first: float
    t_done: float
    logits: list[np.ndarray] | None = None  # (vocab,) float32 per sampled step, if kept
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not prefilled)

    @property
    def ttft(self) -> float:
        return self.t_first - self.t_admit

    @property
    def decode_tok_s(self) -> float:
        n = len(self.tokens) - 1
        dt = self.t_done - self.t_first
        return n / dt if n > 0 and dt > 0 else 0.0


@dataclass
class RankStats:
    """One rank's counters for a run (local)."""

    rank: int
    host: str
    layers: tuple[int, int]
    wall_s: float = 0.0
    busy_s: float = 0.0  # wall time computing
    cpu_s: float = 0.0  # CPU time computing (less than busy_s when the core is shared)
    micro_batches: int = 0
    sent: dict[str, int] = field(default_factory=dict)  # "decode"/"prefill"/"ctrl" -> bytes
    sent_to: int = -1
    ret_sent: dict[str, int] = field(default_factory=dict)  # last stage -> rank 0
    #: "decode"/"prefill" -> blocking evaluations, and bytes brought to the host, counted
    #: by the backend (MLX: MLXBackend.host; always 0 on numpy, which has no device)
    host_syncs: dict[str, int] = field(default_factory=dict)
    host_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def busy(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class PipelineResult:
    """Global: the same on every rank after :func:`run_pipeline`."""

    seqs: list[SeqResult]
    stats: list[RankStats]
    wall_s: float
    decode_tokens: int  # tokens fed during decode (one per sequence per step)
    interrupted: bool = False
    tensor: list[dict] = field(default_factory=list)  # each rank's all-reduce counters
    prefix: dict | None = None  # the prefix cache's counters (PrefixIndex.stats), if on
    #: speculative decoding (None without a drafter): draft tokens proposed and
    #: accepted, steps that had a draft, and rank 0's seconds drafting
    speculative: dict | None = None

    def acceptance(self) -> float:
        """Accepted over proposed draft tokens (0 without drafts)."""
        sp = self.speculative or {}
        return sp.get("accepted", 0) / sp["drafted"] if sp.get("drafted") else 0.0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_tokens) for s in self.seqs)

    @property
    def generated(self) -> int:
        return sum(len(s.tokens) for s in self.seqs)

    def decode_tok_s(self) -> float:
        """Aggregate decode rate: tokens after each first one, over the decode span."""
        n = sum(max(len(s.tokens) - 1, 0) for s in self.seqs)
        live = [s for s in self.seqs if len(s.tokens) > 1]
        if not live:
            return 0.0
        span = max(s.t_done for s in live) - min(s.t_first for s in live)
        return n / span if span > 0 else 0.0

    def prefill_tok_s(self) -> float:
        """Prompt tokens over the time until the last first token."""
        if not self.seqs:
            return 0.0
        span = max(s.t_first for s in self.seqs) - min(s.t_admit for s in self.seqs)
        return self.prompt_tokens / span if span > 0 else 0.0

    def link_bytes_per_token(self) -> list[dict[str, float]]:
        """Per link (r -> r+1, and last -> 0): decode bytes per decoded token."""
        out = []
        n = max(self.decode_tokens, 1)
        for st in self.stats:
            if st.sent_to >= 0:
                out.append({"link": f"{st.rank}->{st.sent_to}",
                            "bytes_per_token": st.sent.get("decode", 0) / n})
        for st in self.stats:
            if st.ret_sent:
                out.append({"link": f"{st.rank}->0 (tokens)",
                            "bytes_per_token": st.ret_sent.get("decode", 0) / n})
        return out

    def host_per_token(self) -> list[dict]:
        """Per rank: the backend's host syncs and bytes to the host per decoded token
        (decode steps only; one per sequence per step), counted by the backend
        (:meth:`~hpcmac.llm.model.backend.MLXBackend.host`). The pipeline's ranks, then
        each tensor group's other ranks (``tensor``), by job rank."""
        n = max(self.decode_tokens, 1)
        out = {}
        for t in self.tensor:  # every rank of a tensor group, its leader included
            if "host_syncs" in t:
                out[t["rank"]] = (t["host_syncs"], t["host_bytes"])
        for st in self.stats:
            rank = st.rank if not self.tensor else None
            if rank is not None:
                out[rank] = (st.host_syncs.get("decode", 0), st.host_bytes.get("decode", 0))
        return [{"rank": r, "host_syncs_per_token": s / n, "host_bytes_per_token": b / n}
                for r, (s, b) in sorted(out.items())]

