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
  two all-reduces, minus the hop of one message of the reduced size (the
  link's alpha and beta, which the model adds separately): the runtime's cost
  per all-reduce (Python, the non-blocking calls and their waits, the sum, the
  two ranks arriving at different moments);
* ``step_s``: tensor 2's time per step minus one rank's, everything the
  group pays once a step: the leader's step messages to the follower, the
  embedding's all-reduce (hpcmac splits the embedding by vocabulary; other
  runtimes need not), the head's max-loc.

Each time is the median over rounds; the slope and intercept come from the
two layer counts. Pure launcher apart from :func:`worker`, which runs inside
the job; nothing here imports MPI at import time.
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

LAYERS = (2, 10)
HIDDEN = 64
PROMPT, NEW = 8, 32
ROUNDS = 7
TAG_WAKE = 95


def measure(timeout: float = 120.0) -> dict[str, float]:
    """Run the 2-rank job on this node; its figures (empty when MPI cannot start)."""
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
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if p.returncode != 0 or not out.exists():
            return {}
        return json.loads(out.read_text())


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


def _hop_s(world, nbytes: int, iters: int = 300) -> float:
    """Half the median round trip of one ``nbytes`` message between ranks 0 and 1."""
    import numpy as np

    buf = np.zeros(max(1, nbytes // 4), dtype=np.float32)
    times = []
    for i in range(iters + 20):
        t = time.perf_counter()
        if world.rank == 0:
            world.send(buf, 1, 96)
            world.recv(buf, 1, 97)
        else:
            world.recv(buf, 0, 96)
            world.send(buf, 0, 97)
        if i >= 20:
            times.append((time.perf_counter() - t) / 2)
    return statistics.median(times)


def worker(out: str, tmp: str) -> int:
    """Inside the 2-rank job: load, decode round-robin, fit; rank 0 writes ``out``."""
    from hpcmac import comm
    from hpcmac.bench.llm import write_random_llama
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request, run_pipeline
    from hpcmac.llm.parallel.tensor import TensorGroup, make_groups, run_tensor_pipeline

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
    groups = make_groups(world, 2, hosts)
    loaded = []
    for n in LAYERS:
        path = str(Path(tmp) / f"l{n}")
        cfg = load_config(path)
        shards = make_shards(cfg, [1, 1])
        tg = TensorGroup(groups.tensor, hosts, 60.0, [0, 1])
        tg.set_vocab_slices([s.vocab[1] - s.vocab[0] for s in shards])
        full = load_stage(path, 0, n) if world.rank == 0 else None
        tens = load_stage(path, 0, n, shard=shards[world.rank], reduce=tg.allreduce)
        loaded.append((cfg, S.stages_from_counts([n])[0], tg, full, tens))
    prompt = [3 + (7 * i) % 250 for i in range(PROMPT)]
    kw = dict(max_batch=1, max_len=PROMPT + NEW, timeout=60.0)

    def step_s(layout: str, i: int) -> float:
        cfg, spec, tg, full, tens = loaded[i]
        reqs = [Request(list(prompt), NEW)] if world.rank == 0 else None
        if layout == "one":
            res = run_pipeline(one, full, spec, cfg.hidden, reqs, hosts=hosts[:1], **kw) \
                if world.rank == 0 else None
        else:
            res = run_tensor_pipeline(groups, tg, tens, spec, cfg.hidden, reqs, **kw)
        sleeper.sync()
        return 1.0 / res.decode_tok_s() if world.rank == 0 else 0.0

    times: dict[tuple[str, int], list[float]] = {}
    for rnd in range(ROUNDS + 1):  # round 0 warms up
        for i in range(len(LAYERS)):
            for layout in ("one", "tensor"):
                t = step_s(layout, i)
                if rnd:
                    times.setdefault((layout, i), []).append(t)
    hop = _hop_s(world, HIDDEN * 4)
    if world.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        (l1, l2) = LAYERS
        fit = {}
        for layout in ("one", "tensor"):
            slope = (med[(layout, 1)] - med[(layout, 0)]) / (l2 - l1)
            fit[layout] = (slope, med[(layout, 0)] - l1 * slope)
        reduce_s = (fit["tensor"][0] - fit["one"][0]) / 2 - hop
        step = fit["tensor"][1] - fit["one"][1]
        Path(out).write_text(json.dumps({
            "ranks": 2, "reduce_s": max(0.0, reduce_s), "step_s": max(0.0, step),
            "hop_s": hop, "one_layer_s": fit["one"][0], "tensor_layer_s": fit["tensor"][0],
            "one_step_s": fit["one"][1], "tensor_step_s": fit["tensor"][1]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1], sys.argv[2]))
