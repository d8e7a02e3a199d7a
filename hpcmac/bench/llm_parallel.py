"""Tensor against pipeline parallelism at 2 ranks, against 1 rank, quiet and loaded.

``python -m hpcmac.bench.llm_parallel [--model random|smollm2|PATH] [--json FILE]``
starts one 2-rank job (``tools/mpirun``, one BLAS thread per rank) that loads
three layouts of the model once each: the whole model on rank 0, a 2-stage
pipeline, and tensor 2 (heads, columns and vocabulary split). Then, round after
round, it measures on each layout one after the other (the other rank sleeps
when only one computes), so that compared runs are seconds apart:

* one sequence: decode tok/s (and prefill);
* ``--batch 16`` sequences at once: aggregate decode tok/s (``--batch 0``: none, the
  1-sequence runs alone, all the planner's calibration test compares);
* the memory bandwidth of 1 and 2 ranks streaming at once, in the same round:
  the ceiling of a 2-rank single stream is ``tok/s(1) x bw(2) / bw(1)``. It is
  measured two ways (``bench.llm_pipeline._Stream``): ``numpy.sum`` over an
  array (the issue's ceiling) and the decoder's own matrix-vector kernel over
  panels (the access pattern of decode); both ceilings are printed;
* for tensor 2: all-reduces per token, the bytes each rank sends per token,
  and the median time inside one all-reduce;
* with ``--read-rates``, ``calibrate``'s own read bandwidth at 1 and 2 threads
  (:class:`~hpcmac.plan.calibrate.ReadProbe`, 2 GiB kept on rank 0) just before
  and just after each 1-sequence run: what the planner's calibration test
  predicts each run from (on a shared VM the bandwidth two cores get moves
  within seconds). The JSON keeps every round's figures.

Before the first round the job waits until the machine is quiet
(:func:`hpcmac.bench.quiet.settle`: loading freed memory, and the kernel's
work on it takes a core part of the time for seconds on some VMs).

The driver runs the job twice: on the machine as it is ("quiet"), and with a
process of its own spinning on one core for the whole job ("loaded"), to show
what the waiting policy does when a core is taken. ``--model random`` is the
623 MB float32 Llama of ``bench.llm`` (hidden 1024, 8 layers, 16 heads, 4 KV heads).
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

from hpcmac.bench.llm_pipeline import ROOT, _measure, _median, _prompts, _Sleeper, _Stream
from hpcmac.bench.quiet import busy_s, settle
from hpcmac.io.outputs import checked_output

LAYOUTS = ("one rank", "pipeline 2", "tensor 2")


def _count(text: str) -> int:
    """``--batch``: a whole number >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from hpcmac.errors import ArgumentParser

    p = ArgumentParser(prog="python -m hpcmac.bench.llm_parallel",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random",
                   help="'random' (bench.llm's 623 MB Llama), 'smollm2', or a model path")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=32, help="tokens generated per sequence")
    p.add_argument("--batch", type=_count, default=16,
                   help="sequences in the batched run (0: no batched run)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-load", action="store_true", help="skip the loaded run")
    p.add_argument("--stream-mib", type=int, default=256, help=argparse.SUPPRESS)
    # for the smoke test: --read-rates' sample per thread (default calibrate's, 1 GiB
    # in all) and settle's limit (20 s: a busy machine never gets quiet)
    p.add_argument("--read-mib", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--settle-s", type=float, default=20.0, help=argparse.SUPPRESS)
    p.add_argument("--json", type=checked_output("--json"), metavar="FILE")
    p.add_argument("--read-rates", action="store_true",
                   help="also run calibrate's read bandwidth (1 and 2 threads) before and "
                        "after each round's 1-sequence runs, for the planner's test")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    return p


# -- the 2-rank job -------------------------------------------------------------------


def worker(args) -> int:
    """Collective over 2 ranks: load the three layouts, measure them round-robin."""
    from hpcmac import comm
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.placement import fixed
    from hpcmac.llm.parallel.runtime import bring_up

    world = comm.init()
    if world.size != 2:
        raise SystemExit("llm_parallel: the job needs 2 ranks")
    cfg = load_config(args.model)
    hosts = world.allgather_obj(os.uname().nodename)
    sleeper = _Sleeper(world)
    max_len = args.prompt_len + args.new
    one = world.split(0 if world.rank == 0 else 1, world.rank)
    # the three layouts measured, each brought up by the runtime from its placement
    up = dict(model=args.model, cfg=cfg, timeout=300.0)
    full = bring_up(one, fixed(cfg, hosts[:1], 1, [cfg.n_layers]), **up) \
        if world.rank == 0 else None
    piped = bring_up(world, fixed(cfg, hosts, 1, S.even_counts(cfg.n_layers, 2)), **up)
    tens = bring_up(world, fixed(cfg, hosts, 2, [cfg.n_layers]), **up)
    tg = tens.tensor

    def run(layout: str, prompts):
        reqs = [Request(p, args.new) for p in prompts] if world.rank == 0 else None
        kw = dict(max_batch=len(prompts), max_len=max_len)
        if layout == "one rank":
            return full.run(reqs, **kw) if world.rank == 0 else None
        if layout == "pipeline 2":
            return piped.run(reqs, **kw)
        before = dict(tg.stats.__dict__)
        res = tens.run(reqs, **kw)
        after = tg.stats.__dict__
        d = {k: after[k] - before[k] for k in ("reduces", "sent_bytes", "wait_s")}
        res.tensor = world.allgather_obj(d)
        return res

    probes = {}
    if args.read_rates and world.rank == 0:
        from hpcmac.plan.calibrate import ReadProbe

        per = None if args.read_mib is None else args.read_mib << 20
        probes = {k: ReadProbe(k, per) for k in (1, 2)}

    def read_rates() -> dict[str, float] | None:
        """``calibrate``'s read bandwidth at 1 and 2 threads on rank 0, the other asleep."""
        sleeper.sync()
        got = {str(k): p.gbs() for k, p in probes.items()} if probes else None
        sleeper.sync()
        return got

    stream = _Stream(args.stream_mib)
    # loading freed memory: let the kernel's work on it end before measuring (bench.quiet)
    settle(limit_s=args.settle_s)
    sleeper.sync()
    work = {"single": _prompts(cfg.vocab, 1, args.prompt_len, 1)}
    if args.batch:
        work[f"batch{args.batch}"] = _prompts(cfg.vocab, args.batch, args.prompt_len, 2)
    rows = {lay: {k: [] for k in work} for lay in LAYOUTS}
    bandwidth: dict[int, list[float]] = {1: [], 2: []}
    bw_matvec: dict[int, list[float]] = {1: [], 2: []}
    rounds: list[dict] = []
    for rep in range(args.repeats + 1):  # round 0 warms up
        this: dict = {"t": time.time(), "mem_gb_s": {}, "mem_gb_s_matvec": {}}
        for k in (1, 2):
            gb_s = stream.measure(world, sleeper, k)
            gb_mv = stream.measure(world, sleeper, k, pattern="matvec")
            if rep > 0:
                bandwidth[k].append(gb_s)
                bw_matvec[k].append(gb_mv)
            this["mem_gb_s"][str(k)], this["mem_gb_s_matvec"][str(k)] = gb_s, gb_mv
        for key, prompts in work.items():
            # calibrate's reads just before and just after each 1-sequence run
            reading = args.read_rates and key == "single"
            last = read_rates() if reading else None
            for lay in LAYOUTS:
                busy0, cpu0, wall0 = busy_s(), time.process_time(), time.perf_counter()
                res = run(lay, prompts)
                busy1, wall = busy_s(), time.perf_counter() - wall0
                mine = time.process_time() - cpu0
                sleeper.sync()  # first: a rank that did not compute waits asleep, not here
                ours = sum(world.allgather_obj(mine))
                if reading:
                    pair = {"before": last, "after": (last := read_rates())}
                if world.rank == 0 and rep > 0:
                    got = _measure(res)
                    if busy0 is not None and busy1 is not None and wall >= OTHER_MIN_WALL_S:
                        got["other_cores"] = max(0.0, busy1[0] - busy0[0] - ours) / wall
                        got["steal_cores"] = (busy1[1] - busy0[1]) / wall
                    if res.tensor:
                        tokens = res.generated + sum(len(s.prompt_tokens) for s in res.seqs)
                        t0 = res.tensor[0]
                        got["reduces_per_step"] = t0["reduces"] / max(
                            1, res.decode_tokens // len(prompts) + 1)
                        got["reduce_bytes_per_token"] = t0["sent_bytes"] / max(tokens, 1)
                        got["reduce_ms"] = 1e3 * t0["wait_s"] / max(t0["reduces"], 1)
                    if reading:
                        this.setdefault("read_gb_s", {})[lay] = pair
                    rows[lay][key].append(got)
                    this.setdefault(key, {})[lay] = got
        if rep > 0:
            rounds.append(this)
    if world.rank == 0:
        Path(args.worker).write_text(json.dumps({
            "model": args.model, "hidden": cfg.hidden, "layers": cfg.n_layers,
            "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads,
            "weights_mb": full.stage.nbytes / 1e6,
            "mem_gb_s": {k: statistics.median(v) for k, v in bandwidth.items()},
            "mem_gb_s_matvec": {k: statistics.median(v) for k, v in bw_matvec.items()},
            "rounds": rounds,  # each round's own figures: what the medians are taken of
            "results": {lay: {k: _median(v) for k, v in r.items()} for lay, r in rows.items()},
        }, indent=1))
    return 0


#: /proc/stat counts in clock ticks (10 ms) per core, so over a run of ``wall`` seconds
#: the other processes' share is known to about ``cores * 0.02 / wall`` cores: below
#: this wall time a row says nothing rather than a number that can exceed the cores
OTHER_MIN_WALL_S = 0.25


# -- the driver -------------------------------------------------------------------------


def _random_model(work: Path) -> str:
    from hpcmac.measure.llm import write_random_llama

    return str(write_random_llama(work / "llama", 1024, 8, 2816, 32000, heads=16, kv_heads=4))


def launch(args, model: str, out: str, loaded: bool) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [str(ROOT / "tools" / "mpirun"), "2", sys.executable, "-m",
           "hpcmac.bench.llm_parallel", "--worker", out, "--model", model,
           "--prompt-len", str(args.prompt_len), "--new", str(args.new), "--batch",
           str(args.batch), "--repeats", str(args.repeats), "--stream-mib",
           str(args.stream_mib), "--settle-s", str(args.settle_s)] \
        + (["--read-rates"] if args.read_rates else []) \
        + ([] if args.read_mib is None else ["--read-mib", str(args.read_mib)])
    spinner = None
    if loaded:  # another job holding one core for the whole run
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"error: the 2-rank job failed (exit {proc.returncode})")
    return json.loads(Path(out).read_text())


def table(doc: dict, batch: int) -> str:
    res, bw = doc["results"], doc["mem_gb_s"]
    ref = res["one rank"]["single"]["decode_tok_s"]
    refb = res["one rank"][f"batch{batch}"]["decode_tok_s"] if batch else None
    bwr = bw["2"] / bw["1"]
    mv = doc.get("mem_gb_s_matvec")
    mvr = mv["2"] / mv["1"] if mv else None
    head = ["layout", "1 seq decode tok/s (x)", "of the ceiling",
            "of the matvec ceiling", f"{batch} seqs agg tok/s (x)" if batch else "no batch",
            "prefill tok/s", "CPU-bound x", "all-reduces/step", "bytes/token sent",
            "ms/all-reduce", "other cores"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for lay in LAYOUTS:
        s, b = res[lay]["single"], res[lay].get(f"batch{batch}")
        x = s["decode_tok_s"] / ref
        ceil = "" if lay == "one rank" else f"{x / bwr:.2f}"
        ceil_mv = "" if lay == "one rank" or not mvr else f"{x / mvr:.2f}"
        row = [lay, f"{s['decode_tok_s']:.1f} ({x:.2f}x)", ceil, ceil_mv,
               f"{b['decode_tok_s']:.1f} ({b['decode_tok_s'] / refb:.2f}x)" if b else "-",
               f"{s['prefill_tok_s']:.1f}",
               f"{res['one rank']['single']['cpu_s_per_token'] / s['cpu_s_per_token']:.2f}"]
        if "reduces_per_step" in s:
            row += [f"{s['reduces_per_step']:.0f}", f"{s['reduce_bytes_per_token']:.0f}",
                    f"{s['reduce_ms']:.3f}"]
        else:
            row += ["-", "-", "-"]
        row.append(f"{s['other_cores']:.2f}" if "other_cores" in s else "-")
        lines.append(" | ".join(row))
    lines.append(f"memory GB/s (numpy.sum): 1 rank {bw['1']:.1f}, 2 ranks {bw['2']:.1f} "
                 f"({bwr:.2f}x): ceiling of a 2-rank single stream {ref * bwr:.1f} tok/s")
    if mvr:
        lines.append(f"memory GB/s (decode's matvec): 1 rank {mv['1']:.1f}, 2 ranks "
                     f"{mv['2']:.1f} ({mvr:.2f}x): ceiling {ref * mvr:.1f} tok/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(args)
    out: dict = {"args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = _random_model(Path(tmp)) if args.model == "random" else args.model
        for name in ("quiet",) + (() if args.no_load else ("loaded",)):
            load = os.getloadavg()[0]
            print(f"{name}: 2-rank job ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            doc = launch(args, model, f"{tmp}/{name}.json", name == "loaded")
            doc["load_before"], doc["load_after"] = load, os.getloadavg()[0]
            doc["wall_s"] = time.perf_counter() - t0
            out["runs"][name] = doc
    first = next(iter(out["runs"].values()))
    print(f"model {args.model}: {first['weights_mb']:.0f} MB float32, hidden {first['hidden']}, "
          f"{first['layers']} layers, {first['heads']} heads / {first['kv_heads']} KV heads; "
          f"{os.cpu_count()} cores, one BLAS thread per rank; {args.prompt_len}-token prompts, "
          f"{args.new} new tokens; median of {args.repeats} rounds; (x) = ratio to one rank "
          "in the same rounds")
    for name, doc in out["runs"].items():
        what = ("another process of this benchmark spins on one core" if name == "loaded"
                else "the machine as it is")
        print(f"\n{name} ({what}; load average {doc['load_before']:.1f} before, "
              f"{doc['load_after']:.1f} after)")
        print(table(doc, args.batch))
    print("\nof the ceiling: the 1-sequence (x) over the 2-rank memory bandwidth (x), "
          "numpy.sum's (the issue's target) and the decode kernel's (matvec); "
          "CPU-bound x: one rank's CPU seconds per token (1 sequence) over the busiest "
          "stage's (tensor 2: rank 0's), the ratio if every rank had a core of its own "
          "(derived, not a wall-clock rate); all-reduces/step and bytes/token: tensor 2's "
          "rank 0 (prompt tokens included); other cores: CPU time taken by other processes "
          "during the 1-sequence runs, in cores (0: the machine was quiet; loaded rows "
          "include the benchmark's own spinning process)")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(out, indent=1), what="--json")
    return 0


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(main))
