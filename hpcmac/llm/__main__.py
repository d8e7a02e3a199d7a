"""``python -m hpcmac.llm generate ...``: generate text from a model on this rank.

Streams the text to stdout as it is produced and a timing line to stderr;
``--json FILE`` writes the prompt and generated ids, the text and the rates.
"""

from __future__ import annotations

import argparse
import json
import sys

from hpcmac.errors import ArgumentParser, UsageError, run_cli


def build_parser() -> argparse.ArgumentParser:
    from hpcmac.llm.pipeline_cli import add_pipeline_arguments

    ap = ArgumentParser(
        prog="python -m hpcmac.llm",
        description="Decoder-only LLM inference, pipeline-parallel over the ranks of the job.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text (one rank, or a pipeline over the ranks)")
    add_generate_args(g)
    add_pipeline_arguments(g)
    b = sub.add_parser("bench", add_help=False,
                       help="pipeline benchmark at 1, 2, 4 ranks (see bench --help)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return ap


def add_generate_args(g: argparse.ArgumentParser) -> None:
    """The flags of ``generate`` (reused by the distributed CLI)."""
    g.add_argument("--model", required=True,
                   help="model folder (config.json + safetensors), GGUF file, or 'smollm2'")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt text as is, even if the model has a chat template")
    g.add_argument("--max-context", type=int, default=None,
                   help="context length (default: the model's, capped at 4096)")
    g.add_argument("--backend", default="numpy", help="numpy (default) or mlx")
    g.add_argument("--quantize", type=int, default=None, metavar="BITS",
                   help="keep the weights quantized in memory, BITS per weight (4 or 8; "
                        "also 2, 3, 5, 6), as mlx-lm's -q (--backend mlx)")
    g.add_argument("--q-group-size", type=int, default=64, metavar="G",
                   help="weights sharing one scale and bias when quantized (32, 64, 128)")
    g.add_argument("--threads", type=int, default=None,
                   help="BLAS threads (default: the BLAS library's choice)")
    g.add_argument("--json", default=None, metavar="FILE", help="write results as JSON")
    g.add_argument("--quiet", action="store_true", help="do not stream the text")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise UsageError("--prompt-ids: expected at least one token id")
    return ids


def prompt_tokens(args, tok, cfg) -> list[int]:
    """The prompt as ids: --prompt-ids, or --prompt through the chat template and tokenizer."""
    if args.prompt_ids is not None:
        ids = parse_ids(args.prompt_ids)
        bad = [i for i in ids if not 0 <= i < cfg.vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token {bad[0]} is outside the vocabulary "
                             f"[0, {cfg.vocab})")
        return ids
    if tok is None:
        raise UsageError(f"--model {args.model}: the checkpoint has no tokenizer; "
                         "give --prompt-ids instead of --prompt")
    text = args.prompt
    if tok.chat_template and not args.ignore_chat_template:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) \
            + [{"role": "user", "content": text}]
        return tok.encode(tok.apply_chat_template(msgs), add_bos=False) \
            if tok.bos_token and tok.chat_template.find("bos_token") >= 0 \
            else tok.encode(tok.apply_chat_template(msgs))
    return tok.encode(text)


def context_length(args, cfg) -> int:
    n = args.max_context or min(cfg.max_position, 4096)
    if n <= 0:
        raise UsageError(f"--max-context {n}: expected > 0")
    return n


def check_generate_args(args):
    """The checks of :func:`add_generate_args`' flags that need no file (the same on
    every rank); returns the sampling parameters."""
    from hpcmac.llm.backend import check_quantize
    from hpcmac.llm.sampling import SamplingParams

    if args.max_tokens < 0:
        raise UsageError(f"--max-tokens {args.max_tokens}: expected >= 0")
    check_quantize(args.backend, args.quantize, args.q_group_size)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p,
                              args.repetition_penalty, args.seed)
    sampling.validate()
    return sampling


def run_generate(args) -> int:
    from hpcmac.llm.config import load_config
    from hpcmac.llm.generate import Generator, StopChecker
    from hpcmac.llm.model import load_stage
    from hpcmac.llm.tokenizer import load_tokenizer

    sampling = check_generate_args(args)
    cfg = load_config(args.model)
    tok = load_tokenizer(args.model) if args.prompt is not None or args.stop else None
    ids = prompt_tokens(args, tok, cfg)
    ctx = context_length(args, cfg)
    from hpcmac.llm.generate import check_prompt

    check_prompt(len(ids), ctx)
    eos = tok.eos_ids if tok is not None and tok.eos_ids else cfg.eos_token_ids
    stop = StopChecker(eos, args.stop, tok)
    stage = load_stage(args.model, 0, cfg.n_layers, True, True, backend=args.backend,
                       quantize=args.quantize, group_size=args.q_group_size)
    gen = Generator(stage, max_len=ctx)
    stream = tok.stream() if tok is not None and not args.quiet else None
    printed = []

    def on_token(t: int) -> None:
        if stream is not None and t not in stop.eos:
            piece = stream.push(t)
            if piece:
                printed.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()

    if args.threads is not None:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(args.threads):
            res = gen.generate(ids, args.max_tokens, sampling, stop, on_token)
    else:
        res = gen.generate(ids, args.max_tokens, sampling, stop, on_token)
    body = res.tokens[:-1] if res.finish_reason == "eos" else res.tokens
    text = stop.trim(tok.decode(body)) if tok is not None else None
    if stream is not None:
        sys.stdout.write("\n")
    elif tok is None and not args.quiet:
        print(",".join(map(str, res.tokens)))
    print(f"prompt {len(ids)} tok, {res.prefill_tok_s:.1f} tok/s; generated "
          f"{len(res.tokens)} tok, {res.decode_tok_s:.1f} tok/s ({res.finish_reason})",
          file=sys.stderr)
    if args.json:
        out = {"prompt_tokens": ids, "tokens": res.tokens, "text": text,
               "prefill_tok_s": res.prefill_tok_s, "decode_tok_s": res.decode_tok_s,
               "finish_reason": res.finish_reason}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


#: what the ``llm`` extra installs (pyproject.toml) and generate imports, by import name
LLM_EXTRA = ("gguf", "tokenizers", "jinja2")


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
        from hpcmac.bench.llm_pipeline import main as bench_main  # REMAINDER drops --x)

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    require_llm_extra()
    from hpcmac.errors import world_size

    # one rank and one prompt: the single-stage generator; otherwise the pipeline
    if world_size() > 1 or args.batch or args.split or args.transport:
        from hpcmac.llm.pipeline_cli import run_generate as run_pipeline

        return run_pipeline(args)
    return run_generate(args)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
