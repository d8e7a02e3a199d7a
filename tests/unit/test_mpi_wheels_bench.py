"""bench.mpi_wheels: the launcher flags per MPI implementation, the case syntax, and one
real round (this venv against itself: every job runs and the HPL jobs PASS)."""

import json
import os
import sys

import pytest

from hpcmac.bench import mpi_wheels
from hpcmac.errors import UsageError


def test_parse_case():
    assert mpi_wheels.parse_case("1000:2x2") == (1000, 2, 2)
    assert mpi_wheels.parse_case("64:1X3") == (64, 1, 3)
    for bad in ("1000", "1000:2", "0:1x1", "a:1x1", "10:1x0"):
        with pytest.raises(UsageError, match="--cases"):
            mpi_wheels.parse_case(bad)


def test_launcher_of_this_venv():
    bindir = os.path.dirname(sys.executable)
    if not os.access(os.path.join(bindir, "mpirun"), os.X_OK):
        pytest.skip("no mpirun beside this Python")
    argv, impl = mpi_wheels.launcher(bindir, 4)
    assert impl == "Open MPI"
    assert argv[1:] == ["-np", "4", "--oversubscribe", "--bind-to", "none"]
    with pytest.raises(UsageError, match="not found"):
        mpi_wheels.launcher("/nonexistent/bin", 2)


@pytest.mark.timeout(240)
def test_one_round_against_itself(tmp_path, capsys):
    venv = os.path.dirname(os.path.dirname(sys.executable))
    if not os.access(os.path.join(venv, "bin", "mpirun"), os.X_OK):
        pytest.skip("no mpirun beside this Python")
    out = tmp_path / "w.json"
    assert mpi_wheels.main(["--venv", venv, "--cases", "200:1x2", "--rounds", "1",
                            "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = list(doc["median"])
    assert sum("hpcmac.hpl N=200 1x2" in n for n in names) == 1  # both sides: one name
    assert all(len(v) == 2 for k, v in doc["times"].items() if "Open MPI" in k)
    assert "median s" in capsys.readouterr().out
