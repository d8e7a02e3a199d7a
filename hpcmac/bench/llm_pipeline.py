"""Pipeline-parallel decoding at 1, 2, 4 ... ranks, measured in one run.

``python -m hpcmac.bench.llm_pipeline [--model smollm2] [--ranks 1,2,4] [--json FILE]``
(also ``python -m hpcmac.llm bench``) launches ``tools/mpirun NP`` once per rank
count, each rank with one BLAS thread, and each job measures on the same
prompts:

* one sequence: time to first token, prefill tok/s, decode tok/s;
* ``--batches 4,16`` sequences in flight: aggregate decode tok/s, with the
  sequences split into one micro-batch per stage (on one rank: one batch);
* bytes sent per decoded token on each link, and each stage's busy fraction.

The table gives every rate as a ratio to the 1-rank job of the same run,
the reference. Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _ints(text: str, flag: str) -> list[int]:
    from hpcmac.errors import UsageError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not vals or min(vals) < 1:
        raise UsageError(f"{flag} {text!r}: expected positive integers")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpcmac.bench.llm_pipeline",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder, GGUF file or short name")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to run (the first is the "
                                                   "reference; 1 recommended)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens, one sequence")
    p.add_argument("--new", type=int, default=48, help="tokens generated per sequence")
    p.add_argument("--batches", default="4,16", help="sequences in flight to measure")
    p.add_argument("--batch-prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--transport", default=None)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p


# -- the job under mpirun -----------------------------------------------------------


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, length)] for _ in range(n)]


def worker(args) -> int:
    """Collective: load this rank's stage once, run every measurement, rank 0 writes JSON."""
    from hpcmac import comm
    from hpcmac.llm.config import load_config
    from hpcmac.llm.model import load_stage
    from hpcmac.llm.pipeline import Request, run_pipeline
    from hpcmac.llm.pipeline_cli import agree, plan_stages

    group = comm.init(args.transport)
    cfg = agree(group, lambda: load_config(args.model))
    batches = _ints(args.batches, "--batches")
    max_b = max(batches)
    max_len = max(args.prompt_len, args.batch_prompt_len) + args.new
    plan = plan_stages(group, args.model, cfg, None, os.environ.get("HPCMAC_HOSTFILE"),
                       max_b * max_len)
    spec = plan.stages[group.rank]
    stage = load_stage(args.model, spec.start, spec.end, first=spec.first, last=spec.last)

    def run(prompts, n_new):
        reqs = [Request(p, n_new) for p in prompts]  # no EOS: exactly n_new tokens
        return run_pipeline(group, stage, spec, cfg.hidden, reqs, max_batch=len(prompts),
                            max_len=max_len, hosts=plan.hosts, timeout=120)

    run(_prompts(cfg.vocab, 1, 8, 0), 4)  # warm-up
    single = _prompts(cfg.vocab, 1, args.prompt_len, 1)
    rows = {"single": [], **{f"batch{b}": [] for b in batches}}
    for _ in range(args.repeats):
        rows["single"].append(_measure(run(single, args.new)))
        for b in batches:
            rows[f"batch{b}"].append(_measure(run(_prompts(cfg.vocab, b, args.batch_prompt_len,
                                                           2), args.new)))
    if group.rank == 0:
        doc = {"ranks": group.size, "layers": [s.n_layers for s in plan.stages],
               "hidden": cfg.hidden, "model": args.model,
               "results": {k: _median(v) for k, v in rows.items()}}
        Path(args.worker).write_text(json.dumps(doc, indent=1))
    return 0


def _measure(res) -> dict:
    s0 = res.seqs[0]
    return {
        "ttft_s": s0.ttft,
        "prefill_tok_s": len(s0.prompt_tokens) / s0.ttft if s0.ttft > 0 else 0.0,
        "decode_tok_s": res.decode_tok_s(),
        "per_seq_decode_tok_s": statistics.median(s.decode_tok_s for s in res.seqs),
        "busy": [st.busy for st in res.stats],
        "bytes_per_token": [x["bytes_per_token"] for x in res.link_bytes_per_token()],
        "links": [x["link"] for x in res.link_bytes_per_token()],
    }


def _median(runs: list[dict]) -> dict:
    out = {}
    for k, v in runs[0].items():
        if isinstance(v, list) and v and isinstance(v[0], (int, float)):
            out[k] = [statistics.median(r[k][i] for r in runs) for i in range(len(v))]
        elif isinstance(v, (int, float)):
            out[k] = statistics.median(r[k] for r in runs)
        else:
            out[k] = v
    return out


# -- the driver -----------------------------------------------------------------------


def launch(np_: int, args, out: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, "-m",
           "hpcmac.bench.llm_pipeline", "--worker", out, "--model", args.model,
           "--prompt-len", str(args.prompt_len), "--new", str(args.new),
           "--batches", args.batches, "--batch-prompt-len", str(args.batch_prompt_len),
           "--repeats", str(args.repeats)]
    if args.transport:
        cmd += ["--transport", args.transport]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"error: the {np_}-rank job failed (exit {proc.returncode})")
    return json.loads(Path(out).read_text())


def table(docs: list[dict], batches: list[int]) -> str:
    ref = docs[0]["results"]
    head = ["ranks", "layers", "TTFT s", "prefill tok/s", "decode tok/s (x)"]
    head += [f"{b} seqs agg tok/s (x)" for b in batches]
    head += ["bytes/token/link", "busy (1 seq)", f"busy ({batches[-1]} seqs)"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for d in docs:
        r = d["results"]
        s = r["single"]
        pf, pf0 = s["prefill_tok_s"], ref["single"]["prefill_tok_s"]
        dc, dc0 = s["decode_tok_s"], ref["single"]["decode_tok_s"]
        row = [str(d["ranks"]), ",".join(map(str, d["layers"])), f"{s['ttft_s']:.3f}",
               f"{pf:.1f} ({pf / pf0:.2f}x)", f"{dc:.1f} ({dc / dc0:.2f}x)"]
        for b in batches:
            x, x0 = r[f"batch{b}"]["decode_tok_s"], ref[f"batch{b}"]["decode_tok_s"]
            row.append(f"{x:.1f} ({x / x0:.2f}x)")
        row.append(" ".join(f"{v:.0f}" for v in s["bytes_per_token"]) or "-")
        row.append(" ".join(f"{v:.0%}" for v in s["busy"]))
        row.append(" ".join(f"{v:.0%}" for v in r[f"batch{batches[-1]}"]["busy"]))
        lines.append(" | ".join(row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    ranks = _ints(args.ranks, "--ranks")
    batches = _ints(args.batches, "--batches")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    docs = []
    with tempfile.TemporaryDirectory() as tmp:
        for np_ in ranks:
            print(f"running {np_} rank{'s' * (np_ > 1)} ...", file=sys.stderr, flush=True)
            docs.append(launch(np_, args, f"{tmp}/np{np_}.json"))
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model {args.model}, hidden {docs[0]['hidden']}; one BLAS thread per rank; "
          f"{os.cpu_count()} cores; load average {load:.1f} before, {load_after:.1f} after")
    print(f"one sequence: {args.prompt_len}-token prompt, {args.new} new tokens; batches: "
          f"{args.batch_prompt_len}-token prompts, {args.new} new each; median of "
          f"{args.repeats}; (x) = ratio to {docs[0]['ranks']} rank(s) in this run")
    print(table(docs, batches))
    h = docs[0]["hidden"]
    print(f"bytes/token/link: decode bytes per decoded token on each link r->r+1 and the "
          f"token link last->0; one hidden vector is {4 * h} bytes")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_before": load, "load_after": load_after,
                                               "args": vars(args), "runs": docs}, indent=1))
    return 0


if __name__ == "__main__":
    from hpcmac.errors import run_cli

    raise SystemExit(run_cli(main))
