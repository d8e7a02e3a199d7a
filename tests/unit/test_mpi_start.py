"""Open MPI's start-up settings: proposed only where they cannot take anything away."""

import os
import subprocess
import sys

from hpcmac import mpirun
from hpcmac.comm import mpi_start

OFF = {"OMPI_MCA_btl": "^ofi", "OMPI_MCA_mtl": "^ofi", "OMPI_MCA_pml": "ob1"}


def test_defaults_only_on_linux_without_rdma_and_without_the_users_own():
    assert mpirun.open_mpi_defaults({}, "linux", rdma=False) == OFF
    assert mpirun.open_mpi_defaults({}, "linux", rdma=True) == {}
    assert mpirun.open_mpi_defaults({}, "darwin", rdma=False) == {}
    for key in OFF:
        assert mpirun.open_mpi_defaults({key: "tcp"}, "linux", rdma=False) == {}
    assert mpirun.open_mpi_defaults({"HPCMAC_OMPI_DEFAULTS": "0"}, "linux", rdma=False) == {}


def test_rdma_device_is_any_entry_in_the_device_folders(tmp_path):
    empty, full = tmp_path / "empty", tmp_path / "full"
    empty.mkdir()
    (full / "mlx5_0").mkdir(parents=True)
    assert not mpirun.has_rdma_device((str(empty), str(tmp_path / "missing")))
    assert mpirun.has_rdma_device((str(empty), str(full)))


def test_launcher_exports_them():
    _, env = mpirun.plan(2, ["cmd"], "/v/bin", "/v/bin/mpirun", 2, 1000, {}, "linux", False)
    assert all(env[k] == v for k, v in OFF.items())
    _, env = mpirun.plan(2, ["cmd"], "/v/bin", "/v/bin/mpirun", 2, 1000,
                         {"OMPI_MCA_btl": "tcp,self"}, "linux", False)
    assert env["OMPI_MCA_btl"] == "tcp,self" and "OMPI_MCA_pml" not in env


def test_load_sets_them_before_mpi_init_and_times_it():
    # a fresh interpreter: the settings must be in the environment MPI_Init reads
    code = ("import os; from hpcmac.comm import mpi_start; mpi_start.load(); "
            "print(os.environ.get('OMPI_MCA_btl'), mpi_start.STARTUP['mpi_import_s'] > 0)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    want = "^ofi" if mpi_start.open_mpi_defaults(env) else "None"
    assert out.stdout.split() == [want, "True"]


def test_info_startup_lines_take_the_slowest_rank():
    from hpcmac.info import startup_lines

    times = [dict(ready=0.4, numpy=None, init=0.2, mpi=0.1, scipy=0.0, mlx=0.01),
             dict(ready=0.6, numpy=None, init=0.3, mpi=0.15, scipy=0.0, mlx=0.02)]
    lines = startup_lines(times, dict(OFF), True)
    assert "0.60 s from process start" in lines[0]
    assert "comm.init 0.300 s, mpi4py + MPI_Init 0.150 s" in lines[1]
    assert "OMPI_MCA_btl=^ofi" in lines[2] and "set by hpcmac" in lines[2]
    assert startup_lines(times, {}, False)[2].endswith("Open MPI's own")
