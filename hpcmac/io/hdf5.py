"""DistMatrix <-> HDF5 datasets, each rank reading and writing only its own blocks.

The dataset is the plain global matrix (row-major, shape (m, n)), readable by
any HDF5 tool or ``h5py`` on one machine; attributes record the layout it was
written from (``hpcmac_layout``, ``hpcmac_mb``, ``hpcmac_nb``, ``hpcmac_grid``,
``hpcmac_grid_order``). A rank's blocks form at most four regular hyperslabs
(full blocks, the edge row, the edge column, the corner), so one read or
write per rank moves all of them.

Writing: with an MPI build of h5py (``h5py.get_config().mpi``) and an MPI
group, the file is opened by all ranks with the MPI-IO driver and written
collectively; otherwise rank 0 creates the dataset and the ranks write in
turn. Both paths create the dataset the same way (contiguous, allocated at
creation, no timestamps), so the files are identical.
"""

from __future__ import annotations

import os

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.errors import UsageError
from hpcmac.linalg.distmatrix import DistMatrix

LAYOUT_ATTR = "2-D block-cyclic"


def _h5py():
    import h5py

    return h5py


def mpi_io_available(group=None) -> bool:
    """True when h5py has MPI and ``group`` (if given) is an MPI group with a communicator."""
    h5py = _h5py()
    if not h5py.get_config().mpi:
        return False
    return group is None or getattr(group, "comm", None) is not None


def _runs(n: int, nb: int, iproc: int, nprocs: int) -> list[tuple[int, int, int, int]]:
    """This process's blocks of one dimension as regular runs ``(start, stride, count, block)``.

    At most two: the full blocks, then the partial edge block if it is ours.
    """
    nfull_total = n // nb
    # full blocks k = iproc, iproc + nprocs, ... below nfull_total
    count = 0 if iproc >= nfull_total else (nfull_total - 1 - iproc) // nprocs + 1
    out = []
    if count:
        out.append((iproc * nb, nprocs * nb, count, nb))
    if n % nb and (nfull_total % nprocs) == iproc:
        out.append((nfull_total * nb, 1, 1, n % nb))
    return out


def _select(space, grid: Grid, gshape, mb: int, nb: int) -> int:
    """Select this rank's blocks in the file dataspace; returns the number selected."""
    h5py = _h5py()
    space.select_none()
    if not grid.in_grid:
        return 0
    rows = _runs(gshape[0], mb, grid.myrow, grid.nprow)
    cols = _runs(gshape[1], nb, grid.mycol, grid.npcol)
    total = 0
    for r0, rs, rc, rb in rows:
        for c0, cs, cc, cb in cols:
            space.select_hyperslab((r0, c0), (rc, cc), (rs, cs), (rb, cb), op=h5py.h5s.SELECT_OR)
            total += rc * rb * cc * cb
    return total


def _agree(group, problem: str | None) -> None:
    """Collective: if any rank found a problem, every rank raises the first one found."""
    problems = group.allgather_obj(problem)
    first = next((p for p in problems if p), None)
    if first:
        raise UsageError(first)


def read_hdf5(path: str, dataset: str, grid: Grid, mb: int, nb: int, shape=None,
              dtype=None) -> DistMatrix:
    """Collective over ``grid.group``: read a 2-D dataset as a DistMatrix, each rank its own blocks.

    ``path``, ``dataset``, ``mb``, ``nb``, ``shape`` (the expected global
    shape, optional) are global. A 1-D dataset reads as an (n, 1) matrix.
    A missing file or dataset, or a shape that does not match, raises the
    same one-line UsageError naming the file and dataset on every rank.
    """
    h5py = _h5py()
    group = grid.group
    where = f"{path}:{dataset}"
    problem, gshape, fdtype = None, None, None
    try:
        if not os.path.exists(path):
            problem = f"{path}: no such HDF5 file (reading dataset '{dataset}')"
        else:
            with h5py.File(path, "r") as f:
                if dataset not in f or not isinstance(f[dataset], h5py.Dataset):
                    problem = f"{path}: no dataset '{dataset}' in this file"
                else:
                    ds = f[dataset]
                    gshape = {2: ds.shape, 1: ds.shape + (1,)}.get(ds.ndim)
                    fdtype = ds.dtype
                    if gshape is None:
                        problem = f"{where}: expected a 1-D or 2-D dataset, found shape {ds.shape}"
                    elif shape is not None and tuple(shape) != tuple(gshape):
                        problem = (f"{where}: dataset has shape {tuple(ds.shape)}, "
                                   f"expected {tuple(shape)}")
    except OSError as exc:
        problem = f"{path}: cannot read as HDF5 ({str(exc).splitlines()[0]})"
    _agree(group, problem)
    dt = np.dtype(dtype) if dtype is not None else fdtype
    out = DistMatrix.empty(gshape, grid, mb, nb, dt)
    if not grid.in_grid or out.local.size == 0:
        return out
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        fspace = ds.id.get_space()
        if ds.ndim == 1:  # a vector reads as a column: only process column 0 holds it
            fspace.select_none()
            for r0, rs, rc, rb in _runs(gshape[0], mb, grid.myrow, grid.nprow):
                fspace.select_hyperslab((r0,), (rc,), (rs,), (rb,), op=h5py.h5s.SELECT_OR)
            buf = np.empty(out.lshape[0], dtype=fdtype)
            ds.id.read(h5py.h5s.create_simple(buf.shape), fspace, buf)
            out.local[:, 0] = buf
            return out
        _select(fspace, grid, gshape, mb, nb)
        buf = np.empty(out.lshape, dtype=fdtype)   # selection order is row-major: C order
        mspace = h5py.h5s.create_simple(out.lshape)
        ds.id.read(mspace, fspace, buf)
    out.local[...] = buf
    return out


def _create(h5file, dataset: str, a: DistMatrix, dxpl=None):
    """Create the dataset the same way on both paths: contiguous, allocated now, no times."""
    h5py = _h5py()
    if dataset in h5file:
        del h5file[dataset]
    # intermediate groups, as h5py's create_dataset makes them
    parent, _, _ = dataset.rpartition("/")
    if parent and parent not in h5file:
        h5file.require_group(parent)
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)
    space = h5py.h5s.create_simple(tuple(a.gshape))
    tid = h5py.h5t.py_create(a.dtype, logical=True)
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    dsid = h5py.h5d.create(h5file.id, dataset.encode(), tid, space, dcpl=dcpl, lcpl=lcpl)
    ds = h5py.Dataset(dsid)
    ds.attrs["hpcmac_layout"] = LAYOUT_ATTR
    ds.attrs["hpcmac_mb"] = np.int64(a.mb)
    ds.attrs["hpcmac_nb"] = np.int64(a.nb)
    ds.attrs["hpcmac_grid"] = np.array(a.grid.shape, dtype=np.int64)
    ds.attrs["hpcmac_grid_order"] = a.grid.order
    return ds


def _write_mine(ds, a: DistMatrix, dxpl=None) -> None:
    h5py = _h5py()
    fspace = ds.id.get_space()
    n = _select(fspace, a.grid, a.gshape, a.mb, a.nb)
    if n:
        buf = np.ascontiguousarray(a.local)
        mspace = h5py.h5s.create_simple(a.lshape)
    else:
        buf = np.zeros(1, dtype=a.dtype)
        mspace = h5py.h5s.create_simple((1,))
        mspace.select_none()
    ds.id.write(mspace, fspace, buf, dxpl=dxpl)


def write_hdf5(a: DistMatrix, path: str, dataset: str, collective: bool | None = None) -> str:
    """Collective over ``a.grid``'s ranks: write ``a`` as dataset ``dataset`` of file ``path``.

    The file is created if missing (other datasets in it are kept); a
    dataset of that name is replaced. ``collective`` None picks MPI-IO when
    h5py has MPI, True requires it, False forces the rank-by-rank path.
    Returns which path was used: "mpio" or "serial".
    """
    h5py = _h5py()
    grid = a.grid
    if not grid.in_grid:
        return "none"
    group = grid.all
    use_mpio = mpi_io_available(group) if collective is None else bool(collective)
    if use_mpio and not mpi_io_available(group):
        raise UsageError(f"{path}:{dataset}: collective HDF5 writing needs h5py built with MPI "
                         f"(h5py.get_config().mpi is False)")
    problem = None
    if group.rank == 0:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            problem = f"{path}: directory {parent} does not exist (writing dataset '{dataset}')"
    _agree(group, problem)
    if use_mpio:
        with h5py.File(path, "a", driver="mpio", comm=group.comm) as f:
            ds = _create(f, dataset, a)
            dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
            dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
            _write_mine(ds, a, dxpl)
        return "mpio"
    if group.rank == 0:
        with h5py.File(path, "a") as f:
            _create(f, dataset, a)
    group.barrier()
    for r in range(group.size):   # one rank at a time: serial HDF5 has no concurrent writers
        if group.rank == r:
            with h5py.File(path, "r+") as f:
                _write_mine(f[dataset], a)
        group.barrier()
    return "serial"
