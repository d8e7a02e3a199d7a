"""Pipeline-parallel decoding: stage r computes its layers and hands activations to r+1.

Every rank holds one :class:`~hpcmac.llm.parallel.plan.StageSpec` (contiguous layers,
the embedding on rank 0, the final norm and head on the last rank) and the KV
cache of its own layers. Rank 0 is also the scheduler: it owns the requests,
forms micro-batches, embeds them, runs stage 0 and sends the hidden states to
rank 1; each stage sends its output straight to the next; the last stage
samples and sends the token ids back to rank 0. No central host relays
activations.

Several micro-batches are in flight at once (GPipe-like), so with several
sequences every stage computes at the same time; finished sequences leave
and waiting ones join at once (continuous batching). Long prompts are cut
into chunks that follow each other down the pipeline, so stages overlap on
prefill too.

Wire protocol (one ordered channel per link, all through ``hpcmac.comm``):

* stage r -> r+1, tag ``TAG_FWD``: a header ``int32[4] = (kind, n, T, mb_id)``
  then, for ``FWD``, one payload ``float32[5 n + T hidden]``: the meta rows
  ``int32 (n, 5) = (seq, slot, length, position, sample)`` (their bits) and the
  hidden states ``(T, hidden)``; ``sample`` is 0 (a prompt chunk), 1 (the next
  token from the last row) or ``1 + k`` (speculative decoding: the last ``k``
  tokens are drafts, and the last ``1 + k`` rows are scored); for ``CTRL`` a dict of
  ``n`` bytes in comm.wire's plain tagged format, never pickle (sequences joining
  and leaving, the prefix cache's block instructions, :mod:`.prefix`, and the next
  micro-batch's drafts with the draft's distributions, for the last stage's verifier);
  ``STOP`` ends the loop; ``PING`` (a header alone) is sent by an idle server
  now and then so that waiting stages know rank 0 is alive. A decoded token
  thus costs one hidden vector plus 20 bytes on a link, and 16 bytes per
  micro-batch.
* last stage -> rank 0, tag ``TAG_RET``: ``int32[1 + sum(sample)] = (mb_id,
  token...)``, one message per micro-batch, in issue order: ``sample`` slots per
  sampled sequence, its new tokens then ``NONE`` (-2) (a speculative step emits 1
  to ``1 + k``: the accepted drafts and the target's own); a token of ``FAILED``
  (-1) says that sequence's sampling failed. When some sampled sequence asked for
  logprobs (k most likely), tag ``TAG_LOGP`` follows: ``float64[sum(1 + 2 k)]``,
  per such sequence in order (chosen token's logprob, the k logprobs, their k ids),
  of the model's own distribution (before grammar, penalty and temperature).

Speculative decoding (a ``drafter``): rank 0, the first stage's leader, drafts
before it issues a micro-batch; every rank runs the ``1 + k`` tokens in one forward,
writing their KV; the next step of that sequence starts at the position after the
accepted tokens, so every rank's cache drops the rejected ones there
(``KVCache.truncate``, called by ``Stage.forward``). A sequence under a grammar or
asking for logprobs gets no drafts.

Serving, one request never ends the job: what depends on a request alone (its sampling
parameters, its control message, its callbacks, its sampling on the last stage)
is checked or caught per sequence, and only that sequence ends, with finish
``"error"`` and a message; the others go on (``_Plan.isolate``). A failure
that is not one request's (a stage's forward pass, a lost peer) still ends the
job, and so does any failure of a ``generate`` run, whose requests are checked
before it starts.
"""

from __future__ import annotations

import math
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.errors import UsageError
from hpcmac.llm.model.cache import LOAD, SAVE, TRUNC, recurrent_layers
from hpcmac.llm.model.sampling import Sampler, SamplingParams
from hpcmac.llm.parallel.link import Link, Watchdog
from hpcmac.llm.parallel.plan import StageSpec
from hpcmac.llm.parallel.prefix import BLOCK, ROOT, SAVE_RUN, PrefixIndex
from hpcmac.llm.parallel.results import PipelineResult, RankStats, SeqResult
from hpcmac.llm.parallel.tags import TAG_FWD, TAG_LOGP, TAG_RET
from hpcmac.llm.parallel.tensor import GATHER, MAXLOC, logit_rows, step_phase

FWD, CTRL, STOP, PING = 1, 2, 3, 4
HDR = 4
META = 5
#: prompt tokens per micro-batch: on one stage when no stream waits (generate's default,
#: and serve's while nothing decodes); serve's beside running streams, unless given
LONE_CHUNK = 512
STREAM_CHUNK = 64
WIRE = np.int32  # header, meta and returned token ids
#: a returned "token" meaning: sampling this sequence failed on the last stage (the
#: sequence ends with finish "error"; the others go on)
FAILED = -1
#: a returned slot left empty: a speculative step emitted fewer than 1 + k tokens
NONE = -2


def pack(meta: np.ndarray, h: np.ndarray) -> np.ndarray:
    """One FWD payload: the meta rows' bits, then the hidden states (see the module doc)."""
    n = meta.shape[0]
    out = np.empty(n * META + h.size, dtype=np.float32)
    out[: n * META].view(WIRE)[:] = meta.ravel()
    out[n * META :] = h.ravel()
    return out


def unpack(payload: np.ndarray, n: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """(meta int32 (n, 5), hidden states float32 (T, hidden)) of a FWD payload (views)."""
    meta = payload[: n * META].view(WIRE).reshape(n, META)
    return meta, payload[n * META :].reshape(-1, hidden)

__all__ = ["PipelineResult", "RankStats", "Request", "SeqResult", "run_pipeline"]


@dataclass
class Request:
    """One sequence to generate (rank 0 only)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: tuple[int, ...] = ()
    draft_k: int = 0  # draft tokens verified per step (the run's drafter; 0: none)


# -- sampling on the last stage ----------------------------------------------------


class _SeqSampler:
    """Per-sequence sampling state on the last stage: what it has seen, its random stream.

    With ``isolate``, ``error`` is set (and every draw fails) when this sequence's
    sampler cannot be built: this sequence's failure alone; without, it raises.
    """

    def __init__(self, prompt: Sequence[int], params: SamplingParams, isolate: bool = False):
        self.error: str | None = None
        self.params = params
        self.constraint = None  # its grammar (hpcmac.llm.grammar), if it has one
        try:
            self.sampler = Sampler(params)
            if params.grammar is not None:
                from hpcmac.llm.grammar import Constraint

                self.constraint = Constraint(params.grammar)
                for t in prompt[len(prompt) - params.draws:] if params.draws else ():
                    self.constraint.accept(t)  # resumed (hpcmac.llm.survive): what it streamed
        except Exception as exc:  # one request's parameters: fail it, not the stage
            if not isolate:
                raise
            self.sampler, self.error = None, _one_line(exc)
        self.seen = list(prompt)
        self.draft: tuple[list[int], np.ndarray | None] = ([], None)  # the next step's

    def sample(self, logits: np.ndarray, mask: np.ndarray | None = None) -> int:
        return self.take(self.sampler(logits, self.seen, mask))

    def take(self, tok: int) -> int:
        """A token chosen (here, or by a max-loc over a tensor group)."""
        if self.constraint is not None:
            self.constraint.accept(tok)
        self.seen.append(tok)
        return tok

    def speculate(self, rows: np.ndarray, mode: int) -> list[int]:
        """The tokens a step with this sequence's draft emits (speculative.verify):
        ``rows``, (k + 1, vocab) logits, or (k + 1,) max-loc ids."""
        from hpcmac.llm.model import speculative

        draft, q = self.draft
        self.draft = ([], None)
        if len(rows) != len(draft) + 1:
            raise RuntimeError(f"{len(rows)} rows of logits for {len(draft)} draft tokens")
        out = speculative.verify_greedy(rows, draft) if mode == MAXLOC else \
            speculative.verify(self.sampler, rows, draft, q, self.seen)
        return [self.take(t) for t in out]


# -- the run ------------------------------------------------------------------------


@dataclass
class _Plan:
    """Global run parameters, decided on rank 0 and broadcast."""

    n_seqs: int
    max_slots: int
    max_len: int
    micro_batches: int
    chunk: int
    keep_logits: bool
    isolate: bool = False  # serve: a request's own failure ends that request alone
    prefix_blocks: int = 0  # prefix-cache blocks (0: no prefix cache), see .prefix
    prefix_block: int = BLOCK  # tokens per prefix block
    prefix_bytes: int = 0  # bytes of one block on the rank holding the most (stats)
    prefix_state: int = 0  # blocks a block's linear-attention states take besides (0: none)
    lone_chunk: int = 0  # serve's default: the chunk while nothing decodes (0: chunk always)


class _StageState:
    """One rank's stage, its cache and counters."""

    def __init__(self, group: Group, stage, spec: StageSpec, hidden: int, plan: _Plan,
                 watchdog: Watchdog, host: str, tensor=None):
        self.group, self.stage, self.spec, self.hidden, self.plan = group, stage, spec, hidden, plan
        self.tensor = tensor  # this stage's TensorGroup (tensor.py), None: one rank a stage
        self.cache = stage.new_cache(plan.max_slots, plan.max_len)
        self.link = Link(group, watchdog)
        self.stats = RankStats(group.rank, host, (spec.start, spec.end))
        self.samplers: dict[int, _SeqSampler] = {}
        self.logits: dict[int, list[np.ndarray]] = {}
        self.next = group.rank + 1 if group.rank + 1 < group.size else -1
        self.used_slots: set[int] = set()
        self.logp = np.empty(0)  # the last micro-batch's logprob rows (TAG_LOGP)

    def apply_ctrl(self, ctrl: dict) -> None:
        if self.tensor is not None:
            self.tensor.send_ctrl(ctrl)
        frees = []  # freed by the cache with its prefix-block instructions, below
        for idx, slot in ctrl.get("free", ()):
            if slot in self.used_slots:
                frees.append(slot)
                self.used_slots.discard(slot)
            self.samplers.pop(idx, None)
        kv = ctrl.get("kv", ())
        # a slot freed and given to a new sequence gets its blocks after its free; a block
        # saved from a slot being freed reads it first (KVCache.apply)
        self.cache.apply(kv, frees)
        self.used_slots.update(int(op[1]) for op in kv if op[0] == LOAD)
        if self.spec.last:
            for idx, prompt, params in ctrl.get("add", ()):
                self.samplers[idx] = _SeqSampler(prompt, params, self.plan.isolate)
                if self.plan.keep_logits:
                    self.logits[idx] = []
            for idx, toks, q in ctrl.get("draft", ()):
                if idx in self.samplers:
                    self.samplers[idx].draft = (list(toks), q)

    def compute(self, x: np.ndarray, meta: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Run this stage on a micro-batch; on the last stage also sample.

        ``x`` is int64 token ids (T,) on the first stage, else float32 (T, hidden).
        Returns (hidden states (T, hidden), sampled token ids or None); on the last stage
        the hidden states are not used (on MLX they are left unevaluated).

        MLX backend: one host sync per step (:meth:`MLXBackend.host`): the step's graph,
        its cache writes and, on the last stage, the head are evaluated together; what
        crosses is the hidden states (to the next stage), the greedy ids (argmax on the
        device: every sampled sequence greedy, no grammar, no logprobs, no kept logits),
        or else the logits rows the host samples from.
        """
        c0 = time.process_time()
        t0 = time.perf_counter()
        be = self.stage.backend
        s0, b0 = be.syncs, be.host_bytes
        idxs = [int(i) for i in meta[meta[:, 4] != 0, 0]]
        nrows = [int(n) for n in meta[meta[:, 4] != 0, 4]]  # 1 + draft tokens
        mode = self._head_mode(idxs)
        self.logp = np.empty(0)
        masks = self._masks(idxs, nrows) if self.spec.last else None
        ks = self._logprob_ks(idxs, nrows) if self.spec.last else []
        wants_logits = masks is not None or max(ks, default=-1) >= 0
        if self.tensor is None and mode == MAXLOC and wants_logits:
            mode = GATHER  # one rank: the host masks, and takes logprobs, from the logits
        topk = max(ks, default=-1) if mode == MAXLOC else -1
        if self.tensor is not None:  # first: the followers wait for it
            self.tensor.send_step(meta, x, mode, masks if mode == MAXLOC else None, topk)
        h = self._forward(x, meta)
        toks = None
        if self.spec.last:
            rows = logit_rows(meta)
            toks = np.full(len(rows), NONE, dtype=np.int64)
            wait = self.stage.cache_arrays(self.cache)
            if not len(rows):
                if self.lazy:
                    be.eval(h, *wait)
            else:
                stats = None
                combined = False  # the group's max-loc done in the graph
                if self.lazy:
                    lg = self.stage.logits(h[be.index(rows)], lazy=True)
                    if self.tensor is None and mode == MAXLOC:  # greedy on the device
                        logits = be.host(be.mx.argmax(lg, axis=-1), *wait).astype(np.int64)
                    elif self.tensor is not None and self.tensor.in_graph_head(mode, masks,
                                                                              topk):
                        logits = be.host(self.tensor.graph.maxloc(lg, self.stage.vocab[0]),
                                         *wait).astype(np.int64)
                        combined = True
                    else:
                        logits = be.host(lg, *wait)
                else:
                    logits = np.asarray(self.stage.logits(h[rows]), dtype=np.float32)
                if self.tensor is not None and not combined:
                    logits = self.tensor.head(logits, self.stage.vocab[0], mode,
                                              masks if mode == MAXLOC else None, topk)
                    if topk >= 0:
                        logits, stats = logits
                off = 0
                for idx, n in zip(idxs, nrows):
                    got = self._draw(idx, logits[off : off + n], mode,
                                     None if masks is None else masks[off])
                    toks[off : off + len(got)] = got
                    if mode != MAXLOC and self.plan.keep_logits and got[0] != FAILED:
                        self.logits[idx].extend(r.copy() for r in logits[off : off + len(got)])
                    off += n
                self.logp = _logprob_rows(ks, logits, toks, stats, mode)
        self._count(meta, be, s0, b0, t0, c0)
        return h, toks

    @property
    def lazy(self) -> bool:
        """The last stage on MLX: its forward stays in the graph until the head's sync."""
        return self.spec.last and self.stage.backend.name == "mlx"

    def _forward(self, x, meta: np.ndarray):
        """This stage's layers on a micro-batch (the embedding first on the first stage):
        numpy hidden states, or on the last MLX stage the unevaluated output."""
        from hpcmac.llm.model.stage import Batch

        slots = [int(s) for s in meta[:, 1]]
        batch = Batch(slots=slots, lengths=[int(n) for n in meta[:, 2]],
                      positions=[int(p) for p in meta[:, 3]])
        self.used_slots.update(slots)
        h = self.stage.embed(x) if self.spec.first else x
        return self.stage.forward(h, batch, self.cache, lazy=self.lazy)

    def _count(self, meta: np.ndarray, be, s0: int, b0: int, t0: float, c0: float) -> None:
        """A micro-batch's time, and the host syncs and bytes its backend counted."""
        phase = _phase(meta)
        st = self.stats
        st.host_syncs[phase] = st.host_syncs.get(phase, 0) + be.syncs - s0
        st.host_bytes[phase] = st.host_bytes.get(phase, 0) + be.host_bytes - b0
        if self.tensor is not None and phase == "decode":  # as its followers count theirs
            self.tensor.stats.host_syncs += be.syncs - s0
            self.tensor.stats.host_bytes += be.host_bytes - b0
        st.busy_s += time.perf_counter() - t0
        st.cpu_s += time.process_time() - c0
        st.micro_batches += 1

    # -- one rank on MLX: decode steps back to back (the scheduler's burst) -----------

    def device_step(self, x, meta: np.ndarray):
        """One rank holding the whole model on MLX, every row greedy: the step's greedy
        ids (one per sequence), left in the graph. ``x``: the fed tokens, numpy or the
        previous step's ids still on the device."""
        h = self._forward(x, meta)
        be = self.stage.backend
        return be.mx.argmax(self.stage.logits(h[be.index(logit_rows(meta))], lazy=True),
                            axis=-1)

    def start(self, y) -> None:
        """Evaluate a :meth:`device_step`'s ids and its cache writes in the background."""
        self.stage.backend.mx.async_eval(y, *self.stage.cache_arrays(self.cache))

    def read(self, y, meta: np.ndarray) -> np.ndarray:
        """A :meth:`device_step`'s ids on the host (its one sync), each taken by its
        sequence's sampler (int64)."""
        c0, t0 = time.process_time(), time.perf_counter()
        be = self.stage.backend
        s0, b0 = be.syncs, be.host_bytes
        # y alone: its cache writes are its inputs, and the cache's arrays may be the next
        # step's by now (waiting on them would wait for that step too)
        ids = be.host(y).astype(np.int64)
        toks = np.array([self.samplers[int(i)].take(int(t)) for i, t in zip(meta[:, 0], ids)],
                        dtype=np.int64)
        self._count(meta, be, s0, b0, t0, c0)
        return toks

    def _logprob_ks(self, idxs: list[int], nrows: list[int]) -> list[int]:
        """Top logprobs each sampled row asked for (-1: none; a sequence asking for
        them never has drafts, so its one row is its token's)."""
        out = []
        for i, n in zip(idxs, nrows):
            s = self.samplers.get(i)
            out += [s.params.logprobs if s is not None else -1] + [-1] * (n - 1)
        return out

    def _masks(self, idxs: list[int], nrows: list[int]) -> np.ndarray | None:
        """The packed grammar masks (rows, W) int32 of the sampled rows, all bits set for a
        sequence without a grammar; None when none has one. A grammar that fails here
        fails its sequence alone (in ``_draw``). (A sequence with a grammar never has
        drafts: one row; the rows of the others' drafts are all bits set.)"""
        ss = [self.samplers.get(i) for i in idxs]
        if not any(s is not None and s.constraint is not None for s in ss):
            return None
        from hpcmac.llm.grammar import mask_words

        out = np.full((sum(nrows), mask_words(self.stage.config.vocab)), -1, dtype=np.int32)
        for row, s in zip(np.cumsum([0, *nrows[:-1]]), ss):
            if s is None or s.constraint is None or s.error is not None:
                continue
            try:
                s.constraint.fill(out[row])
            except Exception as exc:
                if not self.plan.isolate:
                    raise
                s.error = _one_line(exc)
        return out

    def _draw(self, idx: int, rows: np.ndarray, mode: int,
              mask: np.ndarray | None = None) -> list[int]:
        """Sequence ``idx``'s next token(s) from its logits rows (or max-loc ids, the mask
        already applied on every rank): one, or with a draft of k tokens 1 to k + 1
        (speculative.verify); [FAILED] when its sampling fails: that sequence ends, the
        micro-batch goes on."""
        s = self.samplers.get(idx)
        try:
            if s is None:
                raise RuntimeError("no sampler (it was never added)")
            if s.error is not None:
                raise ValueError(s.error)
            if len(rows) > 1 or s.draft[0]:
                return s.speculate(rows, mode)
            return [s.take(int(rows[0])) if mode == MAXLOC else s.sample(rows[0], mask)]
        except Exception as exc:
            if not self.plan.isolate:
                raise
            print(f"sequence {idx}: sampling failed on rank {self.group.rank}: "
                  f"{_one_line(exc)}", file=sys.stderr, flush=True)
            return [FAILED]

    def _head_mode(self, idxs: list[int]) -> int:
        """MAXLOC when a tensor-parallel head (or one MLX rank's, on the device) needs
        only each row's best id: every sampled sequence greedy without a repetition
        penalty, no logits kept."""
        if not self.spec.last or self.plan.keep_logits or \
                (self.tensor is None and not self.lazy):
            return GATHER
        for i in idxs:
            s = self.samplers.get(i)
            if s is None or s.error is not None:
                continue  # fails in _draw whatever the mode
            p = s.params
            if p.temperature != 0.0 or p.repetition_penalty != 1.0:
                return GATHER
        return MAXLOC


def _logprob_rows(ks: list[int], logits: np.ndarray, toks: np.ndarray, stats, mode: int
                  ) -> np.ndarray:
    """The TAG_LOGP payload of a micro-batch (see the module doc): from the full logits
    rows, or (a tensor group's max-loc) from the combined per-slice statistics ``stats``
    (k, 1 + 2 kmax) = (chosen logprob, top logprobs, top ids)."""
    parts = []
    for k, want in enumerate(ks):
        if want < 0:
            continue
        row = np.full(1 + 2 * want, np.nan)
        if toks[k] != FAILED:
            if mode == MAXLOC:
                kmax = (stats.shape[1] - 1) // 2
                row[0] = stats[k, 0]
                row[1:1 + want] = stats[k, 1:1 + want]
                row[1 + want:] = stats[k, 1 + kmax:1 + kmax + want]
            else:
                x = logits[k].astype(np.float64)
                m = x.max()
                lp = x - (m + np.log(np.exp(x - m).sum()))
                row[0] = lp[int(toks[k])]
                top = np.argsort(-lp, kind="stable")[:want]
                row[1:1 + want], row[1 + want:] = lp[top], top
        parts.append(row)
    return np.concatenate(parts) if parts else np.empty(0)


def _device_greedy(p: SamplingParams) -> bool:
    """Sampling that one MLX rank does on the device: greedy, no penalty, grammar or
    logprobs."""
    return p.temperature == 0.0 and p.repetition_penalty == 1.0 and p.grammar is None and \
        p.logprobs < 0


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


_phase = step_phase


def _ctrl_to_wire(ctrl: dict) -> bytes:
    """A control message as plain tagged bytes (comm.wire; never pickle)."""
    from dataclasses import asdict

    from hpcmac.comm import wire

    return wire.encode({"add": [(int(i), [int(t) for t in p], asdict(s))
                                for i, p, s in ctrl["add"]],
                        "free": [(int(i), int(s)) for i, s in ctrl["free"]],
                        "kv": [[int(v) for v in op] for op in ctrl.get("kv", ())],
                        "draft": [(int(i), [int(t) for t in d], q)
                                  for i, d, q in ctrl.get("draft", ())]})


def _ctrl_from_wire(data: bytes, sender: int) -> dict:
    """The control message :func:`_ctrl_to_wire` wrote; anything else ends the job."""
    from hpcmac.comm import wire
    from hpcmac.llm.model.sampling import SamplingParams

    try:
        msg = wire.decode(data)
        return {"add": [(int(i), list(p), SamplingParams(**s)) for i, p, s in msg["add"]],
                "free": [(int(i), int(s)) for i, s in msg["free"]],
                "kv": [[int(v) for v in op] for op in msg.get("kv", [])],
                "draft": [(int(i), list(d), q) for i, d, q in msg.get("draft", [])]}
    except (ValueError, TypeError, KeyError) as exc:
        raise RuntimeError(f"malformed pipeline control message from rank {sender}: "
                           f"{exc}") from None


def _serve(st: _StageState, t_start: float,
           on_step: Callable[[float, float], None] | None = None) -> None:
    """Ranks > 0: receive from the previous stage until STOP."""
    prev = st.group.rank - 1
    link = st.link
    while True:
        if on_step is not None:
            on_step(st.stats.busy_s, st.stats.cpu_s)
        hdr = link.recv(np.empty(HDR, dtype=WIRE), prev, TAG_FWD)
        kind, n, T, mb_id = (int(v) for v in hdr)
        if kind == STOP:
            if st.next >= 0:
                link.send(hdr, st.next, TAG_FWD, "ctrl")
            break
        if kind == PING:
            if st.next >= 0:
                link.send(hdr, st.next, TAG_FWD, "ctrl")
            if st.tensor is not None:
                st.tensor.send_ping()
            continue
        if kind == CTRL:
            payload = link.recv(np.empty(n, dtype=np.uint8), prev, TAG_FWD)
            st.apply_ctrl(_ctrl_from_wire(payload.tobytes(), prev))
            if st.next >= 0:
                link.send(hdr, st.next, TAG_FWD, "ctrl")
                link.send(payload, st.next, TAG_FWD, "ctrl")
            continue
        payload = link.recv(np.empty(n * META + T * st.hidden, dtype=np.float32), prev, TAG_FWD)
        meta, x = unpack(payload, n, st.hidden)
        h, toks = st.compute(x, meta)
        phase = _phase(meta)
        if st.next >= 0:
            link.send(hdr, st.next, TAG_FWD, phase)
            link.send(pack(meta, h), st.next, TAG_FWD, phase)
        else:
            ret = np.empty(1 + len(toks), dtype=WIRE)
            ret[0] = mb_id
            ret[1:] = toks
            link.send(ret, 0, TAG_RET, phase)
            if st.logp.size:
                link.send(st.logp, 0, TAG_LOGP, phase)
    link.flush()
    st.stats.wall_s = time.perf_counter() - t_start


class _Seq:
    __slots__ = ("idx", "req", "tokens", "n_prompt", "fed", "slot", "waiting", "finish",
                 "t_admit", "t_first", "t_done", "last_mb", "error", "chain", "cached",
                 "pending", "nosave")

    def __init__(self, idx: int, req: Request):
        self.idx, self.req = idx, req
        self.tokens = list(req.prompt)
        self.n_prompt = len(req.prompt)
        self.fed = 0
        self.slot = -1
        self.waiting = False  # a sampled token is on its way back
        self.last_mb = -1  # the last micro-batch it was in
        self.finish = ""
        self.error: str | None = None  # why, when finish is "error"
        self.t_admit = self.t_first = self.t_done = 0.0
        self.chain: list[int] = []  # prefix-cache nodes of its whole blocks so far
        self.cached = 0  # prompt tokens reused from the prefix cache
        self.pending: tuple | None = None  # the key of the prompt block it computes next
        self.nosave = False  # its blocks stopped being saved (no room, a block evicted)

    @property
    def ready(self) -> bool:
        return not self.finish and not self.waiting and self.fed < len(self.tokens)


class _Scheduler:
    """Rank 0: admits sequences, forms micro-batches, runs stage 0, collects tokens."""

    def __init__(self, st: _StageState, requests: Sequence[Request], t_start: float,
                 on_token: Callable[[int, int], None] | None,
                 stop_check: Callable[[int, list[int]], bool] | None, source=None,
                 drafter=None):
        self.st, self.t0 = st, t_start
        self.drafter = drafter  # speculative decoding's drafts (model/speculative.py)
        self.spec = {"drafted": 0, "accepted": 0, "draft_s": 0.0, "steps": 0}
        self.source = source  # a LiveRequests: requests arrive while running (serve)
        self.seqs = [_Seq(i, r) for i, r in enumerate(requests)]
        for s in self.seqs:
            if s.req.max_tokens <= 0:
                s.finish = "length"
        self.queue = deque(s for s in self.seqs if not s.finish)
        self.active: list[_Seq] = []
        self.free_slots = list(range(st.plan.max_slots))[::-1]
        self.inflight: deque = deque()
        self.ctrl: dict[str, list] = {"add": [], "free": [], "kv": [], "draft": []}
        self.on_token, self.stop_check = on_token, stop_check
        plan = st.plan
        #: rank 0's prefix-cache index (None: no prefix cache); its counters are stats
        self.prefix = PrefixIndex(
            plan.prefix_blocks, plan.prefix_block, plan.prefix_bytes,
            needs_state=bool(recurrent_layers(st.stage.config)),
            state_cost=plan.prefix_state) if plan.prefix_blocks > 0 else None
        if source is not None:
            source.prefix = self.prefix
        self.mb_id = 0
        self.decode_tokens = 0
        self.stopping = False
        self.size = st.group.size
        self.on_step: Callable[[float, float], None] | None = None  # busy reports

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def arrivals(self, wait: float = 0.0) -> None:
        """Serve: take new requests (waiting up to ``wait`` s for one) and cancellations."""
        src = self.source
        for req in src.take(wait):
            s = _Seq(req.key, req)
            if req.max_tokens <= 0:
                s.finish = "length"
                src.finish(req.key, "length")
                continue
            why = self.refusal(req)
            if why is not None:
                src.finish(req.key, "error", error=why)
                continue
            self.seqs.append(s)
            self.queue.append(s)
        for key in src.cancelled():
            for s in [s for s in self.queue if s.idx == key]:
                self.queue.remove(s)
                self.seqs.remove(s)
                src.finish(key, "cancelled")
            for s in [s for s in self.active if s.idx == key and not s.finish]:
                if s.waiting:
                    s.finish = "cancelled"  # retired when its token comes back
                else:
                    s.finish = "cancelled"
                    self.retire(s, self.now())

    def refusal(self, req: Request) -> str | None:
        """Why ``req`` cannot run (it would fail a stage), or None: its sampler builds, and
        its control message encodes for the wire. Checked before it joins, so that one
        request's bad values end that request alone."""
        try:
            Sampler(req.sampling)
            if self.size > 1:
                _ctrl_to_wire({"add": [(0, req.prompt, req.sampling)], "free": []})
        except Exception as exc:
            return _one_line(exc)
        return None

    def admit(self) -> None:
        if self.source is not None:
            self.arrivals()
        waiting = []
        while self.queue and self.free_slots and not self.stopping:
            s = self.queue.popleft()
            hit = self.lookup(s)
            if hit is None:  # its next block is being prefilled by another: wait for it
                waiting.append(s)
                continue
            s.slot = self.free_slots.pop()
            s.t_admit = self.now()
            self.active.append(s)
            self.ctrl["add"].append((s.idx, list(s.req.prompt), s.req.sampling))
            if self.prefix is not None:
                self.reuse(s, hit)
            if self.source is not None:  # its slot and cached tokens, in one update
                self.source.admitted(s.idx, s.slot, s.cached)
        self.queue.extendleft(reversed(waiting))

    # -- the prefix cache (rank 0 decides; every rank follows the "kv" instructions) -----

    def lookup(self, s: _Seq) -> list[int] | None:
        """The cached nodes that ``s``'s prompt starts with, or None when the block after
        them is a whole prompt block that an admitted sequence is prefilling now (then
        ``s`` waits a step, and reuses it once it is saved)."""
        px = self.prefix
        if px is None:
            return []
        prompt, b = s.req.prompt, px.block
        limit = len(prompt) - 1  # the last prompt token is always computed: its logits
        hit = px.usable(px.match(prompt, limit))
        if (len(hit) + 1) * b <= limit:
            key = px.key(hit[-1] if hit else ROOT, prompt[len(hit) * b:(len(hit) + 1) * b])
            if px.pending.get(key, s.idx) != s.idx:
                return None
        return hit

    def reuse(self, s: _Seq, hit: list[int]) -> None:
        """``s`` (just given its slot) starts from the cached blocks ``hit``."""
        px, b = self.prefix, self.prefix.block
        px.lookups += 1
        # and the first tokens of a cached block after them, up to the last prompt token
        lo = len(hit) * b
        part = px.partial(hit[-1] if hit else ROOT, s.req.prompt[lo:min(lo + b, s.n_prompt - 1)])
        if hit or part:
            px.touch(hit + [part[0]] if part else hit)
            s.chain = list(hit)
            s.fed = s.cached = lo + (part[1] if part else 0)
            px.hits += 1
            px.tokens_reused += s.cached
            self.ctrl["kv"].append((LOAD, s.slot, *(px.bid(n) for n in hit),
                                    *((px.bid(part[0]),) if part else ())))
            if part:
                self.ctrl["kv"].append((TRUNC, s.slot, s.cached))
        self.expect(s)

    def expect(self, s: _Seq) -> None:
        """Note the prompt block ``s`` computes next (others sharing it wait for it)."""
        px = self.prefix
        if px is None:
            return
        if s.pending is not None and px.pending.get(s.pending) == s.idx:
            del px.pending[s.pending]
        s.pending = None
        i, b = len(s.chain), px.block
        if not s.nosave and (i + 1) * b < s.n_prompt:
            s.pending = px.key(s.chain[-1] if s.chain else ROOT, s.req.prompt[i * b:(i + 1) * b])
            px.pending.setdefault(s.pending, s.idx)

    def save(self, s: _Seq, final: bool = False) -> None:
        """Store the whole blocks ``s`` has fed since the last time (after issuing them:
        the instruction follows them down every link). Blocks that hold generated tokens
        wait until they cover :data:`~.prefix.SAVE_RUN` tokens, or the sequence ends
        (``final``): one instruction every few decode steps, not one per block."""
        px, b = self.prefix, self.prefix.block
        new = s.fed // b - len(s.chain)
        if not final and new > 0 and s.fed // b * b > s.n_prompt and new * b < SAVE_RUN:
            self.expect(s)
            return
        while not s.nosave and (len(s.chain) + 1) * b <= s.fed:
            i = len(s.chain)
            # the recurrent states exist at the block's end only if it is what was fed
            state = px.needs_state and (i + 1) * b == s.fed
            got = px.add(s.chain[-1] if s.chain else ROOT, s.tokens[i * b:(i + 1) * b], state)
            if got is None:  # no room, or its previous block was evicted meanwhile
                s.nosave = True
                break
            node, bid = got
            if bid is not None:
                self.ctrl["kv"].append((SAVE, s.slot, i * b, b, bid, int(state)))
            s.chain.append(node)
        self.expect(s)

    def form(self) -> list[tuple[_Seq, int]]:
        """The next micro-batch: ready sequences, least recently served first.

        At most ``ceil(active / micro_batches)`` sequences and ``prefill_chunk``
        tokens (a decoding sequence brings one token, a prompt a chunk of it), or
        ``lone_chunk`` while every active sequence is still in its prompt.
        """
        plan = self.st.plan
        cap = max(1, math.ceil(len(self.active) / plan.micro_batches))
        budget = max(plan.chunk, cap)
        if plan.lone_chunk and all(s.fed < s.n_prompt for s in self.active):
            # nothing decoding: no stream for a small chunk to keep flowing, and each chunk
            # pays the weights once more (a quantized matrix is dequantized per product:
            # ~50 ms a chunk for SmolLM2 Q4_1 at one thread)
            budget = max(budget, plan.lone_chunk)
        out, used = [], 0
        cut = self.prefix is not None and self.prefix.needs_state
        for s in sorted((s for s in self.active if s.ready), key=lambda s: s.last_mb):
            if len(out) >= cap or used >= budget:
                break
            n = min(len(s.tokens) - s.fed, budget - used)
            if cut and s.fed < s.n_prompt:
                # a prompt chunk that crosses a block boundary ends at the last one it
                # crosses: the linear-attention states exist there, to be kept with it
                b = self.prefix.block
                end = (s.fed + n) // b * b
                n = end - s.fed if end > s.fed else n
            out.append((s, n))
            used += n
        return out

    def send_ctrl(self) -> None:
        if not any(self.ctrl.values()):
            return
        ctrl, self.ctrl = self.ctrl, {"add": [], "free": [], "kv": [], "draft": []}
        self.st.apply_ctrl(ctrl)
        if self.size > 1:
            payload = np.frombuffer(_ctrl_to_wire(ctrl), dtype=np.uint8).copy()
            hdr = np.array([CTRL, payload.size, 0, -1], dtype=WIRE)
            self.st.link.send(hdr, 1, TAG_FWD, "ctrl")
            self.st.link.send(payload, 1, TAG_FWD, "ctrl")

    def drafts(self, mb: list[tuple[_Seq, int]]) -> dict[int, list[int]]:
        """Draft tokens for the decoding sequences of ``mb`` (speculative decoding), also
        queued for the last stage in the control message; {} without a drafter."""
        want = []
        for s, n in mb:
            room = min(s.req.draft_k, s.req.max_tokens - (len(s.tokens) - s.n_prompt) - 1,
                       self.st.plan.max_len - len(s.tokens))
            # a grammar's mask is known one token ahead only: no drafts under one; nor
            # with logprobs (one row of them per step)
            if self.drafter is not None and room > 0 and n == 1 and \
                    s.req.sampling.grammar is None and s.req.sampling.logprobs < 0 and \
                    len(s.tokens) > s.n_prompt and s.fed + 1 == len(s.tokens):
                want.append((s, room))
        if not want:
            return {}
        t0 = time.perf_counter()
        got = self.drafter.propose([(s.slot, s.tokens, k, s.req.sampling) for s, k in want])
        self.spec["draft_s"] += time.perf_counter() - t0
        out = {}
        for (s, _), (d, q) in zip(want, got):
            if d:
                out[s.idx] = d
                self.ctrl["draft"].append((s.idx, d, q))
                self.spec["drafted"] += len(d)
                self.spec["steps"] += 1
        return out

    def issue(self, mb: list[tuple[_Seq, int]]) -> None:
        drafts = self.drafts(mb)
        self.send_ctrl()
        meta = np.empty((len(mb), META), dtype=WIRE)
        toks = []
        sampled = []
        for k, (s, n) in enumerate(mb):
            sample = s.fed + n == len(s.tokens)
            d = drafts.get(s.idx, [])  # scored after the sequence's last token
            meta[k] = (s.idx, s.slot, n + len(d), s.fed, (1 + len(d)) * sample)
            toks.extend(s.tokens[s.fed : s.fed + n])
            toks.extend(d)
            s.fed += n
            s.last_mb = self.mb_id
            if sample:
                s.waiting = True
                sampled.append((s, len(d)))
            if self.prefix is not None:
                self.save(s)
        phase = _phase(meta)
        if phase == "decode":
            self.decode_tokens += len(mb)
        x = np.asarray(toks, dtype=np.int64)
        mb_id = self.mb_id
        self.mb_id += 1
        h, out = self.st.compute(x, meta)
        if self.size == 1:
            self.receive(sampled, out, self.st.logp)
            return
        hdr = np.array([FWD, len(mb), x.size, mb_id], dtype=WIRE)
        link = self.st.link
        link.send(hdr, 1, TAG_FWD, phase)
        link.send(pack(meta, h), 1, TAG_FWD, phase)
        buf = np.empty(1 + sum(1 + k for _, k in sampled), dtype=WIRE)
        req = self.st.group.irecv(buf, self.size - 1, TAG_RET)
        n_lp = sum(1 + 2 * s.req.sampling.logprobs for s, _ in sampled
                   if s.req.sampling.logprobs >= 0)
        lp = None
        if n_lp:  # its logprobs follow the tokens
            lp = np.empty(n_lp)
            lp = (lp, self.st.group.irecv(lp, self.size - 1, TAG_LOGP))
        self.inflight.append((mb_id, sampled, buf, req, lp))

    def burst(self) -> bool:
        """One rank holding the whole model on MLX (generate), every active sequence
        decoding greedily: decode steps back to back as mlx-lm's generator does. Step
        t + 1's graph is built on step t's ids while they are still on the device and
        evaluated in the background (``async_eval``) while step t's ids are read: one
        host sync per step, and the host's work overlaps the device's. It ends when a
        sequence does (a step built past an EOS or stop string is dropped: its cache
        writes are at positions the next step overwrites, and the recurrent states it
        moved are put back, :meth:`~hpcmac.llm.model.cache.KVCache.hold`). False when
        the conditions do not hold (the ordinary loop then runs the step)."""
        st = self.st
        if (self.size != 1 or st.tensor is not None or not st.lazy or self.source is not None
                or self.drafter is not None or self.prefix is not None or self.queue
                or self.inflight or self.stopping or st.plan.keep_logits):
            return False
        seqs = list(self.active)
        if not seqs or any(not s.ready or s.fed + 1 != len(s.tokens) or
                           len(s.tokens) == s.n_prompt or not _device_greedy(s.req.sampling)
                           for s in seqs):
            return False
        self.send_ctrl()
        if any(st.samplers.get(s.idx) is None or st.samplers[s.idx].error for s in seqs):
            return False  # the ordinary path fails it alone
        meta = self._decode_meta(seqs)
        y = st.device_step(np.asarray([s.tokens[-1] for s in seqs], dtype=np.int64), meta)
        st.start(y)
        while True:
            self._fed(seqs)
            nxt = held = None
            if not self.stopping and all(  # every sequence goes on unless its token ends it
                    len(s.tokens) - s.n_prompt + 1 < s.req.max_tokens and
                    s.fed + 1 <= st.plan.max_len for s in seqs):
                nmeta = self._decode_meta(seqs)
                held = st.cache.hold([s.slot for s in seqs])  # the states before nxt
                nxt = st.device_step(y, nmeta)
                st.start(nxt)  # queued behind y: the device goes on while y is read
            toks = st.read(y, meta)
            self.receive([(s, 0) for s in seqs], toks)
            if nxt is None or any(s.finish for s in seqs):
                if held is not None:  # a step built for a sequence that ended is dropped
                    st.cache.put_back(held)
                return True
            y, meta = nxt, nmeta

    def _decode_meta(self, seqs: list[_Seq]) -> np.ndarray:
        """The meta rows of one decode step of ``seqs`` (one token each, at ``fed``)."""
        return np.array([(s.idx, s.slot, 1, s.fed, 1) for s in seqs], dtype=WIRE)

    def _fed(self, seqs: list[_Seq]) -> None:
        """A decode step of ``seqs`` issued (what :meth:`issue` records)."""
        for s in seqs:
            s.fed += 1
            s.last_mb = self.mb_id
            s.waiting = True
        self.decode_tokens += len(seqs)
        self.mb_id += 1

    def collect(self, block: bool) -> bool:
        """Take the oldest returned micro-batch; False when none was ready (non-blocking)."""
        if not self.inflight:
            return False
        mb_id, sampled, buf, req, lp = self.inflight[0]
        if block:
            self.st.link.wd.wait(req, self.size - 1, "to send back tokens",
                                 grace=0.5 * self.size + 1.0)
        elif not req.test():
            return False
        if lp is not None:  # sent right after the tokens
            self.st.link.wd.wait(lp[1], self.size - 1, "to send back logprobs",
                                 grace=0.5 * self.size + 1.0)
        self.inflight.popleft()
        if int(buf[0]) != mb_id:
            raise RuntimeError(f"pipeline out of order: expected micro-batch {mb_id}, got {buf[0]}")
        self.receive(sampled, buf[1:], lp[0] if lp is not None else None)
        return True

    def receive(self, sampled: list[tuple[_Seq, int]], toks: np.ndarray, logp=None) -> None:
        """Each sampled sequence's 1 + k returned slots: its new tokens (a speculative
        step's accepted drafts, then the target's own), then NONE; and the logprob rows
        of those that asked (``logp``)."""
        t = self.now()
        off = lp_off = 0
        for s, k in sampled:
            got = [int(x) for x in toks[off : off + 1 + k] if x != NONE]
            off += 1 + k
            want = s.req.sampling.logprobs
            if want >= 0 and logp is not None:
                row = logp[lp_off:lp_off + 1 + 2 * want]
                lp_off += 1 + 2 * want
                if got and got[0] != FAILED and s.finish != "cancelled" and \
                        self.source is not None:
                    self.source.logprob(s.idx, row)
            s.waiting = False
            if s.finish == "cancelled":  # the client left while this token was on its way
                self.retire(s, t)
                continue
            if not got or got[0] == FAILED:
                s.finish, s.error = "error", "sampling failed on the last stage"
                self.retire(s, t)
                continue
            # the cache holds the accepted drafts; the rest are overwritten from here on
            s.fed += len(got) - 1
            self.spec["accepted"] += len(got) - 1
            self.decode_tokens += len(got) - 1
            for tok in got:
                self.take(s, tok, t)
                if s.finish:
                    break

    def take(self, s: _Seq, tok: int, t: float) -> None:
        """One new token of ``s``: its callbacks, and whether it ends the sequence."""
        s.tokens.append(tok)
        gen = s.tokens[s.n_prompt :]
        if len(gen) == 1:
            s.t_first = t
        try:
            if self.on_token is not None:
                self.on_token(s.idx, tok)
            if tok in s.req.eos_ids:
                s.finish = "eos"
            elif self.stop_check is not None and self.stop_check(s.idx, gen):
                s.finish = "stop"
            elif len(gen) >= s.req.max_tokens:
                s.finish = "length"
        except Exception as exc:  # this request's callbacks: it ends, the rest go on
            if not self.st.plan.isolate:
                raise
            s.finish, s.error = "error", _one_line(exc)
        if s.finish:
            self.retire(s, t)

    def retire(self, s: _Seq, t: float) -> None:
        if self.prefix is not None:
            self.save(s, final=True)  # its last whole blocks (the slot's values outlive its free)
            s.nosave = True
            self.expect(s)  # what it was prefilling is no longer coming
        s.t_done = t
        self.active.remove(s)
        self.free_slots.append(s.slot)
        self.ctrl["free"].append((s.idx, s.slot))
        if self.drafter is not None:
            self.drafter.free(s.slot)
        if self.source is not None:  # serve: the sequence is done; its slot is free now
            self.seqs.remove(s)
            self.source.finish(s.idx, s.finish, len(s.tokens) - s.n_prompt, error=s.error)

    def idle(self) -> None:
        """Serve, nothing to do: wait for a request; ping the stages now and then, so
        that their watchdogs know rank 0 is alive."""
        self.send_ctrl()
        self.arrivals(wait=self.source.ping_s)
        if not self.queue and not self.source.closed:
            if self.size > 1:
                self.st.link.send(np.array([PING, 0, 0, -1], dtype=WIRE), 1, TAG_FWD, "ctrl")
            if self.st.tensor is not None:  # and this stage's own tensor ranks
                self.st.tensor.send_ping()

    def interrupt(self, signum=None, frame=None) -> None:
        """SIGINT: the first stops cleanly (in-flight micro-batches return, then STOP
        goes down the pipeline); a second one raises KeyboardInterrupt (the job aborts)."""
        if self.stopping:
            raise KeyboardInterrupt
        self.stopping = True
        print("interrupted: stopping the pipeline (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)

    def run(self) -> None:
        plan = self.st.plan
        while True:
            if self.stopping:
                while self.collect(block=True):
                    pass
                break
            if self.on_step is not None:
                self.on_step(self.st.stats.busy_s, self.st.stats.cpu_s)
            self.admit()
            while self.collect(block=False):
                pass
            if self.burst():
                continue
            if len(self.inflight) < plan.micro_batches:
                mb = self.form()
                if mb:
                    self.issue(mb)
                    continue
            if self.inflight:
                self.collect(block=True)
            elif not self.active and not self.queue:
                if self.source is None or self.source.closed:
                    break
                self.idle()
        t = self.now()
        for s in self.seqs:
            if s.finish:
                continue
            if s.slot >= 0:
                s.finish = "interrupted"
                s.t_done = t
            else:
                s.finish = "interrupted"
                s.t_admit = s.t_first = s.t_done = t
        self.send_ctrl()
        if self.size > 1:
            self.st.link.send(np.array([STOP, 0, 0, -1], dtype=WIRE), 1, TAG_FWD, "ctrl")


def default_chunk(prompt_tokens: int, stages: int) -> int:
    """Prompt tokens per micro-batch when not given.

    One stage: 512 (the chunk only bounds the activations). Several: enough
    chunks to fill the pipeline about four times over, so that the stages
    overlap on prefill (a pipeline of P stages and C chunks takes C + P - 1
    chunk-steps). The chunk is at least 32 tokens, below which its
    per-chunk costs (each chunk streams the stage's weights) dominate, and at
    most 512. SmolLM2, 256-token prompt, 2 ranks of one thread: chunks of 64
    gave 386-392 prompt tok/s, of 32 468-479; one rank 317.
    """
    if stages <= 1:
        return LONE_CHUNK
    return max(32, min(LONE_CHUNK, -(-prompt_tokens // (4 * stages))))


def run_pipeline(
    group: Group,
    stage,
    spec: StageSpec,
    hidden: int,
    requests: Sequence[Request] | None,
    *,
    micro_batches: int | None = None,
    max_batch: int | None = None,
    prefill_chunk: int | None = None,
    max_len: int | None = None,
    keep_logits: bool = False,
    on_token: Callable[[int, int], None] | None = None,
    stop_check: Callable[[int, list[int]], bool] | None = None,
    timeout: float = 60.0,
    hosts: Sequence[str] | None = None,
    tensor=None,
    ranks: Sequence[int] | None = None,
    source=None,
    prefix_blocks: int = 0,
    prefix_bytes: int = 0,
    prefix_block: int = BLOCK,
    prefix_state: int = 0,
    drafter=None,
    on_step: Callable[[float, float], None] | None = None,
) -> PipelineResult:
    """Collective: generate ``requests`` through the pipeline of ``group.size`` stages.

    Parameters
    ----------
    group : the ranks of the pipeline; rank r runs stage ``spec`` (local).
    stage : the loaded stage (``hpcmac.llm.model.load_stage``) matching ``spec``.
    hidden : the model's hidden size (global).
    requests : the sequences (rank 0; ignored elsewhere).
    micro_batches : micro-batches kept in flight (rank 0; default: one per stage).
    max_batch : sequences decoded at once, i.e. cache slots (rank 0; default: all, <= 64).
    prefill_chunk : prompt tokens per micro-batch (rank 0; default 512 on one
        rank; on several, the prompt tokens cut into 4 chunks per stage so that
        stages overlap, 32 to 512 tokens a chunk: see :func:`default_chunk`).
        Serving a ``source``: default 64 beside decoding streams, and on one stage
        512 while nothing decodes; a given chunk is the chunk always.
    max_len : cache length per sequence (rank 0; default: longest prompt + max_tokens).
    keep_logits : return every sampled step's logits (for tests; rank 0 decides).
    on_token, stop_check : rank 0 callbacks ``(seq index, token)`` as each token
        arrives, and ``(seq index, generated tokens) -> stop?``.
    timeout : seconds a rank may wait on a peer before ending the job (local).
    hosts : host name of each rank, for messages (global; gathered when None).
    tensor : this stage's :class:`~hpcmac.llm.parallel.tensor.TensorGroup` when
        each stage is a tensor group (this rank is its leader; the followers run
        :func:`~hpcmac.llm.parallel.tensor.follow`); see
        :func:`~hpcmac.llm.parallel.runtime.run_tensor_pipeline`.
    ranks : the job's rank of each rank of ``group``, for messages (default: the same).
    source : serve (rank 0): a :class:`~hpcmac.llm.parallel.live.LiveRequests`
        whose requests join while the pipeline runs, until it is closed;
        ``requests`` is then empty and ``max_batch``/``max_len`` size the cache.
    prefix_blocks : blocks the prefix cache holds (rank 0; 0: none; see
        :func:`~hpcmac.llm.parallel.prefix.capacity`): a prompt starting with cached
        blocks reuses their KV on every rank and prefills only the rest.
    prefix_bytes : one block's bytes on the rank holding the most (rank 0; stats).
    prefix_block : tokens per prefix block (rank 0).
    prefix_state : blocks of ``prefix_blocks`` that a block's linear-attention states
        take besides its KV (rank 0; :func:`~hpcmac.llm.parallel.prefix.state_cost`; 0: the
        model has none).
    drafter : speculative decoding (rank 0, the first stage's leader): a
        :class:`~hpcmac.llm.model.speculative.ModelDrafter` or ``NgramDrafter``
        proposing each request's ``draft_k`` tokens per step; the last stage
        verifies them (``result.speculative`` counts drafts and acceptances).
    on_step : called between steps with this rank's busy and CPU seconds so far
        (local; serve's busy reports, :mod:`~hpcmac.llm.parallel.busy`).

    Returns the same :class:`PipelineResult` on every rank.
    """
    p = group.size
    if hosts is None:
        hosts = group.allgather_obj(socket.gethostname())
    plan = None
    if group.rank == 0 and source is not None:
        plan = _Plan(n_seqs=0, max_slots=max(1, max_batch or 16), max_len=max_len or 4096,
                     micro_batches=max(1, micro_batches or p),
                     chunk=max(1, prefill_chunk or STREAM_CHUNK),
                     lone_chunk=0 if prefill_chunk or p > 1 else LONE_CHUNK,
                     keep_logits=False, isolate=True, prefix_blocks=prefix_blocks,
                     prefix_bytes=prefix_bytes, prefix_block=prefix_block,
                     prefix_state=prefix_state)
    elif group.rank == 0:
        reqs = list(requests or [])
        if not reqs:
            raise UsageError("no prompts to generate")
        longest = max(len(r.prompt) + r.max_tokens for r in reqs)
        plan = _Plan(
            n_seqs=len(reqs),
            max_slots=max(1, min(max_batch or min(len(reqs), 64), len(reqs))),
            max_len=max(max_len or 0, longest),
            micro_batches=max(1, micro_batches or p),
            chunk=max(1, prefill_chunk or default_chunk(sum(len(r.prompt) for r in reqs), p)),
            keep_logits=keep_logits, prefix_blocks=prefix_blocks, prefix_bytes=prefix_bytes,
            prefix_block=prefix_block, prefix_state=prefix_state,
        )
    plan = group.bcast_obj(plan, 0)
    if tensor is not None and tensor.size > 1:
        tensor.group.bcast_obj((plan.max_slots, plan.max_len), 0)
    watchdog = Watchdog(group, hosts, timeout, ranks=ranks)
    st = _StageState(group, stage, spec, hidden, plan, watchdog, hosts[group.rank], tensor)
    if p > 1:
        st.stats.sent_to = st.next if st.next >= 0 else -1
    group.barrier()
    t_start = time.perf_counter()
    seq_results = None
    interrupted = False
    decode_tokens = 0
    prefix = None
    spec_stats = None
    if group.rank == 0:
        if drafter is not None:
            drafter.start(plan.max_slots, plan.max_len)
        sched = _Scheduler(st, requests or [], t_start, on_token, stop_check, source, drafter)
        sched.on_step = on_step
        old = None
        from hpcmac.interrupts import deferred

        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGINT, sched.interrupt)
        try:
            with deferred(signal.SIGINT):  # hpcmac.interrupts leaves this SIGINT to us
                sched.run()
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
        st.link.flush()
        st.stats.wall_s = time.perf_counter() - t_start
        interrupted = sched.stopping
        decode_tokens = sched.decode_tokens
        prefix = sched.prefix.stats() if sched.prefix is not None else None
        spec_stats = sched.spec if drafter is not None else None
        seq_results = [
            SeqResult(s.idx, list(s.req.prompt), s.tokens[s.n_prompt :], s.finish,
                      s.t_admit, s.t_first, s.t_done, cached_tokens=s.cached)
            for s in sched.seqs
        ]
    else:
        _serve(st, t_start, on_step)
    if tensor is not None:
        tensor.send_stop()
    for (dest, phase), nb in st.link.bytes.items():
        is_ret = dest == 0 and group.rank == p - 1 and p > 1
        target = st.stats.ret_sent if is_ret else st.stats.sent
        target[phase] = target.get(phase, 0) + nb
    stats = group.allgather_obj(st.stats)
    logits = group.allgather_obj(st.logits if spec.last else None)[p - 1]
    seq_results, interrupted, decode_tokens, prefix, spec_stats = group.bcast_obj(
        (seq_results, interrupted, decode_tokens, prefix, spec_stats), 0)
    if keep_logits and logits is not None:
        for s in seq_results:
            s.logits = logits.get(s.index, [])
    return PipelineResult(seq_results, stats, max(x.wall_s for x in stats), decode_tokens,
                          interrupted, prefix=prefix, speculative=spec_stats)
