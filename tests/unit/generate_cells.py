"""Several ``generate`` cells in one job, each with its own JSON and stderr.

The MLX test files (``test_llm_mlx_matrix.py``, ``test_llm_mlx_mlxlm.py``) check many
folders at the same layout. One job a cell paid its start-up every time (imports, numba,
the ring's bring-up: about 3 s of CPU a rank); one job a layout pays it once and runs each
cell's ``generate`` on the same group (:func:`hpcmac.llm.cli.run_generate`, as
``python -m hpcmac.llm generate`` does), each rank's stderr written to the cell's file,
rank 0's JSON to the cell's ``--json``.

As a script, under ``tools/mpirun N``: ``python generate_cells.py SPEC``, SPEC a JSON
list of ``{"argv": [generate's flags], "stderr": PATH}``. Any rank's error aborts the
whole job (:func:`hpcmac.lifecycle.run_cli`): the cells after it have no JSON, and the
one that failed is the first whose stderr file exists without a JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cells(argv: list[str]) -> int:
    """Collective: every rank runs each cell of the SPEC file ``argv[0]`` in turn."""
    from hpcmac import comm
    from hpcmac.launch.hostfile import job_hostfile
    from hpcmac.llm.cli import build_parser, run_generate

    cells = json.loads(Path(argv[0]).read_text())
    parsed = [build_parser().parse_args(c["argv"]) for c in cells]
    group = comm.job_group(parsed[0].transport, announce=False,
                           hostfile=lambda: job_hostfile(parsed[0].hostfile))
    for cell, args in zip(cells, parsed):
        with open(f"{cell['stderr']}.{group.rank}", "w") as err, redirect_stderr(err):
            code = run_generate(args, group=group)
        if code:
            return code
    return 0


def session_cells(items, test: str) -> list[dict]:
    """The parameters of each cell of the test function ``test`` that this pytest session
    runs (``-m``, ``-k`` applied; under xdist, the worker's whole collection: a cell's
    work unit must hold the cells batched with it)."""
    return [i.callspec.params for i in items if getattr(i, "originalname", None) == test]


def generate_cells(np_: int, cells: dict[str, tuple[Path, list[str]]], tmp: Path,
                   prompt: list[int], n: int) -> dict[str, tuple[dict, str] | str]:
    """Each cell's ``generate --backend mlx --transport ring`` at ``np_`` ranks, all in one
    ``tools/mpirun`` job.

    ``cells``: name -> (folder, extra flags). Returns name -> (rank 0's JSON, the cell's
    stderr, every rank's) or a line saying why not (the job's exit and stderr's tail), so
    each cell's test fails naming itself: a cell without JSON, and every cell when the
    job's exit is not 0 after all of them ran (a job of one cell had to exit 0).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    spec, paths = [], {}
    for i, (name, (folder, extra)) in enumerate(cells.items()):
        out, err = tmp / f"c{i}.json", tmp / f"c{i}.stderr"
        paths[name] = out, err
        spec.append({"stderr": str(err), "argv": [
            "generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, prompt)),
            "--max-tokens", str(n), "--quiet", "--json", str(out), "--backend", "mlx",
            "--transport", "ring", *extra]})
    (tmp / "spec.json").write_text(json.dumps(spec))
    cap = 150 + 45 * len(cells)  # start-up once, then each cell's load and decode
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT=str(cap),
               OMP_NUM_THREADS="1")
    env.pop("HPCMAC_TRANSPORT", None)
    env.pop("HPCMAC_QUIET_TRANSPORT", None)
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, __file__,
           str(tmp / "spec.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=cap + 40,
                          cwd=ROOT)
    got: dict[str, tuple[dict, str] | str] = {}
    # a cell's own run ended well when it wrote its JSON and the job exited 0, or failed
    # in a later cell (not in its end, which every cell shares)
    later_failed = proc.returncode != 0 and not all(out.exists() for out, _ in paths.values())
    for name, (out, err) in paths.items():
        parts = sorted(err.parent.glob(err.name + ".*"))
        stderr = "".join(p.read_text() for p in parts)
        if out.exists() and (proc.returncode == 0 or later_failed):
            got[name] = json.loads(out.read_text()), stderr
            continue
        where = ("ended badly after every cell's run" if out.exists() else
                 "failed in this cell" if parts else "ended before this cell")
        got[name] = (f"{name}: the {np_}-rank job (exit {proc.returncode}) {where}; "
                     f"its stderr: {(stderr + proc.stderr)[-3000:]}")
    return got


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(run_cells, sys.argv[1:]))
