"""Row interchanges of a factored panel applied to other columns, down a process column.

After panel ``j`` is factored, its pivots ``ipiv`` (global rows, LAPACK order:
swap row ``j+k`` with ``ipiv[k]`` for k = 0, 1, ...) must be applied to the
columns outside the panel. With more than one process row the rows live on
different processes. As in netlib HPL (HPL_pdlaswp*), the swapped diagonal
block rows, ``U``, are assembled on *every* process of the column (each then
solves with L1 and updates its own rows), and the displaced rows travel from
the diagonal block's owner to their new owners. ``U`` is assembled by

* ``"binexch"`` binary exchange: recursive doubling over the process rows,
  each step swapping all the rows gathered so far with a partner;
* ``"spread"``  spread-roll: the rows are first spread evenly over the
  process rows (with ``equil``; otherwise each keeps the rows it owns) and
  then rolled round a ring, P - 1 steps;
* ``"mix"``     binary exchange when the local number of columns is at most
  ``threshold``, spread-roll above it (netlib's SWAP=2).

Collective over the grid's column group (every process of the process column
calls it with the same global arguments; the local column range ``c0:c1`` has
the same width on all of them, as they share a process column).
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg import layout

VARIANTS = ("binexch", "spread", "mix")
_TAG = 4100


def pivot_moves(j: int, jb: int, ipiv) -> tuple[list[int], list[tuple[int, int]]]:
    """Pure: what the sequential swaps do to rows.

    Returns ``usrc`` (global source row of each of the ``jb`` diagonal-block
    rows after the swaps) and ``outs``: (destination, source) global row pairs
    for rows below the block that receive a (diagonal-block) row.
    """
    perm: dict[int, int] = {}
    for k in range(jb):
        p, q = j + k, int(ipiv[k])
        if p != q:
            perm[p], perm[q] = perm.get(q, q), perm.get(p, p)
    usrc = [perm.get(j + k, j + k) for k in range(jb)]
    outs = sorted((d, s) for d, s in perm.items() if d >= j + jb and d != s)
    return usrc, outs


def _exchange(group, U, mine: list[int], peer: int, theirs: list[int], tag: int) -> None:
    """Send U's rows ``mine`` to ``peer`` while receiving its rows ``theirs``."""
    req = None
    if mine:
        out = np.ascontiguousarray(U[mine])
        req = group.isend(out, peer, tag)
    if theirs:
        inc = np.empty((len(theirs), U.shape[1]), dtype=U.dtype)
        group.recv(inc, peer, tag)
        U[theirs] = inc
    if req is not None:
        req.wait()


def _binexch(group, U, owner_of: list[int]) -> None:
    p, me = group.size, group.rank
    have = [{k for k, o in enumerate(owner_of) if o == r} for r in range(p)]
    p2 = 1
    while p2 * 2 <= p:
        p2 *= 2
    if me >= p2:  # fold the extra process rows into the first p2
        _exchange(group, U, sorted(have[me]), me - p2, [], _TAG)
    elif me + p2 < p:
        _exchange(group, U, [], me + p2, sorted(have[me + p2]), _TAG)
    for r in range(p2, p):
        have[r - p2] |= have[r]
    d = 1
    while d < p2:
        if me < p2:
            partner = me ^ d
            _exchange(group, U, sorted(have[me]), partner, sorted(have[partner]), _TAG + d)
        have = [have[r] | have[r ^ d] if r < p2 else have[r] for r in range(p)]
        d *= 2
    everything = list(range(U.shape[0]))
    if me + p2 < p:
        _exchange(group, U, everything, me + p2, [], _TAG + 99)
    elif me >= p2:
        _exchange(group, U, [], me - p2, everything, _TAG + 99)


def _spread_roll(group, U, owner_of: list[int], equil: bool) -> None:
    p, me = group.size, group.rank
    sets = [[k for k, o in enumerate(owner_of) if o == r] for r in range(p)]
    if equil:  # spread: move rows so every process row rolls about jb / p of them
        jb = len(owner_of)
        want = [jb * r // p for r in range(p + 1)]
        target = [[k for k in range(want[r], want[r + 1])] for r in range(p)]
        # row k goes from its owner to the process row whose slice holds it
        holder = {k: r for r in range(p) for k in target[r]}
        sends = {r: [k for k in sets[me] if holder[k] == r] for r in range(p) if r != me}
        recvs = {r: [k for k in sets[r] if holder[k] == me] for r in range(p) if r != me}
        reqs, keep = [], []
        for r, rows in sends.items():
            if rows:
                buf = np.ascontiguousarray(U[rows])
                keep.append(buf)
                reqs.append(group.isend(buf, r, _TAG + 200))
        for r, rows in recvs.items():
            if rows:
                inc = np.empty((len(rows), U.shape[1]), dtype=U.dtype)
                group.recv(inc, r, _TAG + 200)
                U[rows] = inc
        for q in reqs:
            q.wait()
        sets = target
    nxt, prv = (me + 1) % p, (me - 1) % p
    for s in range(p - 1):
        mine, theirs = sets[(me - s) % p], sets[(me - s - 1) % p]
        req = None
        if mine:
            out = np.ascontiguousarray(U[mine])
            req = group.isend(out, nxt, _TAG + 300 + s)
        if theirs:
            inc = np.empty((len(theirs), U.shape[1]), dtype=U.dtype)
            group.recv(inc, prv, _TAG + 300 + s)
            U[theirs] = inc
        if req is not None:
            req.wait()


def swap_column(a: np.ndarray, grid, nb: int, j: int, jb: int, ipiv, c0: int, c1: int,
                variant: str = "mix", threshold: int = 64, equil: bool = True,
                write_u: bool = True) -> np.ndarray:
    """Apply panel ``j``'s interchanges to local columns ``c0:c1`` of ``a`` (P > 1).

    ``a`` is this rank's local piece (Fortran order); ``j``, ``jb``, ``ipiv``,
    ``variant``, ``threshold``, ``equil`` are global. Rows displaced from the
    diagonal block are written to their new owners; the diagonal block's
    owner also gets ``U`` written into its rows when ``write_u``. Returns
    ``U`` (jb, c1 - c0), C order (so its Fortran reading is U transposed),
    the same on every process of the column. Collective over ``grid.col``.
    """
    group = grid.col
    p, me = grid.nprow, grid.myrow
    nc = c1 - c0
    U = np.empty((jb, nc), dtype=a.dtype)
    if nc <= 0:
        return U
    usrc, outs = pivot_moves(j, jb, ipiv)
    top = layout.owner(j, nb, p)
    owner_of = [int(layout.owner(s, nb, p)) for s in usrc]
    # read every source before any row is overwritten
    mine = [k for k in range(jb) if owner_of[k] == me]
    if mine:
        U[mine] = a[layout.g2l(np.array([usrc[k] for k in mine]), nb, p), c0:c1]
    dest_owner = [int(layout.owner(d, nb, p)) for d, _ in outs]
    reqs, keep, local_outs = [], [], None
    if me == top and outs:
        for r in range(p):
            rows = [s for (d, s), o in zip(outs, dest_owner) if o == r]
            if not rows:
                continue
            block = a[layout.g2l(np.array(rows), nb, p), c0:c1]
            if r == me:
                local_outs = block
            else:
                buf = np.ascontiguousarray(block)
                keep.append(buf)
                reqs.append(group.isend(buf, r, _TAG + 500))
    if variant == "mix":
        variant = "binexch" if nc <= threshold else "spread"
    if variant == "binexch":
        _binexch(group, U, owner_of)
    elif variant == "spread":
        _spread_roll(group, U, owner_of, equil)
    else:
        raise ValueError(f"swap must be one of {', '.join(VARIANTS)}, got {variant!r}")
    my_dests = [d for (d, _), o in zip(outs, dest_owner) if o == me]
    if my_dests:
        if me == top:
            rows = local_outs
        else:
            rows = np.empty((len(my_dests), nc), dtype=a.dtype)
            group.recv(rows, top, _TAG + 500)
        a[layout.g2l(np.array(my_dests), nb, p), c0:c1] = rows
    for q in reqs:
        q.wait()
    if write_u and me == top:
        i0 = int(layout.g2l(j, nb, p))
        a[i0:i0 + jb, c0:c1] = U
    return U
