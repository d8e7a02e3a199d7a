"""DistCSR from and to files: MatrixMarket and HDF5 (CSR arrays).

* MatrixMarket: ``scipy.io.mmread`` on one rank, then the rows are sent
  (``root=0``), or, for the coordinate format, every rank parses its own
  share of the entry lines and ``assemble`` moves them (``root=None``).
* HDF5: a group holding ``indptr``, ``indices``, ``data`` and the attribute
  ``shape`` (scipy's CSR arrays, readable by h5py alone). Each rank reads
  ``indptr``, takes its rows (balanced by nonzeros), and reads only their
  slices of ``indices`` and ``data``. Writing: rank 0 creates the datasets,
  then the ranks write their slices in turn.

A missing or malformed file raises one ``UsageError`` line naming the file,
the same on every rank. All functions are collective.
"""

from __future__ import annotations

import os

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.errors import UsageError
from hpcmac.linalg.sparse import rows as rowpart
from hpcmac.linalg.sparse.build import assemble, from_scipy
from hpcmac.linalg.sparse.distcsr import DistCSR


def _agree_usage(group: Group, message: str | None) -> None:
    msgs = group.allgather_obj(message)
    first = next((m for m in msgs if m), None)
    if first:
        raise UsageError(first)


def _mm_header(path: str) -> tuple[dict, int]:
    """(banner fields and sizes, byte offset of the first entry line). Pure but for the read."""
    with open(path, "rb") as f:
        banner = f.readline().decode("ascii", "replace").split()
        if len(banner) != 5 or banner[0].lower() != "%%matrixmarket":
            raise UsageError(f"{path}:1: expected a '%%MatrixMarket matrix ...' banner")
        _, obj, fmt, field, symm = (w.lower() for w in banner)
        line = f.readline()
        lineno = 2
        while line.startswith(b"%") or not line.strip():
            if not line:
                raise UsageError(f"{path}: no size line")
            line, lineno = f.readline(), lineno + 1
        try:
            sizes = [int(v) for v in line.split()]
        except ValueError:
            raise UsageError(f"{path}:{lineno}: expected the size line 'rows cols entries'") \
                from None
        return {"object": obj, "format": fmt, "field": field, "symmetry": symm,
                "sizes": sizes, "line": lineno}, f.tell()


def mmread(path: str, group: Group, root: int | None = 0, row_starts=None) -> DistCSR:
    """Collective: a MatrixMarket file as a DistCSR.

    ``root=0``: rank 0 reads it with ``scipy.io.mmread``; ``root=None``: each
    rank parses a contiguous share of the entry lines (coordinate format only).
    """
    msg, head = None, None
    try:
        head, offset = _mm_header(path)
        if root is None and head["format"] != "coordinate":
            msg = f"{path}: parallel reading needs the coordinate format, found {head['format']}"
        elif head["field"] not in ("real", "integer", "pattern", "complex"):
            msg = f"{path}:1: unsupported field {head['field']!r}"
    except OSError as exc:
        msg = f"{path}: cannot read ({exc.strerror or exc})"
    except UsageError as exc:
        msg = str(exc)
    _agree_usage(group, msg)
    if root is not None:
        import scipy.io

        a = None
        if group.rank == root:
            try:
                a = scipy.io.mmread(path)
            except Exception as exc:  # noqa: BLE001 - scipy's parser errors vary
                msg = f"{path}: not a readable MatrixMarket file ({exc})"
        _agree_usage(group, msg)
        return from_scipy(a, group, root=root, row_starts=row_starts)
    m, n, nnz = head["sizes"][:3]
    size = os.path.getsize(path)
    lo = offset + (size - offset) * group.rank // group.size
    hi = offset + (size - offset) * (group.rank + 1) // group.size
    with open(path, "rb") as f:
        f.seek(max(lo - 1, 0))
        if lo > offset:  # start at the first line beginning inside [lo, hi)
            f.readline()
        start = f.tell()
        chunk = f.read(max(hi - start, 0))
        if chunk and not chunk.endswith(b"\n"):
            chunk += f.readline()
    ncol = {"pattern": 2, "complex": 4}.get(head["field"], 3)
    try:
        lines = [ln for ln in chunk.split(b"\n") if ln.strip() and not ln.startswith(b"%")]
        table = np.array(b" ".join(lines).split(), dtype=np.float64).reshape(-1, ncol) \
            if lines else np.zeros((0, ncol))
    except ValueError:
        msg = f"{path}: an entry line does not have {ncol} numbers"
        table = np.zeros((0, ncol))
    counts = group.allreduce(np.array([table.shape[0]], dtype=np.int64))[0]
    if msg is None and counts != nnz:
        msg = f"{path}:{head['line']}: the size line promises {nnz} entries, found {counts}"
    _agree_usage(group, msg)
    r = table[:, 0].astype(np.int64) - 1
    c = table[:, 1].astype(np.int64) - 1
    if head["field"] == "pattern":
        v = np.ones(r.size)
    elif head["field"] == "complex":
        v = table[:, 2] + 1j * table[:, 3]
    else:
        v = table[:, 2]
    if head["symmetry"] in ("symmetric", "hermitian", "skew-symmetric"):
        off = r != c
        mirror = {"symmetric": v[off], "hermitian": np.conj(v[off]),
                  "skew-symmetric": -v[off]}[head["symmetry"]]
        r, c, v = np.concatenate([r, c[off]]), np.concatenate([c, r[off]]), \
            np.concatenate([v, mirror])
    try:
        return assemble(r, c, v, (m, n), group, row_starts)
    except ValueError as exc:
        raise UsageError(f"{path}: {exc}") from None


def read_hdf5(path: str, group: Group, name: str = "A", row_starts=None) -> DistCSR:
    """Collective: the CSR arrays in HDF5 group ``name`` of ``path``, each rank its rows."""
    import h5py

    msg, indptr, shape = None, None, None
    try:
        with h5py.File(path, "r") as f:
            g = f[name]
            shape = tuple(int(v) for v in g.attrs["shape"])
            indptr = g["indptr"][...].astype(np.int64)
            if indptr.shape != (shape[0] + 1,):
                msg = f"{path}:{name}/indptr: expected {shape[0] + 1} entries, found {indptr.size}"
    except (OSError, KeyError) as exc:
        msg = f"{path}:{name}: cannot read the CSR arrays indptr, indices, data, attrs shape " \
              f"({exc})"
    _agree_usage(group, msg)
    rs = rowpart.check(row_starts, shape[0], group.size) if row_starts is not None else \
        rowpart.by_nonzeros(np.diff(indptr), group.size)
    lo, hi = rs[group.rank], rs[group.rank + 1]
    a, b = int(indptr[lo]), int(indptr[hi])
    with h5py.File(path, "r") as f:
        ind = f[name]["indices"][a:b].astype(np.int64)
        dat = f[name]["data"][a:b]
    import scipy.sparse as sp

    from hpcmac.linalg.sparse.build import from_rows

    local = sp.csr_matrix((dat, ind, indptr[lo: hi + 1] - a), shape=(hi - lo, shape[1]))
    return from_rows(local, group, ncols=shape[1])


def write_hdf5(a: DistCSR, path: str, name: str = "A") -> None:
    """Collective: write ``a`` as CSR arrays (rank 0 creates, then each rank its rows in turn)."""
    import h5py

    g = a.group
    local = a.local_rows()
    nnz = g.allgather_obj(local.nnz)
    first = int(sum(nnz[: g.rank]))
    if g.rank == 0:
        with h5py.File(path, "a") as f:
            if name in f:
                del f[name]
            grp = f.create_group(name)
            grp.attrs["shape"] = np.array(a.shape, dtype=np.int64)
            grp.create_dataset("indptr", shape=(a.shape[0] + 1,), dtype=np.int64)
            grp.create_dataset("indices", shape=(sum(nnz),), dtype=np.int64)
            grp.create_dataset("data", shape=(sum(nnz),), dtype=a.dtype)
    for r in range(g.size):
        g.barrier()
        if r == g.rank:
            lo, hi = a.lrange
            with h5py.File(path, "a") as f:
                grp = f[name]
                grp["indptr"][lo + (1 if lo else 0): hi + 1] = \
                    (local.indptr + first)[(1 if lo else 0):]
                grp["indices"][first: first + local.nnz] = local.indices
                grp["data"][first: first + local.nnz] = local.data
    g.barrier()
