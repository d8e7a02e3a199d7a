"""Example D (docs/porting.md): the P1 finite-element Poisson port against its serial original."""

import importlib.util
import os
import sys

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")


def load(name):
    sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("M", ["amg", "jacobi"])
def test_port_matches_serial(M, capsys):
    serial = load("fem_poisson_serial").main(["--n", "24"])
    port = load("fem_poisson").main(["--n", "24", "--M", M])
    err = np.abs(port["u"] - serial["u"]).max()
    parallel_assert(err < 1e-9 and abs(port["u_max"] - serial["u_max"]) < 1e-10,
                    f"port vs serial: {err:.1e}")
    # the printed u_max agrees to all ten digits (-Laplace u = 1: max u = 0.0737 in the limit)
    parallel_assert(abs(serial["u_max"] - 0.0737) < 1e-3, f"u_max {serial['u_max']}")
    out = capsys.readouterr().out
    if world().rank == 0:
        lines = [ln for ln in out.splitlines() if ln.startswith("n=24")]
        assert lines[0].split("u_max=")[1] == lines[1].split("u_max=")[1].split()[0]


def test_port_refuses_bad_arguments():
    from hpcmac.errors import UsageError

    with pytest.raises(UsageError, match="expected --n >= 2"):
        load("fem_poisson").main(["--n", "1"])
