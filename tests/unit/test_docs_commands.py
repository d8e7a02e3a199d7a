"""Every shell block in README.md and docs/*.md marked ``<!-- docs-test: run -->`` runs as
written, so the docs cannot drift from the code.

Each marked block runs in ``bash -e`` in a fresh directory that mirrors the checkout
(symlinks to its top-level entries, ``.venv`` to this interpreter's environment), with a
clean environment (no launcher variables) and the venv activated, as the docs say to run
them. A block passes when it exits 0 and prints no traceback (unactivated launches are
tested in test_mpirun.py and test_launch_local.py). Blocks that need hardware or
services this machine lacks (Macs, Slurm, sudo) are simply not marked.
``<!-- docs-test: run timeout=N -->`` sets the block's limit in seconds (default 600:
the blocks are the docs' real commands, minutes in all on two cores, so this file is
the suite's one deliberately slow test).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*docs-test:\s*run(?:\s+timeout=(\d+))?\s*-->\s*$")


def blocks(path: Path) -> list[tuple[int, str, int]]:
    """(line, text, timeout) of each marked ``sh`` block in ``path`` (pure)."""
    lines = path.read_text().splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j >= len(lines) or not re.match(r"^```(sh|bash)\s*$", lines[j]):
                raise ValueError(f"{path.name}:{i + 1}: docs-test mark not followed by a "
                                 "```sh block")
            k = j + 1
            while k < len(lines) and not lines[k].startswith("```"):
                k += 1
            out.append((j + 1, "\n".join(lines[j + 1:k]), int(m.group(1) or 600)))
            i = k
        i += 1
    return out


CASES = [(p, line, text, t) for p in DOCS for line, text, t in blocks(p)]


def test_the_docs_mark_blocks_to_run():
    names = {p.name for p, *_ in CASES}
    assert {"README.md", "porting.md", "hpl.md"} <= names, names


def _mirror(tmp: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (tmp / entry.name).symlink_to(entry)
    (tmp / ".venv").symlink_to(Path(sys.prefix))
    return tmp


def _env() -> dict[str, str]:
    drop = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "SLURM_", "VIRTUAL_ENV", "HPCMAC_",
            "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    venv_bin = os.path.abspath(os.path.dirname(sys.executable))
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p and os.path.abspath(p) != venv_bin)
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code, also where the venv has another
    return env


@pytest.mark.parametrize("doc,line,text,timeout", [
    pytest.param(*c, id=f"{c[0].name}:{c[1]}",
                 marks=[pytest.mark.timeout(c[3] + 60), pytest.mark.slow])
    for c in CASES])
def test_marked_block_runs_as_written(tmp_path, doc, line, text, timeout):
    cwd = _mirror(tmp_path)
    script = f"set -e\n. .venv/bin/activate\n{text}\n"
    res = subprocess.run(["timeout", "-k", "10", str(timeout), "bash", "-c", script],
                         cwd=cwd, env=_env(), capture_output=True, text=True,
                         timeout=timeout + 30)
    out = res.stdout + res.stderr
    where = f"{doc.name}:{line}"
    assert res.returncode == 0, f"{where}: exit {res.returncode}\n{out[-3000:]}"
    assert "Traceback" not in out, f"{where}: a traceback\n{out[-3000:]}"
