"""``python -m hpcmac.llm``: one ``generate`` for 1 and N ranks, and ``bench``.

``generate`` chooses the layout (tensor groups x pipeline stages; one rank is a
single stage holding the whole model), checks every rank's share fits, loads it
and runs it; rank 0 alone prints the text and writes the JSON. ``bench`` hands its flags to
``python -m hpcmac bench llm_pipeline`` (the benchmarks live above ``llm``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.inputs import parse_json, read_text
from hpcmac.llm.args import (  # noqa: F401 (check_threads, MAX_THREADS, MIN_TIMEOUT: the flags' API)
    MAX_THREADS,
    MIN_TIMEOUT,
    add_generate_args,
    check_arguments,
    check_threads,
    context_length,
    draft_of,
)
from hpcmac.llm.model.sampling import SamplingParams
from hpcmac.llm.parallel.pipeline import PipelineResult, Request, SeqResult
from hpcmac.llm.parallel.placement import LayoutFlags, Placement
from hpcmac.llm.parallel.plan import agree
from hpcmac.llm.parallel.runtime import (
    agree_draft,
    agree_placement,
    agree_prefix_cache,
    bring_up,
    gather_cluster,
    hostfile_path,
    read_job_hostfile,
)
from hpcmac.plan import job as plan_job

# -- arguments ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: ``generate``, ``serve``, ``models`` and ``bench``."""
    ap = ArgumentParser(
        prog="python -m hpcmac.llm",
        description="Decoder-only LLM inference, tensor- and pipeline-parallel over the ranks.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate",
                       help="generate text (one rank, or tensor and pipeline groups of ranks)")
    add_generate_args(g)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the ranks (rank 0 "
                                     "listens; see docs/serve.md)")
    add_generate_args(s, prompts=False)
    from hpcmac.llm.server import add_serve_args
    from hpcmac.llm.survive.args import add_survive_args

    add_serve_args(s)
    add_survive_args(s)
    s.set_defaults(max_tokens=512)
    m = sub.add_parser("models", help="the model families and checkpoint formats read, "
                                      "and the layouts each runs under")
    from hpcmac.llm.models import add_models_args

    add_models_args(m)
    b = sub.add_parser("bench", add_help=False,
                       help="pipeline benchmark at 1, 2, 4 ranks (see bench --help)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


# -- prompts -----------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str | None
    ids: list[int] | None
    max_tokens: int


def _parse_ids(text: str, where: str) -> list[int]:
    """Comma-separated ids of plain ASCII digits (``int()`` took ``١,٢`` for 1,2)."""
    from hpcmac.io.inputs import parse_int

    ids = [parse_int(x) for x in str(text).replace(" ", "").split(",") if x != ""]
    if any(i is None for i in ids):
        raise UsageError(f"{where}: expected comma-separated token ids (ASCII digits), "
                         f"got {text!r}")
    if not ids:
        raise UsageError(f"{where}: no token ids")
    return ids


def read_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The prompts of ``--prompt``, ``--prompt-ids`` or ``--batch FILE`` (rank 0)."""
    if args.prompt is not None:
        return [Prompt(args.prompt, None, args.max_tokens)]
    if args.prompt_ids is not None:
        return [Prompt(None, _parse_ids(args.prompt_ids, "--prompt-ids"), args.max_tokens)]
    # at most 64 MiB of UTF-8 from a regular file (never a FIFO or /dev/zero)
    lines = read_text(args.batch, "--batch", 64 << 20).split("\n")
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{args.batch} line {no}"
        if not line.lstrip().startswith("{"):
            out.append(Prompt(line, None, args.max_tokens))
            continue
        obj = parse_json(line, where)
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object with 'prompt' or 'prompt_ids'")
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


def prompt_tokens(p: Prompt, tok, cfg, args) -> list[int]:
    """One prompt as ids: its ids (checked against the vocabulary), or its text through
    the chat template (unless ``--ignore-chat-template``) and the tokenizer."""
    if p.ids is not None:
        bad = [i for i in p.ids if not 0 <= i < cfg.vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token {bad[0]} is outside the vocabulary "
                             f"[0, {cfg.vocab})")
        return list(p.ids)
    if tok is None:
        raise UsageError(f"--model {args.model}: the checkpoint has no tokenizer; "
                         "give --prompt-ids instead of --prompt")
    if tok.chat_template and not args.ignore_chat_template:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) \
            + [{"role": "user", "content": p.text}]
        return tok.encode(tok.apply_chat_template(msgs), add_bos=False) \
            if tok.bos_token and tok.chat_template.find("bos_token") >= 0 \
            else tok.encode(tok.apply_chat_template(msgs))
    return tok.encode(p.text)


def make_requests(prompts: list[Prompt], args, tok, cfg, sampling: SamplingParams,
                  context: int) -> list[Request]:
    """Token-level requests (rank 0): through the chat template and the prompt checks.

    Sequence ``i`` samples with seed ``seed + i``, as the one-rank batched
    generator does, so each prompt gets the tokens it would get alone with that seed.
    """
    from hpcmac.llm.model.generate import check_prompt

    eos = tuple(tok.eos_ids if tok is not None and tok.eos_ids else cfg.eos_token_ids)
    reqs = []
    for i, p in enumerate(prompts):
        try:
            ids = prompt_tokens(p, tok, cfg, args)
            check_prompt(len(ids), context)
        except UsageError as exc:
            raise UsageError(f"prompt {i}: {exc}" if len(prompts) > 1 else str(exc)) from None
        params = SamplingParams(**{**sampling.__dict__,
                                   "seed": None if sampling.seed is None else sampling.seed + i})
        # a sequence ends when the context is full: say so now, not by a silent "length"
        room = context - len(ids)
        if p.max_tokens > room:
            which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            print(f"note: {which}: {len(ids)} prompt tokens + {p.max_tokens} new tokens exceed "
                  f"the context of {context}: at most {room} new tokens (--max-context)",
                  file=sys.stderr, flush=True)
        reqs.append(Request(list(ids), min(p.max_tokens, room), params, eos,
                            args.draft_k if draft_of(args) else 0))
    return reqs


# -- the command -------------------------------------------------------------------------


def run_generate(args: argparse.Namespace, group=None, out=None) -> int:
    """Run ``generate`` on every rank (collective); rank 0 alone prints and writes JSON.

    Parameters
    ----------
    args : parsed :func:`build_parser` flags (global: the same on every rank).
    group : the job's ranks (default: ``hpcmac.comm.init(args.transport)`` when
        launched on several ranks or given ``--transport``, else a one-rank group).
    out : where rank 0 writes the text (default stdout).

    Returns the exit code: 0, or 130 when rank 0 was interrupted (Ctrl-C).
    """
    from hpcmac import comm
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.generate import StopChecker
    from hpcmac.llm.model.gguf_loader import forget_readers
    from hpcmac.llm.model.tokenizer import load_tokenizer

    sampling = check_arguments(args)
    out = sys.stdout if out is None else out
    if group is None:  # one rank without --transport: no MPI to start
        # the transport line waits until the input is known good: bad input is one line
        from hpcmac.launch.hostfile import job_hostfile

        group = comm.job_group(args.transport, announce=False,
                               hostfile=lambda: job_hostfile(getattr(args, "hostfile", None)))
    agree(group, lambda: _check_output(args), ranks="root")
    agree(group, lambda: check_threads(args.threads))
    cfg = agree(group, lambda: load_config(args.model))
    context = agree(group, lambda: context_length(args, cfg))
    agree_draft(group, draft_of(args), args.model, cfg)
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
    # the job's hostfile, read once (rank 0) and handed down
    hostfile = agree(group, lambda: read_job_hostfile(hostfile_path(args.hostfile)),
                     ranks="root")
    cluster = gather_cluster(group, hostfile)
    # hpcmac.plan's prediction of every layout (none without node figures: docs/plan.md)
    preds, no_pred = agree(group, lambda: plan_job.for_generate(
        args.model, list(cluster.hosts), hostfile=hostfile, transport=cluster.transport,
        sequences=len(reqs), prompt=max(len(r.prompt) for r in reqs), context=shape[1],
        backend=args.backend, quantize=args.quantize, group_size=args.q_group_size),
        ranks="root")
    best = preds[0] if preds and preds[0].fits else None
    placement = agree_placement(
        group, cfg, args.model, cluster, LayoutFlags.of(args), kv_tokens=slots * shape[1],
        sequences=len(reqs), slots=slots, quantize=args.quantize, group_size=args.q_group_size,
        draft=draft_of(args),
        predicted=(best.tp, best.pp, plan_job.why_chosen(preds)) if best else None)
    blocks, block_bytes, state_cost, cache_line = agree_prefix_cache(
        group, cfg, placement, args.prefix_cache_gb)
    rt = bring_up(group, placement, args.model, cfg, backend=args.backend,
                  quantize=args.quantize, group_size=args.q_group_size,
                  int8_activations=args.int8_activations, timeout=args.timeout,
                  draft=draft_of(args))
    forget_readers()  # tokenizer, plan and stage are read: drop the parsed GGUF metadata
    # the transport line once every input is known good (layout, split, weights): a
    # refusal is one line, with no transport line before it
    comm.announce()
    if group.rank == 0 and group.size > 1:
        print(placement.describe(), file=sys.stderr, flush=True)
    if group.rank == 0 and (args.prefix_cache_gb is not None or not blocks):
        print(cache_line, file=sys.stderr, flush=True)
    show = _Printer(tok, stop, out, len(reqs), args.quiet) if group.rank == 0 else None
    stop_check = None
    if group.rank == 0 and stop.stops:
        def stop_check(i: int, gen: list[int]) -> bool:
            return stop.hit(gen)[0]

    res = rt.run(
        reqs if group.rank == 0 else None, threads=args.threads,
        micro_batches=args.micro_batches or None, max_batch=slots,
        prefill_chunk=args.prefill_chunk or None, max_len=shape[1],
        on_token=show.token if show else None, stop_check=stop_check,
        prefix_blocks=blocks, prefix_bytes=block_bytes, prefix_state=state_cost,
    )
    from hpcmac.io.outputs import OutputError, write_atomic

    failed = None
    if group.rank == 0:
        show.finish(res)
        if args.json:
            doc = result_json(res, tok, stop, placement)
            doc["weights"] = weights_json(rt.stage)
            doc["prediction"] = plan_job.prediction_json(preds, placement.tp, placement.pp,
                                                         no_pred)
            try:
                write_atomic(args.json, json.dumps(doc, indent=1), what="--json")
            except OutputError as exc:  # a full disk: one line on every rank, exit 1
                failed = str(exc)
    if group.size > 1:
        failed = group.bcast_obj(failed, 0)
    if failed:
        raise OutputError(failed, local=False)
    return 130 if res.interrupted else 0


#: output locks held by rank 0 for the whole run (released when the process ends)
_OUTPUT_LOCKS: list = []


def _check_output(args) -> None:
    """Rank 0, before any work: --json must be writable and not another job's."""
    if args.json:
        import atexit

        from hpcmac.io.outputs import OutputLock, check_writable

        check_writable(args.json, "--json")
        lock = OutputLock(args.json, "--json")
        _OUTPUT_LOCKS.append(lock)
        atexit.register(lock.release)


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
    spec = ""
    if res.speculative:
        sp = res.speculative
        spec = (f"; speculative: {sp['accepted']} of {sp['drafted']} draft tokens accepted "
                f"({res.acceptance():.0%}), {sp['draft_s']:.2f} s drafting")
    return (f"{n} sequence{'s' * (n != 1)}, {res.generated} tokens: prefill "
            f"{res.prefill_tok_s():.1f} tok/s, decode {res.decode_tok_s():.1f} tok/s "
            f"aggregate; stage busy {busy}{spec}")


def result_json(res: PipelineResult, tok, stop, plan: Placement | None) -> dict:
    """Part 1's JSON fields (of the first sequence) plus every sequence and the pipeline."""
    seqs = []
    for s in res.seqs:
        seqs.append({
            "prompt_tokens": s.prompt_tokens, "tokens": s.tokens, "text": _text(tok, stop, s),
            "cached_tokens": s.cached_tokens, "finish_reason": s.finish, "ttft_s": s.ttft,
            "prefill_tok_s": len(s.prompt_tokens) / s.ttft if s.ttft > 0 else 0.0,
            "decode_tok_s": s.decode_tok_s,
        })
    doc: dict[str, Any] = dict(seqs[0])
    host = res.host_per_token()
    doc.update({
        "sequences": seqs,
        "aggregate_prefill_tok_s": res.prefill_tok_s(),
        "aggregate_decode_tok_s": res.decode_tok_s(),
        "wall_s": res.wall_s,
        "ranks": len(res.stats),
        "stages": [{"rank": st.rank, "host": st.host, "layers": list(st.layers),
                    "busy": st.busy, "micro_batches": st.micro_batches} for st in res.stats],
        "bytes_per_token": res.link_bytes_per_token(),
        "host": host,
        # the busiest rank's (one rank: its own), beside the per-rank list
        "host_syncs_per_token": max((h["host_syncs_per_token"] for h in host), default=0.0),
        "host_bytes_per_token": max((h["host_bytes_per_token"] for h in host), default=0.0),
        "interrupted": res.interrupted,
        "prefix_cache": res.prefix,
    })
    if plan is not None:
        doc["split"] = {"how": plan.how, "layers": [s.n_layers for s in plan.stages],
                        "need_bytes": plan.need, "budget_bytes": plan.budgets}
        doc["layout"] = plan.json()
        doc["ranks"] = plan.size
    if res.tensor:
        doc["tensor"] = res.tensor
    if res.speculative:
        doc["speculative"] = {**res.speculative, "acceptance": res.acceptance()}
    return doc


def weights_json(stage) -> dict:
    """What rank 0's stage holds: bytes, and the quantized formats kept (source -> tensors)."""
    return {"rank": 0, "bytes": int(stage.nbytes), "quantized": dict(getattr(stage, "formats", {})),
            "backend": stage.backend.name}


#: what the ``llm`` extra installs (pyproject.toml) and generate imports, by import name
LLM_EXTRA = ("gguf", "tokenizers", "jinja2", "numba")


def require_llm_extra() -> None:
    """One UsageError line naming the ``pip install`` when the ``llm`` extra is missing.

    Checked on every rank before any work (the same answer everywhere), so a
    plain ``pip install hpcmac`` gets a sentence instead of an import traceback.
    """
    import importlib.util

    missing = [m for m in LLM_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"python -m hpcmac.llm needs the llm extra ({', '.join(missing)} "
                         "not installed): pip install 'hpcmac[llm]' (in a checkout: "
                         "pip install -e '.[llm]', or make run)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its flags go to the benchmark as they are (argparse's
        from hpcmac.__main__ import main as hpcmac_main  # REMAINDER drops a leading --x)

        return hpcmac_main(["bench", "llm_pipeline", *argv[1:]])
    args = build_parser().parse_args(argv)
    if args.command == "models":
        from hpcmac.llm.models import run_models

        return run_models(args)
    require_llm_extra()
    if args.command == "serve" and args.survive:
        from hpcmac.llm.survive.supervisor import run_survive

        return run_survive(args, argv[1:])
    if args.command == "serve":
        from hpcmac.llm.server import run_serve

        return run_serve(args)
    return run_generate(args)
