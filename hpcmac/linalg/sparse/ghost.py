"""The ghost exchange of a distributed sparse matrix, planned once (PETSc's VecScatter).

Rank r needs ``x`` at its *ghost* columns: the columns its rows touch that
other ranks own. The plan records, for each neighbour, which entries cross:
ghosts are sorted, so the ones owned by one rank are a contiguous slice of the
ghost buffer, and the sender keeps the local indices it must pack. Only
neighbours exchange; a rank with nothing to send or receive posts nothing.

Collective to build (every rank of ``group``); ``start``/``finish`` are
collective among neighbours only (non-blocking ``isend``/``irecv`` through
``hpcmac.comm``, so the caller computes in between).
"""

from __future__ import annotations

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.linalg.sparse import rows as rowpart

TAG_PLAN, TAG_FORWARD, TAG_REVERSE, TAG_ROWS = 7301, 7302, 7303, 7304


class GhostPlan:
    """Who sends what to whom. All fields are local to this rank.

    ``recv``: list of (rank, start, stop) slices of the ghost buffer;
    ``send``: list of (rank, local indices into this rank's piece of x).
    """

    def __init__(self, ghosts: np.ndarray, col_starts, group: Group):
        self.group = group
        self.ghosts = np.asarray(ghosts, dtype=np.int64)
        size, me = group.size, group.rank
        owner = rowpart.owners(col_starts, self.ghosts)
        bounds = np.searchsorted(owner, np.arange(size + 1), side="left")
        need = np.diff(bounds).astype(np.int64)                    # (size,) ghosts from each rank
        table = group.allgather(need)                              # [r, s]: r needs from s
        self.recv = [(int(s), int(bounds[s]), int(bounds[s + 1])) for s in range(size)
                     if need[s] and s != me]
        reqs, asked = [], []
        for s, a, b in self.recv:
            reqs.append(group.isend(self.ghosts[a:b], s, TAG_PLAN))
        for r in range(size):
            k = int(table[r, me])
            if k and r != me:
                buf = np.empty(k, dtype=np.int64)
                asked.append((r, buf))
                reqs.append(group.irecv(buf, r, TAG_PLAN))
        group.waitall(reqs)
        c0 = int(col_starts[me])
        self.send = [(r, (buf - c0).astype(np.intp)) for r, buf in asked]
        self.nghost = int(self.ghosts.size)
        self._sendbufs: dict = {}

    @property
    def empty(self) -> bool:
        return not self.recv and not self.send

    def _buffers(self, dtype) -> list[np.ndarray]:
        bufs = self._sendbufs.get(dtype)
        if bufs is None:
            bufs = [np.empty(idx.size, dtype=dtype) for _, idx in self.send]
            self._sendbufs[dtype] = bufs
        return bufs

    def start(self, x_local: np.ndarray, ghost_buf: np.ndarray) -> list:
        """Post the receives into ``ghost_buf`` and the sends of ``x_local``'s needed entries."""
        g = self.group
        reqs = [g.irecv(ghost_buf[a:b], s, TAG_FORWARD) for s, a, b in self.recv]
        for (r, idx), buf in zip(self.send, self._buffers(x_local.dtype)):
            np.take(x_local, idx, out=buf)
            reqs.append(g.isend(buf, r, TAG_FORWARD))
        return reqs

    def finish(self, reqs: list) -> None:
        if reqs:
            self.group.waitall(reqs)

    def reverse_start(self, ghost_vals: np.ndarray) -> tuple[list, list]:
        """Send ghost contributions back to their owners (the transpose of ``start``)."""
        g = self.group
        reqs = [g.isend(np.ascontiguousarray(ghost_vals[a:b]), s, TAG_REVERSE)
                for s, a, b in self.recv]
        incoming = []
        for (r, idx), buf in zip(self.send, self._buffers(ghost_vals.dtype)):
            incoming.append((idx, buf))
            reqs.append(g.irecv(buf, r, TAG_REVERSE))
        return reqs, incoming

    def reverse_finish(self, pending: tuple[list, list], y_local: np.ndarray) -> None:
        """Wait, then add what neighbours sent into ``y_local`` (indices unique per sender)."""
        reqs, incoming = pending
        if reqs:
            self.group.waitall(reqs)
        for idx, buf in incoming:
            y_local[idx] += buf

    def fetch_rows(self, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray):
        """Collective among neighbours: the CSR rows of the ghost indices from their owners.

        The arguments are this rank's own rows (global column indices) of a
        matrix partitioned like the columns; returns (indptr, indices, data)
        of the ghost rows, in ghost order.
        """
        g = self.group
        lens = np.diff(indptr).astype(np.int64)
        got = [np.empty(b - a, dtype=np.int64) for _, a, b in self.recv]
        reqs = [g.irecv(buf, s, TAG_ROWS) for (s, _, _), buf in zip(self.recv, got)]
        keep = []
        for r, idx in self.send:
            part = np.ascontiguousarray(lens[idx])
            keep.append(part)
            reqs.append(g.isend(part, r, TAG_ROWS))
        g.waitall(reqs)
        out_lens = np.concatenate(got) if got else np.zeros(0, dtype=np.int64)
        out_ptr = np.concatenate([[0], np.cumsum(out_lens)]).astype(np.int64)
        out_ind = np.empty(int(out_ptr[-1]), dtype=np.int64)
        out_dat = np.empty(int(out_ptr[-1]), dtype=data.dtype)
        reqs, keep = [], []
        for s, a, b in self.recv:
            lo, hi = int(out_ptr[a]), int(out_ptr[b])
            reqs += [g.irecv(out_ind[lo:hi], s, TAG_ROWS + 1),
                     g.irecv(out_dat[lo:hi], s, TAG_ROWS + 2)]
        for r, idx in self.send:
            sel = row_entries(indptr, idx)
            ind = np.ascontiguousarray(indices[sel], dtype=np.int64)
            dat = np.ascontiguousarray(data[sel])
            keep += [ind, dat]
            reqs += [g.isend(ind, r, TAG_ROWS + 1), g.isend(dat, r, TAG_ROWS + 2)]
        g.waitall(reqs)
        return out_ptr, out_ind, out_dat


def row_entries(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions in ``indices``/``data`` of the entries of ``rows``, row after row. Pure."""
    first = np.asarray(indptr, dtype=np.int64)[rows]
    lens = np.asarray(indptr, dtype=np.int64)[np.asarray(rows) + 1] - first
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(first - (np.cumsum(lens) - lens), lens)
    return shift + np.arange(total, dtype=np.int64)
