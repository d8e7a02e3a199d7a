"""``generate`` over any number of ranks: plan the stages, load them, run the pipeline.

:func:`run_generate` is the entry point the ``python -m hpcmac.llm generate``
command calls (with one rank too: a single stage). :func:`add_pipeline_arguments`
adds the part-2 flags (``--split``, ``--batch``, ``--transport``, ...) to the
generate parser; :func:`build_parser` is the whole parser, for running this
module directly (``python -m hpcmac.llm.pipeline_cli``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.llm import stages as S
from hpcmac.llm.pipeline import PipelineResult, Request, SeqResult, run_pipeline
from hpcmac.llm.sampling import SamplingParams

# -- arguments ------------------------------------------------------------------------


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """Add the pipeline flags to part 1's ``generate`` parser (``add_generate_args``).

    ``--batch FILE`` joins the ``--prompt`` / ``--prompt-ids`` choice: exactly one
    of the three is required.
    """
    prompt_group = next((grp for grp in p._mutually_exclusive_groups
                         if any(a.dest == "prompt" for a in grp._group_actions)), None)
    batch_help = ('prompts to generate together: one per line, or JSON lines with "prompt" '
                  'or "prompt_ids" and optional "max_tokens"')
    (prompt_group or p).add_argument("--batch", metavar="FILE", help=batch_help)
    g = p.add_argument_group("pipeline (several ranks)")
    g.add_argument("--split", help="layers per rank, e.g. 10,10,6,4 (default: by memory)")
    g.add_argument("--transport", choices=("auto", "mpi", "rdma", "ring", "local"),
                   help="comm backend (default: HPCMAC_TRANSPORT or auto)")
    g.add_argument("--hostfile", help="JSON hostfile whose memory_gb sets the split "
                                      "(default: HPCMAC_HOSTFILE)")
    g.add_argument("--micro-batches", type=int, default=0,
                   help="micro-batches in flight (default: one per stage)")
    g.add_argument("--max-batch", type=int, default=0,
                   help="sequences decoded at once (default: all prompts, at most 64)")
    g.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt tokens per micro-batch (default: 512 on one rank; on "
                        "several, 4 chunks per stage, 32 to 512 tokens each)")
    g.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits on a silent peer before ending the job")


def build_parser() -> argparse.ArgumentParser:
    """The ``generate`` parser: part 1's flags plus the pipeline's."""
    from hpcmac.llm.__main__ import add_generate_args

    p = ArgumentParser(prog="python -m hpcmac.llm generate",
                       description="generate text, pipeline-parallel over the ranks")
    add_generate_args(p)
    add_pipeline_arguments(p)
    return p


def check_arguments(args: argparse.Namespace) -> SamplingParams:
    """Local checks every rank makes identically before any collective."""
    from hpcmac.llm.__main__ import check_generate_args

    sampling = check_generate_args(args)
    for name in ("micro_batches", "max_batch", "prefill_chunk"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected >= 0")
    if args.timeout < 0:
        raise UsageError(f"--timeout {args.timeout}: expected >= 0 (0: no watchdog)")
    return sampling


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


# -- prompts -----------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str | None
    ids: list[int] | None
    max_tokens: int


def _parse_ids(text: str, where: str) -> list[int]:
    try:
        ids = [int(x) for x in str(text).replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"{where}: expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise UsageError(f"{where}: no token ids")
    return ids


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts of ``--prompt``, ``--prompt-ids`` or ``--batch FILE`` (rank 0)."""
    if args.prompt is not None:
        return [Prompt(args.prompt, None, args.max_tokens)]
    if args.prompt_ids is not None:
        return [Prompt(None, _parse_ids(args.prompt_ids, "--prompt-ids"), args.max_tokens)]
    try:
        with open(args.batch, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UsageError(f"--batch {args.batch}: cannot read ({exc.strerror})") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{args.batch} line {no}"
        if not line.lstrip().startswith("{"):
            out.append(Prompt(line, None, args.max_tokens))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not JSON ({exc.msg})") from None
        mt = obj.get("max_tokens", args.max_tokens)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
            raise UsageError(f"{where}: max_tokens must be an integer >= 0")
        if "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if isinstance(ids, str):
                ids = _parse_ids(ids, where)
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise UsageError(f"{where}: prompt_ids must be a non-empty list of token ids")
            out.append(Prompt(None, ids, mt))
        elif isinstance(obj.get("prompt"), str):
            out.append(Prompt(obj["prompt"], None, mt))
        else:
            raise UsageError(f"{where}: expected a 'prompt' string or 'prompt_ids'")
    if not out:
        raise UsageError(f"--batch {args.batch}: no prompts")
    return out


def make_requests(prompts: list[Prompt], args, tok, cfg, sampling: SamplingParams,
                  context: int) -> list[Request]:
    """Token-level requests (rank 0): through part 1's chat template and prompt checks.

    Sequence ``i`` samples with seed ``seed + i``, as part 1's batched generator
    does, so each prompt gets the tokens it would get alone with that seed.
    """
    from hpcmac.llm.__main__ import prompt_tokens
    from hpcmac.llm.generate import check_prompt

    eos = tuple(tok.eos_ids if tok is not None and tok.eos_ids else cfg.eos_token_ids)
    reqs = []
    for i, p in enumerate(prompts):
        one = argparse.Namespace(**{**vars(args), "prompt": p.text,
                                    "prompt_ids": None if p.ids is None else
                                    ",".join(map(str, p.ids))})
        try:
            ids = prompt_tokens(one, tok, cfg)
            check_prompt(len(ids), context)
        except UsageError as exc:
            raise UsageError(f"prompt {i}: {exc}" if len(prompts) > 1 else str(exc)) from None
        params = SamplingParams(**{**sampling.__dict__,
                                   "seed": None if sampling.seed is None else sampling.seed + i})
        # like part 1: a sequence ends when the context is full
        reqs.append(Request(list(ids), min(p.max_tokens, context - len(ids)), params, eos))
    return reqs


# -- planning ----------------------------------------------------------------------------


def kv_bytes_per_token_layer(cfg) -> int:
    """Bytes of KV cache one token takes in one layer (float32)."""
    if getattr(cfg, "mla", False):
        return 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 4 * 2 * cfg.n_kv_heads * cfg.head_dim


def weight_bytes(model: str, quantize: int | None = None,
                 group_size: int = 64) -> tuple[list[int], int, int]:
    """Bytes of each layer, of the embedding and of the norm + head, as loaded (headers only).

    ``hpcmac.llm.weights.stage_nbytes`` of each piece, with the checkpoint opened
    once; ``quantize``/``group_size`` as there.
    """
    from hpcmac.llm.weights import open_checkpoint, stage_nbytes

    ckpt = open_checkpoint(model)
    n_layers = ckpt.config().n_layers

    def nbytes(start: int, end: int, first: bool, last: bool) -> int:
        return stage_nbytes(ckpt, start, end, first, last, quantize, group_size)

    layers = [nbytes(i, i + 1, False, False) for i in range(n_layers)]
    return layers, nbytes(0, 0, True, False), nbytes(0, 0, False, True)


@dataclass
class StagePlan:
    """Global: the split, what each stage needs and may use, and where it runs."""

    stages: list[S.StageSpec]
    need: list[int]  # bytes per rank: weights + KV cache
    budgets: list[float]
    hosts: list[str]
    how: str  # "split", "memory" or "hostfile"


def plan_stages(group, model: str, cfg, split: str | None, hostfile: str | None,
                kv_tokens: int, quantize: int | None = None, group_size: int = 64) -> StagePlan:
    """Collective: choose every rank's layers and check they fit, before loading anything.

    ``kv_tokens`` is the cache size in tokens (slots x length, global);
    ``quantize``/``group_size`` as ``--quantize``/``--q-group-size``.
    """
    p = group.size
    mem = group.allgather_obj((socket.gethostname(), S.available_memory()))
    hosts = [h for h, _ in mem]

    def bytes_of() -> tuple[list[int], int, int]:
        S.check_ranks(cfg.n_layers, p)
        return weight_bytes(model, quantize, group_size)

    layer_b, embed_b, head_b = agree(group, bytes_of, ranks="root")
    hf = None
    if hostfile:
        hf = agree(group, lambda: S.read_hostfile(hostfile), ranks="root")
    budgets = S.rank_budgets(hosts, [a for _, a in mem], hf)
    kv = kv_bytes_per_token_layer(cfg) * kv_tokens
    per_layer = [b + kv for b in layer_b]
    if split:
        counts = S.parse_split(split, cfg.n_layers, p)
        how = "split"
    else:
        counts = S.proportional_counts(per_layer, embed_b, head_b, budgets)
        how = "hostfile" if hf else "memory"
    specs = S.stages_from_counts(counts)
    need = S.stage_bytes(counts, per_layer, embed_b, head_b)
    S.check_fit(specs, need, budgets, hosts)
    return StagePlan(specs, need, budgets, hosts, how)


# -- the command -------------------------------------------------------------------------


def run_generate(args: argparse.Namespace, group=None, out=None) -> int:
    """Run ``generate`` on every rank (collective); rank 0 alone prints and writes JSON.

    Parameters
    ----------
    args : parsed :func:`build_parser` flags (global: the same on every rank).
    group : the pipeline's ranks (default: ``hpcmac.comm.init(args.transport)``).
    out : where rank 0 writes the text (default stdout).

    Returns the exit code: 0, or 130 when rank 0 was interrupted (Ctrl-C).
    """
    from hpcmac import comm
    from hpcmac.llm.__main__ import context_length
    from hpcmac.llm.config import load_config
    from hpcmac.llm.generate import StopChecker
    from hpcmac.llm.model import load_stage
    from hpcmac.llm.tokenizer import load_tokenizer

    sampling = check_arguments(args)
    out = sys.stdout if out is None else out
    group = comm.init(args.transport) if group is None else group
    cfg = agree(group, lambda: load_config(args.model))
    context = agree(group, lambda: context_length(args, cfg))
    tok, stop = None, None

    def requests() -> list[Request]:
        nonlocal tok, stop
        prompts = read_prompts(args)
        if any(p.text is not None for p in prompts) or args.stop:
            tok = load_tokenizer(args.model)
        eos = tok.eos_ids if tok is not None and tok.eos_ids else cfg.eos_token_ids
        stop = StopChecker(eos, args.stop, tok)
        return make_requests(prompts, args, tok, cfg, sampling, context)

    reqs = agree(group, requests, ranks="root")
    shape = (len(reqs), max(len(r.prompt) + r.max_tokens for r in reqs))
    slots = min(args.max_batch or min(shape[0], 64), shape[0])
    hostfile = args.hostfile or os.environ.get("HPCMAC_HOSTFILE") or None
    plan = plan_stages(group, args.model, cfg, args.split, hostfile, slots * shape[1],
                       args.quantize, args.q_group_size)
    spec = plan.stages[group.rank]
    stage = agree(group, lambda: load_stage(args.model, spec.start, spec.end, first=spec.first,
                                            last=spec.last, backend=args.backend,
                                            quantize=args.quantize,
                                            group_size=args.q_group_size))
    if group.rank == 0 and group.size > 1:
        print(f"pipeline: {group.size} stages, layers {[s.n_layers for s in plan.stages]} "
              f"(split by {plan.how})", file=sys.stderr, flush=True)
    show = _Printer(tok, stop, out, len(reqs), args.quiet) if group.rank == 0 else None
    stop_check = None
    if group.rank == 0 and stop.stops:
        def stop_check(i: int, gen: list[int]) -> bool:
            return stop.hit(gen)[0]

    threads = None
    if args.threads is not None:
        from threadpoolctl import threadpool_limits

        threads = threadpool_limits(args.threads)
    try:
        res = run_pipeline(
            group, stage, spec, cfg.hidden, reqs if group.rank == 0 else None,
            micro_batches=args.micro_batches or None, max_batch=slots,
            prefill_chunk=args.prefill_chunk or None, max_len=shape[1],
            on_token=show.token if show else None, stop_check=stop_check,
            timeout=args.timeout, hosts=plan.hosts,
        )
    finally:
        if threads is not None:
            threads.unregister()
    if group.rank == 0:
        show.finish(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result_json(res, tok, stop, plan), f, indent=1)
    return 130 if res.interrupted else 0


def _body(s: SeqResult) -> list[int]:
    """Generated ids without the closing EOS (as part 1 reports text)."""
    return s.tokens[:-1] if s.finish == "eos" else s.tokens


def _text(tok, stop, s: SeqResult) -> str | None:
    if tok is None:
        return None
    text = tok.decode(_body(s))
    return stop.trim(text) if stop is not None else text


class _Printer:
    """Rank 0: streams the text of a single prompt as it comes; lists a batch at the end."""

    def __init__(self, tok, stop, out, n: int, quiet: bool):
        self.tok, self.stop, self.out, self.n, self.quiet = tok, stop, out, n, quiet
        self.stream = tok.stream() if tok is not None and n == 1 and not quiet else None

    def token(self, idx: int, tok_id: int) -> None:
        if self.stream is not None and tok_id not in self.stop.eos:
            piece = self.stream.push(tok_id)
            if piece:
                self.out.write(piece)
                self.out.flush()

    def finish(self, res: PipelineResult) -> None:
        if self.stream is not None:
            self.out.write("\n")
        elif not self.quiet:
            for s in res.seqs:
                body = _text(self.tok, self.stop, s) if self.tok is not None else \
                    ",".join(map(str, s.tokens))
                self.out.write(body + "\n" if self.n == 1 else f"[{s.index}] {body}\n")
        self.out.flush()
        print(summary_line(res), file=sys.stderr, flush=True)


def summary_line(res: PipelineResult) -> str:
    n = len(res.seqs)
    busy = " ".join(f"{st.busy:.0%}" for st in res.stats)
    return (f"{n} sequence{'s' * (n != 1)}, {res.generated} tokens: prefill "
            f"{res.prefill_tok_s():.1f} tok/s, decode {res.decode_tok_s():.1f} tok/s "
            f"aggregate; stage busy {busy}")


def result_json(res: PipelineResult, tok, stop, plan: StagePlan | None) -> dict:
    """Part 1's JSON fields (of the first sequence) plus every sequence and the pipeline."""
    seqs = []
    for s in res.seqs:
        seqs.append({
            "prompt_tokens": s.prompt_tokens, "tokens": s.tokens, "text": _text(tok, stop, s),
            "finish_reason": s.finish, "ttft_s": s.ttft,
            "prefill_tok_s": len(s.prompt_tokens) / s.ttft if s.ttft > 0 else 0.0,
            "decode_tok_s": s.decode_tok_s,
        })
    doc: dict[str, Any] = dict(seqs[0])
    doc.update({
        "sequences": seqs,
        "aggregate_prefill_tok_s": res.prefill_tok_s(),
        "aggregate_decode_tok_s": res.decode_tok_s(),
        "ranks": len(res.stats),
        "stages": [{"rank": st.rank, "host": st.host, "layers": list(st.layers),
                    "busy": st.busy, "micro_batches": st.micro_batches} for st in res.stats],
        "bytes_per_token": res.link_bytes_per_token(),
        "interrupted": res.interrupted,
    })
    if plan is not None:
        doc["split"] = {"how": plan.how, "layers": [s.n_layers for s in plan.stages],
                        "need_bytes": plan.need, "budget_bytes": plan.budgets}
    return doc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_generate(args)


if __name__ == "__main__":
    from hpcmac.errors import run_cli

    raise SystemExit(run_cli(main))
