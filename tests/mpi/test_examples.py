"""The porting guide's two worked examples: in-process at the suite's rank count, and as
scripts under ``tools/mpirun 2`` next to their serial scipy versions (from the np 1 run)."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import pytest
import scipy.linalg

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def load(name):
    sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def shared_dir():
    g = world()
    path = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-ex-") if g.rank == 0 else None)
    yield path
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def test_heat_in_process():
    out = load("heat_cg").main(["--n", "40", "--steps", "3"])
    parallel_assert(out["error"] < 1e-9, f"error {out['error']}")


def test_radiosity_in_process(shared_dir):
    g = world()
    inp, outp = os.path.join(shared_dir, "room.h5"), os.path.join(shared_dir, "B.h5")
    res = load("radiosity_lu").main(["--m", "30", "--nb", "16", "--input", inp, "--output", outp])
    ok = res["residual"] < 1e-12
    if g.rank == 0:
        with h5py.File(inp, "r") as f:
            a, e = f["A"][...], f["E"][...]
        with h5py.File(outp, "r") as f:
            b = f["B"][...]
        ok = ok and np.allclose(b, scipy.linalg.solve(a, e), rtol=1e-12, atol=1e-14)
    parallel_assert(ok, f"radiosity residual {res['residual']}")


def test_heat_refuses_arguments_it_cannot_run():
    from hpcmac.errors import UsageError

    for args in (["--n", "0"], ["--dt", "-1"], ["--rtol", "2"], ["--steps", "-1"]):
        with pytest.raises(UsageError, match="expected --n >= 1"):
            load("heat_cg").main(args)


def test_radiosity_refuses_an_input_file_of_another_size(shared_dir):
    from hpcmac.errors import UsageError

    inp, outp = os.path.join(shared_dir, "room.h5"), os.path.join(shared_dir, "B.h5")
    mod = load("radiosity_lu")
    mod.main(["--m", "10", "--nb", "8", "--input", inp, "--output", outp])
    with pytest.raises(UsageError, match=r"holds a 40 x 40 system, but --m 12 needs 48 x 48"):
        mod.main(["--m", "12", "--nb", "8", "--input", inp, "--output", outp])


def _run(cmd, cwd):
    """Run a command outside this MPI job (no inherited launcher variables)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HYDRA_", "PMI_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _fields(line):
    return dict(re.findall(r"(\w+)=(\S+)", line))


@pytest.mark.skipif(world().size != 1, reason="spawns its own 2-rank job: runs in the np 1 pass")
def test_scripts_at_two_ranks_match_serial(shared_dir):
    py = sys.executable
    mpirun = [os.path.join(ROOT, "tools", "mpirun"), "2", py]
    serial = _fields(_run([py, os.path.join(EXAMPLES, "heat_serial.py"), "--n", "48"],
                          shared_dir).strip().splitlines()[-1])
    dist = _fields(_run(mpirun + [os.path.join(EXAMPLES, "heat_cg.py"), "--n", "48"],
                        shared_dir).strip().splitlines()[-1])
    assert dist["u_max"] == serial["u_max"] and dist["ranks"] == "2"
    assert abs(float(dist["cg_iterations"]) - float(serial["cg_iterations"])) <= 2
    s = _fields(_run([py, os.path.join(EXAMPLES, "radiosity_serial.py"), "--m", "40"],
                     shared_dir).strip().splitlines()[-1])
    d = _fields(_run(mpirun + [os.path.join(EXAMPLES, "radiosity_lu.py"), "--m", "40", "--nb",
                               "32"], shared_dir).strip().splitlines()[-1])
    assert d["grid"] == "1x2" and float(d["scaled_residual"]) < 1e-12
    assert abs(float(d["total_radiosity"]) - float(s["total_radiosity"])) < 1e-9
    with h5py.File(os.path.join(shared_dir, "room_B.h5"), "r") as f1, \
            h5py.File(os.path.join(shared_dir, "room_B_serial.h5"), "r") as f2:
        np.testing.assert_allclose(f1["B"][...], f2["B"][...], rtol=1e-12, atol=1e-14)
