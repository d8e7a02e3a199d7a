"""HDF5 round trips: each rank its own blocks, any layout, both write paths give one file."""

import hashlib
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest
from linalg_util import dist, each_grid, grid_at, rand, same_error_everywhere

from hpcmac.errors import UsageError
from hpcmac.io.hdf5 import mpi_io_available, read_hdf5, write_hdf5
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


@pytest.fixture
def shared_dir():
    """Collective: one temporary directory, the same path on every rank."""
    g = world()
    path = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-h5-") if g.rank == 0 else None)
    yield path
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_round_trip_any_layout(shared_dir, dtype):
    g = world()
    rng = np.random.default_rng(30)
    a = rand(rng, (23, 17), dtype)
    for _g, grid in each_grid(limit=3):
        path = os.path.join(shared_dir, f"rt_{grid.nprow}x{grid.npcol}.h5")
        how = write_hdf5(dist(a, grid, 5, 3), path, "group/A", collective=False)
        g.barrier()
        ok = True
        if g.rank == 0:
            with h5py.File(path, "r") as f:
                ds = f["group/A"]
                ok = (np.array_equal(ds[...], a) and ds.dtype == a.dtype
                      and int(ds.attrs["hpcmac_mb"]) == 5 and int(ds.attrs["hpcmac_nb"]) == 3
                      and tuple(ds.attrs["hpcmac_grid"]) == grid.shape)
        parallel_assert(ok and how in ("serial", "none"), f"file content {grid.shape}", g)
        for mb, nb in [(4, 4), (2, 7), (23, 17), (64, 64)]:
            back = read_hdf5(path, "group/A", grid, mb, nb)
            full = back.allgather()
            parallel_assert(not grid.in_grid or np.array_equal(full, a),
                            f"read {mb}x{nb} on {grid.shape}", g)


def test_vector_dataset_reads_as_column(shared_dir):
    g = world()
    path = os.path.join(shared_dir, "vec.h5")
    if g.rank == 0:
        with h5py.File(path, "w") as f:
            f["b"] = np.arange(11.0)
    g.barrier()
    for _g, grid in each_grid(limit=2):
        full = read_hdf5(path, "b", grid, 3, 2).allgather()
        parallel_assert(not grid.in_grid or np.array_equal(full[:, 0], np.arange(11.0)),
                        "vector", g)


def test_missing_file_dataset_shape_one_line_everywhere(shared_dir):
    g = world()
    grid = grid_at(0)
    path = os.path.join(shared_dir, "e.h5")
    write_hdf5(dist(np.ones((4, 6)), grid, 2, 2), path, "A", collective=False)
    missing = os.path.join(shared_dir, "nope.h5")
    msg = same_error_everywhere(g, lambda: read_hdf5(missing, "A", grid, 2, 2), UsageError)
    assert missing in msg and "'A'" in msg and "\n" not in msg
    msg = same_error_everywhere(g, lambda: read_hdf5(path, "B", grid, 2, 2), UsageError)
    assert path in msg and "'B'" in msg
    msg = same_error_everywhere(
        g, lambda: read_hdf5(path, "A", grid, 2, 2, shape=(6, 4)), UsageError)
    assert path in msg and "(4, 6)" in msg and "(6, 4)" in msg


@pytest.mark.skipif(not mpi_io_available(), reason="h5py is not built with MPI")
def test_collective_and_serial_writes_give_identical_files(shared_dir):
    g = world()
    rng = np.random.default_rng(31)
    for dtype in (np.float64, np.complex128):
        a = rand(rng, (29, 31), dtype)
        for _g, grid in each_grid(limit=2):
            digests = []
            for how in ("mpio", "serial"):
                path = os.path.join(shared_dir, f"{how}_{grid.nprow}x{grid.npcol}.h5")
                if g.rank == 0 and os.path.exists(path):
                    os.remove(path)
                g.barrier()
                used = write_hdf5(dist(a, grid, 4, 6), path, "A", collective=(how == "mpio"))
                write_hdf5(dist(a, grid, 4, 6), path, "sub/B", collective=(how == "mpio"))
                g.barrier()
                parallel_assert(used in (how, "none"), f"{used} != {how}", g)
                with open(path, "rb") as f:
                    digests.append(hashlib.sha256(f.read()).hexdigest())
                full = read_hdf5(path, "sub/B", grid, 3, 3).allgather()
                parallel_assert(not grid.in_grid or np.array_equal(full, a), how, g)
            parallel_assert(digests[0] == digests[1], "MPI-IO and serial files differ", g)
