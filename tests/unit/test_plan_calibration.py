"""The model against this machine: inputs measured here, predictions against runs here.

The test measures everything it compares, in one run: the link between two
ranks (``python -m hpcmac.bench.comm --json``), the node (``calibrate``, once
before the HPL runs, HPL's figures alone, and once after them, averaged), and
``python -m hpcmac.hpl`` on 1 x 1 and 1 x 2, and single-sequence decode of ``bench.llm``'s model (a
random float32 Llama of 623 MB) on one rank, a 2-stage pipeline and tensor 2
(``python -m hpcmac.bench.llm_parallel --batch 0``: the 1-sequence runs alone, the
only ones compared). The model, given only the measured
inputs, must land within 20% of each measured rate. No number here is
hard-coded. HPL runs between two calibrations; on a shared machine where the
prediction from the calibration before the runs and from the one after differ
by more than 15%, the runs are measured again (three times at most, no new
attempt after 150 s); the attempt that moved least is kept, and an HPL test
whose own prediction still moved by more than 15% is skipped, saying so: a
prediction cannot match runs made on a different machine.

Decode is bound by the memory bandwidth, and what two cores of this shared
VM get from memory moves within seconds (calibrate's 2-thread read: 47, 73,
49 GB/s in three readings 2 s apart, one core's staying at 36-40). So the
decode runs in rounds, and ``calibrate``'s own read bandwidth measure (1 and
2 threads, under a second) runs just before and just after each 1-sequence
decode (``bench.llm_parallel --read-rates``); each decode is predicted from
its own readings and the calibration's other figures, and the median of the
rounds' predicted / measured ratios must be within 20%. A decode during which
other processes or the hypervisor took more than 0.1 of a core is left out
of the median (at least 3 must be left), and every measurement waits first
until the kernel's work on the memory freed before it has ended
(``hpcmac.bench.quiet``: on this VM freed memory goes back to the host, and
kernel workers take a quarter of a core for seconds after a GiB is freed).

N = 4000 (the issue names 8000): the two HPL runs then cost seconds, not a
minute, in CI; at 4000 the panel, row swaps and broadcasts are a larger share
of the time than at 8000, so the model's overhead terms are tested harder.
A factorisation at 1 x 2 then takes 0.45 s, and a moment in which the VM takes
a core from it (0.3 s seen) halves its rate: each job factorises three times
and the median is compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcmac.bench.quiet import settle
from hpcmac.plan import cluster as clmod
from hpcmac.plan import hpl, llm
from hpcmac.plan.calibrate import calibrate
from hpcmac.plan.shape import load_shape

ROOT = Path(__file__).resolve().parents[2]
# it compares this machine's speed with the model's: make test-unit runs it alone, before
# the tests it would share the cores with under pytest-xdist (it would skip, disturbed)
pytestmark = pytest.mark.serial
N, NB = 4000, 256
HPL_RUNS = 3  # one job factorises N three times (HPL.dat's Ns): the median is compared
PROMPT, NEW = 16, 32   # 32 new tokens: a decode row lasts long enough (> 0.25 s) for
ROUNDS = 5             # bench.llm_parallel to tell the CPU other processes took meanwhile
# 5 rounds, not 7 (two rounds of 3 decodes less): the median of 5 still keeps out two
# rounds whose bandwidth moved across the decode (such a round was +19-25%), and
# at least 3 must be undisturbed either way (docs/plan.md's quiet runs: none disturbed)


def mpirun(np_: int | None, *args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    """``tools/mpirun np python args`` (np None: python alone, for a launcher)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT=str(timeout),
               HPCMAC_QUIET_TRANSPORT="1")
    cmd = [sys.executable, *args]
    if np_ is not None:
        cmd = [str(ROOT / "tools" / "mpirun"), str(np_), *cmd]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout + 30)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def average(a: dict, b: dict) -> dict:
    """Two calibrations merged: the mean of every number, key by key."""
    if isinstance(a, dict):
        return {k: average(a[k], b[k]) for k in a if k in b}
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return (a + b) / 2
    return a


GRIDS = ((1, 1), (1, 2))


def hpl_gflops(cal: str, comm: str, grid: tuple[int, int]) -> float:
    """HPL's predicted Gflops at ``grid`` from the calibration file ``cal``."""
    p, q = grid
    cl = clmod.build(calibration=cal, comm=comm, slots=p * q, blas_threads=1)
    return hpl.predict(cl, hpl.HplCase(N, NB, p, q)).gflops


def drift(cals: list[str], comm: str, grids=GRIDS) -> tuple[float, str]:
    """How far HPL's predictions from the calibration before the runs alone and from
    the one after alone lie apart (the largest over ``grids``), and where: every figure
    a prediction uses weighted by how much it decides it (the 2-thread copy bandwidth
    of this VM moves 60-80% between calibrations; the row swaps it prices are a few
    percent of the time)."""
    return max((abs(hpl_gflops(cals[1], comm, g) / hpl_gflops(cals[0], comm, g) - 1),
                f"HPL {g[0]}x{g[1]}") for g in grids)


STEADY = 0.15   # a comparison only means something while the machine keeps its speed
ATTEMPTS = 3
BUDGET_S = 150  # no new attempt after this long: the test stays bounded on a busy machine


def write(path: Path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Measure the link; calibrate, run HPL, calibrate again, again (at most 3 times)
    while HPL's prediction moved by more than 15% meanwhile (other jobs on a shared
    host), keeping the attempt that moved least; then decode in rounds, with one more
    calibration after it (the one before is the last HPL attempt's)."""
    pytest.importorskip("safetensors")
    from hpcmac.measure.llm import write_random_llama

    load = os.getloadavg()[0]  # before anything of this test runs: the other jobs' load
    tmp = tmp_path_factory.mktemp("plan")
    # bench.llm's model: a random float32 Llama, 8 layers, hidden 1024 (623 MB)
    model = write_random_llama(tmp / "llama", 1024, 8, 2816, 32000, heads=16, kv_heads=4)
    comm = str(tmp / "comm.json")
    mpirun(2, "-m", "hpcmac.bench.comm", "--quick", "--transports", "mpi", "--rounds", "3",
           "--max-bandwidth", "16M", "--max-latency", "64", "--max-collective", "8",
           "--json", comm)
    attempts = []
    t0 = time.monotonic()
    for i in range(ATTEMPTS):
        if attempts and time.monotonic() - t0 > BUDGET_S:
            break
        settle()  # each measurement after the kernel's work on the memory freed before it
        # HPL's figures alone: the decode compares with the calibration after the last
        # attempt's runs (its decoder and tensor figures) and the one after the decode
        before = calibrate(quick=True, decoder=False)
        settle()
        runs = {}
        for p, q in GRIDS:
            out = tmp / f"hpl{i}-{p}x{q}.json"
            mpirun(p * q, "-m", "hpcmac.hpl", "-N", *[str(N)] * HPL_RUNS, "--nb", str(NB),
                   "-P", str(p), "-Q", str(q), "--blas-threads", "1", "--json", str(out))
            recs = json.loads(out.read_text())
            assert len(recs) == HPL_RUNS and all(r["passed"] for r in recs)
            runs[(p, q)] = [r["gflops"] for r in recs]
        settle()
        after = calibrate(quick=True)
        cals = [write(tmp / f"node{i}-{n}.json", c) for n, c in (("before", before),
                                                                 ("after", after))]
        attempts.append({"cal": write(tmp / f"node{i}.json", average(before, after)),
                         "cals": cals, "comm": comm, "hpl": runs, "load": load,
                         "moved": drift(cals, comm)})
        if attempts[-1]["moved"][0] <= STEADY:
            break
    best = min(attempts, key=lambda a: a["moved"][0])
    best["tries"] = [a["moved"] for a in attempts]
    decode = tmp / "decode.json"
    mpirun(None, "-m", "hpcmac.bench.llm_parallel", "--model", str(model), "--no-load",
           "--batch", "0", "--new", str(NEW), "--prompt-len", str(PROMPT),
           "--repeats", str(ROUNDS), "--read-rates", "--json", str(decode), timeout=400)
    best["llm"] = json.loads(decode.read_text())["runs"]["quiet"]["rounds"]
    best["model"] = str(model)
    settle()
    best["before"], best["after"] = after, calibrate(quick=True)
    return best


def steady(measured: dict, grid: tuple[int, int]) -> None:
    """Skip, saying why, when the prediction moved between the calibrations."""
    d, what = drift(measured["cals"], measured["comm"], [grid])
    if d > STEADY:
        shown = ", ".join(f"{x:.0%} ({w})" for x, w in measured["tries"])
        pytest.skip(f"the {what} prediction from the calibration before the runs and from "
                    f"the one after differ by {d:.0%} (every attempt: {shown}; a shared, "
                    "busy machine): a prediction cannot match runs made on a different "
                    "machine")


# the fixture's measurements take ~1 minute on a quiet machine, at most ~4 on a busy one
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("grid", [(1, 1), (1, 2)])
def test_hpl_prediction_within_20_percent(measured, grid):
    p, q = grid
    pred = hpl_gflops(measured["cal"], measured["comm"], grid)
    pb, pa = (hpl_gflops(c, measured["comm"], grid) for c in measured["cals"])
    each = measured["hpl"][grid]
    got = statistics.median(each)
    print(f"HPL N={N} {p}x{q}: predicted {pred:.2f} Gflops, measured {got:.2f} (median of "
          + ", ".join(f"{g:.2f}" for g in each) + f"; from the calibration before / after "
          f"alone {pb:.2f} / {pa:.2f})")
    steady(measured, grid)
    assert pred == pytest.approx(got, rel=0.20), (pred, got)


def with_reads(cal: dict, read: dict) -> dict:
    """``cal`` with the read bandwidth of one decode: the mean of calibrate's readings
    just before and just after it."""
    return dict(cal, read_bw_gbs={k: (read["before"][k] + read["after"][k]) / 2
                                  for k in read["before"]})


#: a decode during which other processes (or the hypervisor: steal time) took more
#: than this many cores ran on a different machine than the one calibrated; quiet
#: decodes here read 0.00-0.07, disturbed ones 0.17-0.34
OTHER_CORES = 0.1
MIN_ROUNDS = 3  # undisturbed decodes a layout needs to be compared


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout, tp, pp", [
    ("one rank", 1, 1), ("pipeline 2", 1, 2), ("tensor 2", 2, 1)])
def test_llm_decode_within_20_percent(measured, layout, tp, pp, tmp_path):
    """Single-sequence decode of bench.llm's model: one rank, a 2-stage pipeline, tensor 2;
    each round predicted from its own read bandwidth, the median ratio compared."""
    if tp > 1:  # the tensor runtime's own cost must have been measured (calibrate's job)
        assert "tensor" in measured["before"] and "tensor" in measured["after"]
    shape = load_shape(measured["model"]).with_bits(32.0, "numpy float32")
    case = llm.LlmCase(tp=tp, pp=pp, batch=1, prompt=PROMPT, context=PROMPT + NEW,
                       act_bytes=4, kv_bytes=4)

    def predict(cal: dict) -> llm.LlmPrediction:
        path = tmp_path / "calibration.json"
        path.write_text(json.dumps(cal))
        cl = clmod.build(calibration=str(path), comm=measured["comm"], slots=tp * pp)
        return llm.predict(cl, shape, case)

    mean = average(measured["before"], measured["after"])
    ratios, moved, disturbed = [], [], 0
    print(f"\ndecode {layout} (load {measured['load']:.1f}), a round a line:")
    for rnd in measured["llm"]:
        got, read = rnd["single"][layout], rnd["read_gb_s"][layout]
        pred = predict(with_reads(mean, read))
        pb, pa = (predict(with_reads(measured[k], read)).decode_tok_s
                  for k in ("before", "after"))
        quiet = got.get("other_cores", 0.0) <= OTHER_CORES
        if quiet:
            ratios.append(pred.decode_tok_s / got["decode_tok_s"])
            moved.append(abs(pa / pb - 1))
        else:
            disturbed += 1
        other = got.get("other_cores", float("nan"))
        print(f"  read GB/s at 1 / 2 threads {read['before']['1']:.1f}-{read['after']['1']:.1f}"
              f" / {read['before']['2']:.1f}-{read['after']['2']:.1f}: predicted "
              f"{pred.decode_tok_s:.2f} tok/s, measured {got['decode_tok_s']:.2f} "
              f"({pred.decode_tok_s / got['decode_tok_s'] - 1:+.0%}; ms a token: stream "
              f"{pred.stream_s * 1e3:.2f}, fixed {pred.fixed_s * 1e3:.2f}, all-reduce "
              f"{pred.allreduce_s * 1e3:.2f}, hops {pred.hops_s * 1e3:.2f}; from the "
              f"calibration before / after alone {pb:.2f} / {pa:.2f}; other processes "
              f"{other:.2f} cores, of which steal {got.get('steal_cores', float('nan')):.2f}"
              f"{'' if quiet else ': left out'})")
    if tp > 1:
        t = [measured[k]["tensor"] for k in ("before", "after")]
        print("  tensor runtime (before / after): " + " / ".join(
            f"{x['reduce_s'] * 1e6:.1f} us a reduction, {x['step_s'] * 1e6:.1f} us a step, "
            f"sync {x['sync_frac']:.1%}" for x in t))
    if pp > 1:
        print("  pipeline runtime (before / after): " + " / ".join(
            f"{measured[k].get('tensor', {}).get('hop_s', 0) * 1e6:.1f} us a hop"
            for k in ("before", "after")))
    if len(ratios) < MIN_ROUNDS:
        pytest.skip(f"other processes took more than {OTHER_CORES} cores during "
                    f"{disturbed} of {disturbed + len(ratios)} decodes: a decode then waits "
                    "on the scheduler, which the model does not describe")
    ratio = statistics.median(ratios)
    print(f"  median predicted / measured over {len(ratios)} undisturbed decodes: {ratio:.3f}")
    # the calibration's other figures (fixed costs, the tensor runtime's: seconds of a
    # 2-rank job) move with the scheduler too
    if statistics.median(moved) > STEADY:
        pytest.skip(f"the predictions from the calibration before the runs and from the one "
                    f"after differ by {statistics.median(moved):.0%} (a shared, busy "
                    "machine): a prediction cannot match runs made on a different machine")
    assert ratio == pytest.approx(1.0, abs=0.20), ratios
