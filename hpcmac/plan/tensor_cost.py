"""The tensor runtime's own cost, measured: what a tensor group pays that one rank does not.

``calibrate`` runs :func:`measure`, which starts a 2-rank job
(``python -m hpcmac.mpirun 2 python -m hpcmac.plan.tensor_cost``) on this
node. The job loads two tiny random Llamas (2 and 10 layers, hidden 64:
weights in cache, so what is timed is the runtime, not the memory) twice each:
whole on rank 0, and as tensor 2 through :mod:`hpcmac.llm.parallel.tensor`
(the model's own all-reduce, the leader's step messages, the
vocabulary-parallel head). Round after round it decodes the same prompt on
each, one after the other (rank 1 sleeps while rank 0 runs alone), through the
same scheduler (:func:`~hpcmac.llm.parallel.pipeline.run_pipeline`). Per
decode step of one sequence:

* ``reduce_s``: tensor 2's time per layer minus one rank's, over the layer's
  two all-reduces: the runtime's cost per all-reduce (Python, the non-blocking
  calls and their waits, the sum, the two ranks arriving at different
  moments). It holds the message's own hop through this node's shared memory
  too (about 1 us here, which the model's link term adds again: left in,
  as a hop measured apart from the rounds is the scheduler's on a busy host);
* ``step_s``: tensor 2's time per step minus one rank's, everything the
  group pays once a step: the leader's step messages to the follower, the
  embedding's all-reduce (hpcmac splits the embedding by vocabulary; other
  runtimes need not), the head's max-loc;
* ``sync_frac``: weights past the cache this time. Each rank multiplies a
  vector by its own matrices (a layer's shard: 4 then 12 MiB of float32, at
  least twice the largest cache in all), both ranks at once, first each on
  its own, then meeting at the runtime's all-reduce after every product. The
  second takes longer even beyond ``reduce_s`` per all-reduce: the slower
  rank sets each segment's pace (two cores sharing the memory, another job
  taking one for a moment). ``sync_frac`` is that excess over the time on
  their own (the slower rank's, both times): the median over 25 adjacent
  pairs of passes, each pair compared within itself (the medians of 9 passes
  of each kind, compared with each other, once read 45% on this VM; the pairs
  read 1-10% in six calibrations in a row).

A run's time per step is the median gap between its tokens (as
``calibrate``'s one-rank decoder costs are medians of steps: a step in which
another job took a core does not decide it), and each layout's the median
over rounds; the slope and intercept come from the two layer counts. Pure
launcher apart from :func:`worker`, which runs inside the job; nothing here
imports MPI at import time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcmac.llm.parallel.tags import TAG_WAKE

LAYERS = (2, 10)
HIDDEN = 64
PROMPT, NEW = 8, 32
ROUNDS = 7
SYNC_ROUNDS = 25
LAYOUTS = ("one", "tensor", "pipeline")


def measure(timeout: float = 120.0) -> dict[str, float]:
    """Run the 2-rank job on this node; its figures (empty, saying why on stderr, when
    the job cannot run here: no mpi4py, no mpirun, or it failed)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return {}
    with tempfile.TemporaryDirectory(prefix="hpcmac-tensor-cost-") as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   MKL_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1",
                   HPCMAC_MPIRUN_TIMEOUT=str(int(timeout)))
        cmd = [sys.executable, "-m", "hpcmac.mpirun", "2", sys.executable, "-m",
               "hpcmac.plan.tensor_cost", str(out), tmp]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=timeout + 30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = str(exc)
        else:
            if p.returncode == 0 and out.exists():
                return json.loads(out.read_text())
            tail = (p.stderr.strip().splitlines() or ["no message"])[-1]
            why = f"exit {p.returncode}: {tail}"
    print(f"note: calibrate: the tensor runtime's 2-rank job did not run ({why}); the "
          "calibration has no 'tensor' figures", file=sys.stderr)
    return {}


class _Sleeper:
    """Rank 1 waits for rank 0 without taking a core (polls every few ms)."""

    def __init__(self, world):
        from hpcmac.llm.parallel.link import Watchdog

        self.world = world
        self.wd = Watchdog(world, [""] * world.size, timeout=0, max_sleep=0.005, spin=0.0)

    def sync(self) -> None:
        import numpy as np

        buf = np.zeros(1, dtype=np.int64)
        w = self.world
        if w.rank == 0:
            for r in range(1, w.size):
                w.send(buf, r, TAG_WAKE)
        else:
            self.wd.wait(w.irecv(buf, 0, TAG_WAKE), 0, "")


def _stream_s(world, mats, reduce) -> float:
    """One pass over this rank's matrices, a product with a vector each, the two of a
    layer summed over the group by ``reduce`` when given: the slower rank's seconds."""
    import numpy as np

    world.barrier()
    t = time.perf_counter()
    h = np.ones((1, mats[0][0].shape[1]), dtype=np.float32)
    for a, b in mats:
        y = h @ a.T
        if reduce is not None:
            y = reduce(y)
        y = (y / (1.0 + np.abs(y).max())) @ b.T
        if reduce is not None:
            y = reduce(y)
        h = y[:, :h.shape[1]] / (1.0 + np.abs(y).max())
    return max(world.allgather_obj(time.perf_counter() - t))


def _sync_frac(world, reduce, reduce_s: float) -> float:
    """How much longer two ranks streaming their shards at once take when they meet at
    an all-reduce after each product (the slower one sets every segment's pace) than
    each on its own, over the time on their own (rank 0; both ranks call)."""
    import numpy as np

    from hpcmac.plan.machine import last_cache_bytes

    rng = np.random.default_rng(world.rank)
    seg = 16 << 20  # a layer's shard: 4 MiB then 12 MiB of float32 weights
    n = max(4, -(-2 * last_cache_bytes() // seg))
    mats = [(rng.standard_normal((1024, 1024), dtype=np.float32),
             rng.standard_normal((3072, 1024), dtype=np.float32)) for _ in range(n)]
    excess = []
    for rnd in range(SYNC_ROUNDS + 1):
        # a pair a few ms long, in either order: what two cores get from memory moves
        # within a second on a shared VM, and a pass is compared with its neighbour only
        if rnd % 2:
            m, a = _stream_s(world, mats, reduce), _stream_s(world, mats, None)
        else:
            a, m = _stream_s(world, mats, None), _stream_s(world, mats, reduce)
        if rnd:
            excess.append((m - a - 2 * n * reduce_s) / a)
    return max(0.0, statistics.median(excess))


def worker(out: str, tmp: str) -> int:
    """Inside the 2-rank job: load, decode round-robin, fit; rank 0 writes ``out``."""
    from hpcmac import comm
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.placement import fixed
    from hpcmac.llm.parallel.runtime import bring_up
    from hpcmac.measure.llm import write_random_llama

    world = comm.init()
    if world.size != 2:
        raise SystemExit("tensor_cost: the job needs 2 ranks")
    hosts = world.allgather_obj(os.uname().nodename)
    if world.rank == 0:
        for n in LAYERS:
            write_random_llama(Path(tmp) / f"l{n}", hidden=HIDDEN, layers=n, intermediate=128,
                               vocab=256, heads=4, kv_heads=2)
    world.barrier()
    sleeper = _Sleeper(world)
    one = world.split(0 if world.rank == 0 else 1, world.rank)
    loaded = []
    for n in LAYERS:  # each layout brought up by the runtime from its placement
        path = str(Path(tmp) / f"l{n}")
        cfg = load_config(path)
        up = dict(model=path, cfg=cfg, timeout=60.0)
        tens = bring_up(world, fixed(cfg, hosts, 2, [n]), **up)
        full = bring_up(one, fixed(cfg, hosts[:1], 1, [n]), **up) if world.rank == 0 else None
        piped = bring_up(world, fixed(cfg, hosts, 1, S.even_counts(n, 2)), **up)
        loaded.append((tens, full, piped))
    prompt = [3 + (7 * i) % 250 for i in range(PROMPT)]
    kw: dict = dict(max_batch=1, max_len=PROMPT + NEW)

    def step_s(layout: str, i: int) -> float:
        """The median time between two decoded tokens (rank 0; 0 elsewhere)."""
        tens, full, piped = loaded[i]
        reqs = [Request(list(prompt), NEW)] if world.rank == 0 else None
        stamps: list[float] = []
        kw["on_token"] = lambda seq, tok: stamps.append(time.perf_counter())
        if layout == "one":
            if world.rank == 0:
                full.run(reqs, **kw)
        elif layout == "pipeline":
            piped.run(reqs, **kw)
        else:
            tens.run(reqs, **kw)
        sleeper.sync()
        if world.rank:
            return 0.0
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(ROUNDS + 1):  # round 0 warms up
        for i in range(len(LAYERS)):
            for layout in LAYOUTS:
                t = step_s(layout, i)
                if rnd:
                    times.setdefault((layout, i), []).append(t)
    fit = {}
    reduce_s = 0.0
    if world.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        (l1, l2) = LAYERS
        for layout in LAYOUTS:
            slope = (med[(layout, 1)] - med[(layout, 0)]) / (l2 - l1)
            fit[layout] = (slope, med[(layout, 0)] - l1 * slope)
        reduce_s = max(0.0, (fit["tensor"][0] - fit["one"][0]) / 2)
    reduce_s = world.bcast_obj(reduce_s, 0)
    sync = _sync_frac(world, loaded[0][0].tensor.allreduce, reduce_s)
    if world.rank == 0:
        Path(out).write_text(json.dumps({
            "ranks": 2, "reduce_s": reduce_s, "step_s": max(0.0, fit["tensor"][1] - fit["one"][1]),
            "sync_frac": sync, "one_layer_s": fit["one"][0],
            "tensor_layer_s": fit["tensor"][0], "one_step_s": fit["one"][1],
            "tensor_step_s": fit["tensor"][1],
            # a 2-stage pipeline's step holds two hops (to the second stage, and the
            # token back): what each costs beyond one rank's step, layer costs apart
            "hop_s": max(0.0, (fit["pipeline"][1] - fit["one"][1]) / 2),
            "pipeline_layer_s": fit["pipeline"][0], "pipeline_step_s": fit["pipeline"][1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1], sys.argv[2]))
