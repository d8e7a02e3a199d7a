"""The third ported example (examples/panel_bem.py: AeroPython lesson 10's source-panel
method for the flow past a cylinder, a dense boundary-element solve) gives the serial
script's source strengths and pressure coefficients at this rank count, on 1 x R and
2 x R/2 grids, and the exact potential-flow cp = 1 - 4 sin^2 theta."""

import importlib.util
import os
import sys

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")


def load(name):
    sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rows", [1, 2])
def test_distributed_panels_match_the_serial_original(rows):
    g = world()
    if g.size % rows:
        pytest.skip(f"{rows} process rows need an even rank count")
    n = 48
    serial_sigma, serial_cp = load("panel_serial").solve_panels(n)
    out = load("panel_bem").main(["--panels", str(n), "--nb", "8", "-P", str(rows)])
    exact = load("panel_geometry").exact_cp(n)
    ok = (np.allclose(out["sigma"], serial_sigma, rtol=1e-12, atol=1e-14)
          and np.allclose(out["cp"], serial_cp, rtol=0, atol=1e-12)
          and np.abs(out["cp"] - exact).max() < 1e-12
          and abs(out["sigma"].sum()) < 1e-12)  # a closed body: no net source
    parallel_assert(ok, f"panels at {g.size} ranks, {rows} rows: cp error {out['cp_error']:.2e}")


def test_bad_arguments_are_refused_on_every_rank():
    from hpcmac.errors import UsageError

    with pytest.raises(UsageError, match="--panels must be >= 4"):
        load("panel_bem").main(["--panels", "2"])
