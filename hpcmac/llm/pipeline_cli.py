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
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcmac.errors import UsageError
from hpcmac.llm import stages as S
from hpcmac.llm.pipeline import PipelineResult, Request, SamplingParams, run_pipeline

# -- arguments ------------------------------------------------------------------------


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """The single-rank generate flags (part 1's names), for the standalone parser."""
    p.add_argument("--model", required=True, help="model folder, GGUF file or a short name")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--backend", choices=("numpy", "mlx"), default="numpy")
    p.add_argument("--json", metavar="FILE", help="write tokens, text and rates as JSON")


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """The pipeline flags, added to ``generate`` by ``hpcmac.llm.__main__``."""
    g = p.add_argument_group("pipeline (several ranks)")
    g.add_argument("--split", help="layers per rank, e.g. 10,10,6,4 (default: by memory)")
    g.add_argument("--batch", metavar="FILE",
                   help="prompts to generate together: one per line, or JSON lines with "
                        '"prompt" or "prompt_ids" and optional "max_tokens"')
    g.add_argument("--transport", choices=("auto", "mpi", "rdma", "ring", "local"),
                   help="comm backend (default: HPCMAC_TRANSPORT or auto)")
    g.add_argument("--hostfile", help="JSON hostfile whose memory_gb sets the split "
                                      "(default: HPCMAC_HOSTFILE)")
    g.add_argument("--micro-batches", type=int, default=0,
                   help="micro-batches in flight (default: one per stage)")
    g.add_argument("--max-batch", type=int, default=0,
                   help="sequences decoded at once (default: all prompts, at most 64)")
    g.add_argument("--prefill-chunk", type=int, default=0,
                   help="prompt tokens per micro-batch (default: 64 on several ranks)")
    g.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank waits on a silent peer before ending the job")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcmac.llm generate",
                                description="generate text, pipeline-parallel over the ranks")
    add_generation_arguments(p)
    add_pipeline_arguments(p)
    return p


def check_arguments(args: argparse.Namespace) -> None:
    """Local checks every rank makes identically before any collective."""
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    n_src = sum(x is not None for x in (args.prompt, args.prompt_ids, args.batch))
    if n_src != 1:
        raise UsageError("give exactly one of --prompt, --prompt-ids or --batch")
    for name in ("micro_batches", "max_batch", "prefill_chunk"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")


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
        err = group.bcast_obj(err, 0)
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
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{where}: not JSON ({exc.msg})") from None
            mt = obj.get("max_tokens", args.max_tokens)
            if not isinstance(mt, int) or mt < 1:
                raise UsageError(f"{where}: max_tokens must be a positive integer")
            if "prompt_ids" in obj:
                ids = obj["prompt_ids"]
                if isinstance(ids, str):
                    ids = _parse_ids(ids, where)
                if not isinstance(ids, list) or not ids or not all(
                        isinstance(i, int) for i in ids):
                    raise UsageError(f"{where}: prompt_ids must be a list of token ids")
                out.append(Prompt(None, ids, mt))
            elif isinstance(obj.get("prompt"), str):
                out.append(Prompt(obj["prompt"], None, mt))
            else:
                raise UsageError(f"{where}: expected a 'prompt' string or 'prompt_ids'")
        else:
            out.append(Prompt(line, None, args.max_tokens))
    if not out:
        raise UsageError(f"--batch {args.batch}: no prompts")
    return out


def make_requests(prompts: list[Prompt], args, tok, cfg) -> list[Request]:
    """Token-level requests (rank 0): encode text, check lengths against the context."""
    reqs = []
    for i, p in enumerate(prompts):
        if p.ids is not None:
            ids = p.ids
        else:
            if tok is None:
                raise UsageError(f"{args.model}: no tokenizer; give --prompt-ids instead")
            ids = tok.encode(p.text, chat=args.chat)
        bad = [t for t in ids if not 0 <= t < cfg.vocab]
        if bad:
            raise UsageError(f"prompt {i}: token id {bad[0]} is outside the vocabulary "
                             f"[0, {cfg.vocab})")
        if len(ids) + p.max_tokens > cfg.max_position:
            raise UsageError(f"prompt {i}: {len(ids)} tokens + {p.max_tokens} new exceed the "
                             f"model's context of {cfg.max_position}")
        params = SamplingParams(args.temperature, args.top_k, args.top_p,
                                args.repetition_penalty, args.seed + i)
        reqs.append(Request(list(ids), p.max_tokens, params, tuple(cfg.eos_token_ids)))
    return reqs


# -- planning ----------------------------------------------------------------------------


def kv_bytes_per_token_layer(cfg) -> int:
    """Bytes of KV cache one token takes in one layer (float32)."""
    if getattr(cfg, "mla", False):
        return 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 4 * 2 * cfg.n_kv_heads * cfg.head_dim


def weight_bytes(model: str) -> tuple[list[int], int, int]:
    """Float32 bytes of each layer, of the embedding and of the norm + head (headers only).

    The same count as ``hpcmac.llm.weights.stage_nbytes``, with the checkpoint
    opened once (opening a GGUF parses its whole tokenizer).
    """
    from hpcmac.llm.weights import open_checkpoint, stage_tensor_names

    ckpt = open_checkpoint(model)
    cfg = ckpt.config()

    def nbytes(start: int, end: int, first: bool, last: bool) -> int:
        total = sum(ckpt.numel(n) for n in stage_tensor_names(cfg, start, end, first, last))
        for i in range(start, end):
            if cfg.is_moe_layer(i):
                total += 3 * cfg.n_experts * cfg.hidden * cfg.moe_intermediate
        return 4 * int(total)

    layers = [nbytes(i, i + 1, False, False) for i in range(cfg.n_layers)]
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
                kv_tokens: int) -> StagePlan:
    """Collective: choose every rank's layers and check they fit, before loading anything.

    ``kv_tokens`` is the cache size in tokens (slots x length, global).
    """
    p = group.size
    mem = group.allgather_obj((socket.gethostname(), S.available_memory()))
    hosts = [h for h, _ in mem]

    def bytes_of() -> tuple[list[int], int, int]:
        S.check_ranks(cfg.n_layers, p)
        return weight_bytes(model)

    layer_b, embed_b, head_b = agree(group, bytes_of, ranks="root")
    layer_b, embed_b, head_b = group.bcast_obj((layer_b, embed_b, head_b), 0)
    hf = None
    if hostfile:
        hf = agree(group, lambda: S.read_hostfile(hostfile), ranks="root")
        hf = group.bcast_obj(hf, 0)
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


def _load_tokenizer(model: str):
    """The model's tokenizer, or None when it has none (then prompts must be ids)."""
    from hpcmac.llm.tokenizer import load_tokenizer

    return load_tokenizer(model)


def run_generate(args: argparse.Namespace, group=None, out=None) -> int:
    """Run ``generate`` on every rank (collective); rank 0 alone prints and writes JSON."""
    from hpcmac import comm
    from hpcmac.llm.config import load_config
    from hpcmac.llm.model import load_stage

    check_arguments(args)
    out = sys.stdout if out is None else out
    group = comm.init(args.transport) if group is None else group
    cfg = agree(group, lambda: load_config(args.model))
    tok = None

    def requests() -> list[Request]:
        nonlocal tok
        prompts = read_prompts(args)
        if any(p.text is not None for p in prompts):
            tok = _load_tokenizer(args.model)
        return make_requests(prompts, args, tok, cfg)

    reqs = agree(group, requests, ranks="root")
    shape = group.bcast_obj(
        (len(reqs), max(len(r.prompt) + r.max_tokens for r in reqs)) if group.rank == 0
        else None, 0)
    slots = min(args.max_batch or min(shape[0], 64), shape[0])
    hostfile = args.hostfile or _env("HPCMAC_HOSTFILE")
    plan = plan_stages(group, args.model, cfg, args.split, hostfile, slots * shape[1])
    spec = plan.stages[group.rank]
    stage = agree(group, lambda: load_stage(args.model, spec.start, spec.end, first=spec.first,
                                            last=spec.last, backend=args.backend))
    if group.rank == 0 and group.size > 1:
        print(f"pipeline: {group.size} stages, split {[s.n_layers for s in plan.stages]} "
              f"(by {plan.how})", file=sys.stderr, flush=True)
    stream = _Streamer(tok, out, len(reqs)) if group.rank == 0 else None
    stops = list(args.stop or [])
    stop_check = None
    if stops and group.rank == 0:
        if tok is None:
            raise UsageError("--stop needs a tokenizer")

        def stop_check(i: int, gen: list[int]) -> bool:
            return any(s in tok.decode(gen) for s in stops)

    res = run_pipeline(
        group, stage, spec, cfg.hidden, reqs if group.rank == 0 else None,
        micro_batches=args.micro_batches or None, max_batch=slots,
        prefill_chunk=args.prefill_chunk or None, max_len=shape[1],
        on_token=stream.token if stream else None, stop_check=stop_check,
        timeout=args.timeout, hosts=plan.hosts,
    )
    if group.rank == 0:
        stream.finish(res)
        if args.json:
            write_json(args.json, res, tok, stops, plan)
    return 130 if res.interrupted else 0


def _env(name: str) -> str | None:
    import os

    return os.environ.get(name) or None


def _text(tok, ids: list[int], stops: list[str]) -> str | None:
    if tok is None:
        return None
    text = tok.decode(ids)
    for s in stops:
        k = text.find(s)
        if k >= 0:
            text = text[:k]
    return text


class _Streamer:
    """Rank 0: stream the text of a single prompt as tokens arrive; list a batch at the end."""

    def __init__(self, tok, out, n: int):
        self.tok, self.out, self.n = tok, out, n
        self.gen: list[int] = []
        self.shown = ""

    def token(self, idx: int, tok_id: int) -> None:
        if self.n != 1 or self.tok is None:
            return
        self.gen.append(tok_id)
        text = self.tok.decode(self.gen)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def finish(self, res: PipelineResult) -> None:
        if self.n == 1 and self.tok is not None:
            self.out.write("\n")
        else:
            for s in res.seqs:
                body = self.tok.decode(s.tokens) if self.tok is not None else \
                    ",".join(str(t) for t in s.tokens)
                self.out.write(f"[{s.index}] {body}\n")
        self.out.flush()
        print(summary_line(res), file=sys.stderr, flush=True)


def summary_line(res: PipelineResult) -> str:
    n = len(res.seqs)
    busy = " ".join(f"{st.busy:.0%}" for st in res.stats)
    return (f"{n} sequence{'s' * (n != 1)}, {res.generated} tokens: prefill "
            f"{res.prefill_tok_s():.1f} tok/s, decode {res.decode_tok_s():.1f} tok/s "
            f"aggregate; stage busy {busy}")


def result_json(res: PipelineResult, tok, stops: list[str], plan: StagePlan | None) -> dict:
    seqs = []
    for s in res.seqs:
        seqs.append({
            "prompt_tokens": s.prompt_tokens, "tokens": s.tokens,
            "text": _text(tok, s.tokens, stops), "finish": s.finish,
            "ttft_s": s.ttft,
            "prefill_tok_s": len(s.prompt_tokens) / s.ttft if s.ttft > 0 else 0.0,
            "decode_tok_s": s.decode_tok_s,
        })
    doc: dict[str, Any] = dict(seqs[0]) if len(seqs) == 1 else {}
    doc.update({
        "prefill_tok_s": res.prefill_tok_s() if len(seqs) > 1 else seqs[0]["prefill_tok_s"],
        "decode_tok_s": res.decode_tok_s(),
        "sequences": seqs,
        "ranks": len(res.stats),
        "stages": [{"rank": st.rank, "host": st.host, "layers": list(st.layers),
                    "busy": st.busy} for st in res.stats],
        "bytes_per_token": res.link_bytes_per_token(),
        "interrupted": res.interrupted,
    })
    if plan is not None:
        doc["split"] = {"how": plan.how, "layers": [s.n_layers for s in plan.stages],
                        "need_bytes": plan.need, "budget_bytes": plan.budgets}
    return doc


def write_json(path: str, res: PipelineResult, tok, stops: list[str], plan) -> None:
    with open(path, "w") as f:
        json.dump(result_json(res, tok, stops, plan), f, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_generate(args)


if __name__ == "__main__":
    from hpcmac.errors import run_cli

    raise SystemExit(run_cli(main))
