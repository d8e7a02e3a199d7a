"""Transport names on the command line and in the environment: one line, exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_info(*args, **env):
    full = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    for k in ("HPCMAC_TRANSPORT", "HPCMAC_TRANSPORT_STRICT"):
        if k not in env:
            full.pop(k, None)
    return subprocess.run([sys.executable, "-m", "hpcmac", "info", *args], capture_output=True,
                          text=True, timeout=120, env=full, cwd=ROOT)


@pytest.mark.parametrize("args,env,line", [
    (["--transport", "bogus"], {},
     "error: unknown transport 'bogus'; expected one of: auto, mpi, rdma, ring, local"),
    ([], {"HPCMAC_TRANSPORT": "tcp"},
     "error: HPCMAC_TRANSPORT: unknown transport 'tcp'; "
     "expected one of: auto, mpi, rdma, ring, local"),
    (["--transport", "rdma"], {"HPCMAC_TRANSPORT_STRICT": "1"},
     "error: rdma: mlx has no jaccl backend on Linux"),
])
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the rdma line is Linux's")
def test_bad_or_unusable_transport_is_one_line_exit_2(args, env, line):
    proc = run_info(*args, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [line]
    assert "Traceback" not in proc.stderr


def test_unusable_rdma_falls_back_without_strict():
    proc = run_info("--transport", "rdma")
    assert proc.returncode == 0, proc.stderr
    assert "chosen       mpi" in proc.stdout


def test_info_says_where_mlx_hybrids_sum():
    """issue #30: MLX's groups cannot split, so hpcmac info says where a hybrid's sums go."""
    pytest.importorskip("mlx.core")
    from hpcmac.llm.parallel.host_syncs import HYBRID_RULE

    proc = run_info()
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("mlx groups")]
    assert lines == [f"mlx groups   {HYBRID_RULE}"], proc.stdout
    assert "mlx#3205" in HYBRID_RULE and "MPI sub-groups" in HYBRID_RULE
