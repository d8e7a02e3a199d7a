"""Pipeline-parallel decoding at 1, 2, 4 ... ranks, measured in one run.

``python -m hpcmac.bench.llm_pipeline [--model smollm2] [--ranks 1,2,4] [--json FILE]``
(also ``python -m hpcmac.llm bench``) starts one job of ``max(ranks)`` ranks
(``tools/mpirun``, one BLAS thread per rank). The job splits its world into a
pipeline of the first 1, 2, 4 ... ranks, loads every pipeline's stages once,
and then measures the pipelines in turn, each workload on every pipeline one
after the other, round after round, so that the load of a shared machine weighs
on all of them alike (ranks outside the pipeline being measured sleep). On the
same prompts it measures:

* one sequence: time to first token, prefill tok/s, decode tok/s;
* ``--batches 4,16`` sequences in flight: aggregate decode tok/s, with the
  sequences split into one micro-batch per stage (on one rank: one batch);
* bytes sent per decoded token on each link, and each stage's busy fraction;
* the memory bandwidth of 1, 2, 4 ... ranks streaming at once: the ceiling of
  the pipeline's decode ratio while decode is memory-bound.

The table gives every rate as a ratio to the first pipeline (1 rank), the
reference, measured in the same rounds. Medians of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcmac.io.outputs import checked_output

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
    from hpcmac.errors import ArgumentParser

    p = ArgumentParser(prog="python -m hpcmac.bench.llm_pipeline",
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
    p.add_argument("--json", type=checked_output("--json"), metavar="FILE")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p


# -- the job under mpirun -----------------------------------------------------------


def _prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab, length)] for _ in range(n)]


class _Sleeper:
    """Ranks outside the pipeline being measured wait here without using the CPU."""

    def __init__(self, world):
        from hpcmac.llm.parallel.link import Watchdog

        self.world = world
        # idle for seconds: poll every 20 ms at most, not to disturb the ranks measured
        self.wd = Watchdog(world, [""] * world.size, timeout=0, max_sleep=0.02, spin=0.0)

    def sync(self) -> None:
        """Collective over the world, each rank sleeping while it waits."""
        import numpy as np

        w = self.world
        if w.size == 1:
            return
        buf = np.zeros(1, dtype=np.int64)
        if w.rank == 0:
            for r in range(1, w.size):
                self.wd.wait(w.irecv(buf, r, 91), r, "")
            for r in range(1, w.size):
                w.send(buf, r, 92)
        else:
            w.send(buf, 0, 91)
            self.wd.wait(w.irecv(buf, 0, 92), 0, "")


class _Stream:
    """Memory bandwidth of the first k ranks reading memory at once (GB/s, all of them).

    Each of the k ranks reads its own ``mib`` MiB array ``reps`` times, starting
    together; the rate is all the bytes over the slowest rank's time. Decode of
    a few sequences per micro-batch streams the weights, so the k-rank rate
    over the 1-rank rate is the most a k-stage pipeline can gain while decode
    is memory-bound (ranks on one machine share its memory bandwidth, and on
    a shared virtual machine that share changes from minute to minute: it is
    measured in every round, next to the pipelines).

    Two ways to read: ``"sum"`` (``numpy.sum``; on a core that sums slower
    than memory delivers, e.g. 18-21 GB/s against 31 GB/s for decode on the
    AMD EPYC VM, its 2-rank ratio is the cores', not the memory's) and
    ``"matvec"``: the array as 1024 x 32 panels multiplied by a vector with
    the decoder's own kernel (:meth:`~hpcmac.llm.model.backend.NumpyBackend.linear`),
    the access pattern of a decode step.
    """

    def __init__(self, mib: int = 256):
        import numpy as np

        from hpcmac.llm.model.backend import NumpyBackend, Panels

        self.a = np.ones(mib << 18, dtype=np.float32)
        self.a.sum()  # touch every page once
        self.be = NumpyBackend()
        r, inp = self.be.panel, 1024
        nb = self.a.size // (inp * r)
        self.w = Panels.of(self.a[:nb * inp * r].reshape(nb, inp, r))  # the same memory
        self.x = np.ones((1, inp), dtype=np.float32)

    def _read(self, pattern: str) -> int:
        if pattern == "matvec":
            self.be.linear(self.x, self.w)
            return self.w.p.nbytes
        self.a.sum()
        return self.a.nbytes

    def measure(self, world, sleeper, k: int, reps: int = 8, pattern: str = "sum") -> float:
        sleeper.sync()
        world.barrier()  # start together (the sync above wakes ranks up to 20 ms apart)
        dt, nbytes = 0.0, 0
        if world.rank < k:
            t0 = time.perf_counter()
            for _ in range(reps):
                nbytes += self._read(pattern)
            dt = time.perf_counter() - t0
        sleeper.sync()  # ranks beyond k wait here sleeping, not in a spinning collective
        times = world.allgather_obj((dt, nbytes))
        return k * times[0][1] / max(t for t, _ in times[:k]) / 1e9


def worker(args) -> int:
    """Collective: load every pipeline's stages once, measure them round-robin; rank 0 writes."""
    from hpcmac import comm
    from hpcmac.launch.hostfile import job_hostfile
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.placement import LayoutFlags
    from hpcmac.llm.parallel.plan import agree
    from hpcmac.llm.parallel.runtime import (
        agree_placement,
        bring_up,
        gather_cluster,
        hostfile_path,
        read_job_hostfile,
    )

    world = comm.init(args.transport, hostfile=job_hostfile())
    ranks = _ints(args.ranks, "--ranks")
    cfg = agree(world, lambda: load_config(args.model))
    batches = _ints(args.batches, "--batches")
    max_b = max(batches)
    max_len = max(args.prompt_len, args.batch_prompt_len) + args.new
    sleeper = _Sleeper(world)
    pipes = {}
    hostfile = agree(world, lambda: read_job_hostfile(hostfile_path(None)), ranks="root")
    for np_ in ranks:
        sub = world.split(0 if world.rank < np_ else 1, world.rank)
        if world.rank < np_:  # a pipeline of np_ stages, by memory, as generate's
            cluster = gather_cluster(sub, hostfile)
            placement = agree_placement(sub, cfg, args.model, cluster, LayoutFlags(pp=np_),
                                        kv_tokens=max_b * max_len, slots=max_b)
            pipes[np_] = bring_up(sub, placement, args.model, cfg, timeout=300.0)
        sleeper.sync()

    def run(np_, prompts, n_new):
        reqs = [Request(p, n_new) for p in prompts]  # no EOS: exactly n_new tokens
        return pipes[np_].run(reqs, max_batch=len(prompts), max_len=max_len)

    stream = _Stream()
    single = _prompts(cfg.vocab, 1, args.prompt_len, 1)
    many = {b: _prompts(cfg.vocab, b, args.batch_prompt_len, 2) for b in batches}
    rows = {np_: {"single": [], **{f"batch{b}": [] for b in batches}} for np_ in ranks}
    bandwidth: dict[int, list[float]] = {np_: [] for np_ in ranks}
    for rep in range(args.repeats + 1):  # round 0 warms up
        for np_ in ranks:
            gb_s = stream.measure(world, sleeper, np_)
            if rep > 0:
                bandwidth[np_].append(gb_s)
        # each workload on every pipeline in turn: the compared runs are seconds apart
        # (the share of the machine the other tenants leave changes by the minute)
        for key, prompts in [("single", single)] + [(f"batch{b}", many[b]) for b in batches]:
            for np_ in ranks:
                if world.rank < np_:
                    got = _measure(run(np_, prompts, args.new))
                    if rep > 0:
                        rows[np_][key].append(got)
                sleeper.sync()
    if world.rank == 0:
        docs = [{"ranks": np_, "layers": [s.n_layers for s in pipes[np_].placement.stages],
                 "hidden": cfg.hidden, "model": args.model,
                 "mem_gb_s": statistics.median(bandwidth[np_]),
                 "results": {k: _median(v) for k, v in rows[np_].items()}} for np_ in ranks]
        Path(args.worker).write_text(json.dumps(docs, indent=1))
    return 0


def _measure(res) -> dict:
    s0 = res.seqs[0]
    return {
        "ttft_s": s0.ttft,
        "prefill_tok_s": len(s0.prompt_tokens) / s0.ttft if s0.ttft > 0 else 0.0,
        "decode_tok_s": res.decode_tok_s(),
        "per_seq_decode_tok_s": statistics.median(s.decode_tok_s for s in res.seqs),
        "busy": [st.busy for st in res.stats],
        # CPU seconds per generated token of the busiest stage: the rate each rank
        # would reach with a core of its own
        "cpu_s_per_token": max(st.cpu_s for st in res.stats) / max(res.generated, 1),
        "bytes_per_token": [x["bytes_per_token"] for x in res.link_bytes_per_token()],
        "links": [x["link"] for x in res.link_bytes_per_token()],
    }


def _median(runs: list[dict]) -> dict:
    out = {}
    for k, v in runs[0].items():
        if any(k not in r for r in runs[1:]):  # a measure some rounds lack (other_cores)
            continue
        if isinstance(v, list) and v and isinstance(v[0], (int, float)):
            out[k] = [statistics.median(r[k][i] for r in runs) for i in range(len(v))]
        elif isinstance(v, (int, float)):
            out[k] = statistics.median(r[k] for r in runs)
        else:
            out[k] = v
    return out


# -- the driver -----------------------------------------------------------------------


def launch(args, out: str) -> list[dict]:
    """Run the measuring job on ``max(ranks)`` ranks; the per-pipeline results."""
    np_ = max(_ints(args.ranks, "--ranks"))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, "-m",
           "hpcmac.bench.llm_pipeline", "--worker", out, "--model", args.model,
           "--ranks", args.ranks, "--prompt-len", str(args.prompt_len), "--new",
           str(args.new), "--batches", args.batches, "--batch-prompt-len",
           str(args.batch_prompt_len), "--repeats", str(args.repeats)]
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
    head += ["memory GB/s (x)", "bytes/token/link", "busy (1 seq)",
             f"busy ({batches[-1]} seqs)", f"CPU-bound x (1 seq, {batches[-1]} seqs)"]
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
        bw, bw0 = d.get("mem_gb_s", 0.0), docs[0].get("mem_gb_s", 0.0)
        row.append(f"{bw:.1f} ({bw / bw0:.2f}x)" if bw0 else "-")
        row.append(" ".join(f"{v:.0f}" for v in s["bytes_per_token"]) or "-")
        row.append(" ".join(f"{v:.0%}" for v in s["busy"]))
        big = f"batch{batches[-1]}"
        row.append(" ".join(f"{v:.0%}" for v in r[big]["busy"]))
        row.append(f"{ref['single']['cpu_s_per_token'] / s['cpu_s_per_token']:.2f} "
                   f"{ref[big]['cpu_s_per_token'] / r[big]['cpu_s_per_token']:.2f}")
        lines.append(" | ".join(row))
    return "\n".join(lines)


def ceilings(docs: list[dict], batches: list[int]) -> tuple[float, float, dict] | None:
    """(W, c, {(ranks, seqs): x}): the aggregate ratio a pipeline can reach at best.

    Model: on the reference (1 rank) a decode step of B sequences takes
    ``W + B c`` (W: streaming the weights and the per-step costs; c: the
    cost of one more sequence), fitted on the two smallest batches. A
    p-stage pipeline keeps p micro-batches in flight, so each stage streams
    its 1/p of the weights p times per round of steps, at the bandwidth share
    measured (aggregate ratio r of p ranks at once), and computes B/p
    sequences: a round takes at least ``W p / r + B c / p``. Pipelines with
    more ranks than the machine has cores are left out (they share cores).
    """
    small = sorted(batches)[:2]
    if len(small) < 2 or small[0] == small[1]:
        return None
    ref = docs[0]["results"]
    b1, b2 = small
    t1 = b1 / ref[f"batch{b1}"]["decode_tok_s"]
    t2 = b2 / ref[f"batch{b2}"]["decode_tok_s"]
    c = (t2 - t1) / (b2 - b1)
    w = t1 - b1 * c
    if c <= 0 or w <= 0:
        return None
    bw0 = docs[0].get("mem_gb_s") or 0.0
    out = {}
    for d in docs[1:]:
        p = d["ranks"]
        if p > (os.cpu_count() or 1):
            continue
        r = min(p, d.get("mem_gb_s", 0.0) / bw0) if bw0 else p
        for b in batches:
            out[(p, b)] = (w + b * c) / (w * p / r + b * c / p)
    return w, c, out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    ranks = _ints(args.ranks, "--ranks")
    batches = _ints(args.batches, "--batches")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"running pipelines of {', '.join(map(str, ranks))} ranks in one "
          f"{max(ranks)}-rank job ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        docs = launch(args, f"{tmp}/runs.json")
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model {args.model}, hidden {docs[0]['hidden']}; one BLAS thread per rank; "
          f"{os.cpu_count()} cores; load average {load:.1f} before, {load_after:.1f} after")
    print(f"one sequence: {args.prompt_len}-token prompt, {args.new} new tokens; batches: "
          f"{args.batch_prompt_len}-token prompts, {args.new} new each; median of "
          f"{args.repeats} rounds; (x) = ratio to {docs[0]['ranks']} rank(s) in the same "
          "rounds")
    print(table(docs, batches))
    h = docs[0]["hidden"]
    print(f"bytes/token/link: decode bytes per decoded token on each link r->r+1 and the "
          f"token link last->0; one hidden vector is {4 * h} bytes")
    print("memory GB/s: those ranks streaming memory at once, the same job; decode with "
          "few sequences per micro-batch streams the weights, so its (x) is the ceiling "
          "for the decode (x) until the batches make decode compute-bound")
    ceil = ceilings(docs, batches)
    if ceil is None:
        print("estimated ceiling of the agg (x): none (needs two batch sizes whose 1-rank "
              "rows fit W + B c with W, c > 0)")
    elif not ceil[2]:
        print("estimated ceiling of the agg (x): none (every pipeline has more ranks than "
              "cores)")
    else:
        w, c, x = ceil
        per = "; ".join(f"{p} ranks: " + ", ".join(f"{b} seqs {x[(p, b)]:.2f}x" for b in batches)
                        for p in sorted({p for p, _ in x}))
        print(f"estimated ceiling of the agg (x): 1 rank decodes B sequences in W + B c per "
              f"step (W = {w * 1e3:.1f} ms, c = {c * 1e3:.2f} ms, from the "
              f"{sorted(batches)[0]}- and {sorted(batches)[1]}-sequence rows); p stages "
              f"stream their weights once per micro-batch at the measured memory share: {per}")
    print("CPU-bound x: the 1-rank CPU time per token over the busiest stage's, i.e. the "
          "ratio if every rank had a core of its own (derived, not a wall-clock rate)")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps({"load_before": load, "load_after": load_after,
                                               "args": vars(args), "runs": docs}, indent=1),
                     what="--json")
    return 0


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(main))
