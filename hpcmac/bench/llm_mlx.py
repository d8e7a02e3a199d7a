"""hpcmac's MLX backend against mlx-lm's own decode, side by side on one folder.

``python -m hpcmac.bench.llm_mlx [--model PATH] [--tp 1,2] [--tokens N] [--rounds R]
[--json FILE]``

For each tensor-parallel size (1: one process; 2 and more: that many ranks on this
machine), in each round:

* hpcmac: ``generate --backend mlx`` (``--tp T --transport ring`` through
  ``tools/mpirun``: the sums inside MLX's graph), greedy, its decode tok/s and each
  rank's host syncs and bytes per token (counted by the backend: generate's JSON);
* mlx-lm: its ``generate_step`` (the loop ``stream_generate`` wraps; a random folder
  has no tokenizer for ``stream_generate`` itself) with an argmax sampler, timed from
  the first token to the last; at T > 1 the model shards itself (``model.shard``, as
  ``sharded_load`` does) under ``mlx.launch --backend ring``.

Both decode the same prompt ids to the same number of tokens; the tokens are compared.
Without ``--model`` a random float32 Llama is written (hidden 1024, 8 layers, 2816,
vocabulary 32000: ~760 MB). Medians over the rounds, the ratio hpcmac / mlx-lm per
round then its median, and the load average before and after are printed.
mlx-lm is the oracle (the test extra), never a dependency.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hpcmac.comm.ring_env import free_ports
from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output, write_atomic
from hpcmac.lifecycle import run_cli

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 5, 9, 33, 70, 2, 17, 11, 4, 90, 81, 7, 3, 64, 12, 8]

#: mlx-lm's side, run as a script (one process, or each rank under mlx.launch): argv
#: N TP PROMPT_IDS FOLDER... (several: one JSON line each, in turn, on one start-up)
MLX_LM = r'''
import json, sys, time
from pathlib import Path
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

n, tp, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:]
prompt = [int(t) for t in sys.argv[3].split(",")]
group = mx.distributed.init(backend="ring", strict=True) if tp > 1 else None
rank = group.rank() if group is not None else 0
for path in paths:
    model, _ = load_model(Path(path), lazy=True)
    if group is not None:
        model.shard(group)
    mx.eval(model.parameters())
    stamps, toks = [], []
    steps = generate_step(mx.array(prompt), model, max_tokens=n,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    for (tok, _), _ in zip(steps, range(n)):
        toks.append(int(tok))
        stamps.append(time.perf_counter())
    if rank == 0:
        print(json.dumps({"model": path, "rate": (n - 1) / (stamps[-1] - stamps[0]),
                          "tokens": toks}), flush=True)
'''


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               HPCMAC_QUIET_TRANSPORT="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("HPCMAC_TRANSPORT", None)
    return env


def _run(cmd: list[str], what: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=timeout, start_new_session=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"error: {what} failed (exit {proc.returncode})")
    return proc


def hpcmac_rate(model: str, tp: int, n: int, out: Path, timeout: float) -> dict:
    """generate --backend mlx at ``tp`` ranks: decode tok/s, tokens, per-rank host counts."""
    args = ["-m", "hpcmac.llm", "generate", "--model", model, "--backend", "mlx",
            "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", str(n), "--quiet",
            "--json", str(out)]
    if tp == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [str(ROOT / "tools" / "mpirun"), str(tp), sys.executable, *args, "--tp", str(tp),
               "--transport", "ring"]
    _run(cmd, f"hpcmac generate at tp {tp}", timeout)
    doc = json.loads(out.read_text())
    return {"rate": doc["aggregate_decode_tok_s"], "tokens": doc["tokens"],
            "host": doc["host"]}


def _starting_port(n: int) -> int:
    """mlx.launch's ``--starting-port``: it counts up from there, one port per rank."""
    try:
        return free_ports("127.0.0.1", n)
    except OSError as e:
        raise SystemExit(f"error: mlx.launch ports: {e}") from None


def mlx_lm_rate(model: str, tp: int, n: int, script: Path, timeout: float) -> dict:
    """mlx-lm's decode at ``tp`` ranks (mlx.launch --backend ring when > 1)."""
    args = [str(script), str(n), str(tp), ",".join(map(str, PROMPT)), model]
    if tp == 1:
        cmd = [sys.executable, *args]
    else:
        launcher = Path(sys.executable).with_name("mlx.launch")
        cmd = [str(launcher), "-n", str(tp), "--backend", "ring", "--starting-port",
               str(_starting_port(tp)), "--", sys.executable, *args]
    proc = _run(cmd, f"mlx-lm at tp {tp}", timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not line:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"error: mlx-lm at tp {tp} printed no result")
    return json.loads(line[-1])


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.llm_mlx",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: a random Llama)")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, e.g. 1,2")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--json", type=checked_output("--json"), default=None, metavar="FILE")
    args = ap.parse_args(argv)
    try:
        tps = [int(t) for t in args.tp.split(",") if t.strip()]
    except ValueError:
        tps = []
    if not tps or min(tps) < 1:
        raise UsageError(f"--tp {args.tp!r}: expected sizes >= 1, comma-separated (e.g. 1,2)")
    if args.tokens < 2 or args.rounds < 1:
        raise UsageError("--tokens must be >= 2 and --rounds >= 1")
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        raise UsageError("hpcmac.bench.llm_mlx: needs mlx-lm (the test extra)") from None
    with tempfile.TemporaryDirectory(prefix="hpcmac-llm-mlx-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from hpcmac.measure.llm import write_random_llama

            model = str(write_random_llama(work / "llama", 1024, 8, 2816, 32000, heads=16,
                                           kv_heads=4))
        script = work / "mlx_lm_decode.py"
        script.write_text(MLX_LM)
        load0 = _load()
        rows: dict[int, list[dict]] = {t: [] for t in tps}
        for _ in range(args.rounds):
            for tp in tps:
                ours = hpcmac_rate(model, tp, args.tokens, work / f"g{tp}.json", args.timeout)
                theirs = mlx_lm_rate(model, tp, args.tokens, script, args.timeout)
                rows[tp].append({"hpcmac": ours["rate"], "mlx_lm": theirs["rate"],
                                 "ratio": ours["rate"] / theirs["rate"],
                                 "same_tokens": ours["tokens"] == theirs["tokens"],
                                 "host": ours["host"]})
        load1 = _load()
    print(f"hpcmac.bench.llm_mlx: {args.tokens} greedy tokens, {args.rounds} rounds, medians; "
          f"load {load0} before, {load1} after")
    out = {"model": args.model or "random llama 1024x8 (760 MB float32)",
           "tokens": args.tokens, "load_before": load0, "load_after": load1, "tp": {}}
    for tp, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("hpcmac", "mlx_lm", "ratio")}
        syncs = [h["host_syncs_per_token"] for h in rs[-1]["host"]]
        same = all(r["same_tokens"] for r in rs)
        print(f"tp {tp}: hpcmac {med['hpcmac']:.2f} tok/s, mlx-lm {med['mlx_lm']:.2f} tok/s, "
              f"ratio {med['ratio']:.2f}; host syncs/token per rank {syncs}; "
              f"same tokens: {same}")
        out["tp"][str(tp)] = {**med, "same_tokens": same, "host": rs[-1]["host"], "rounds": rs}
    if args.json:
        write_atomic(args.json, json.dumps(out, indent=1), what="--json")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
