"""Arithmetic on DistMatrix as numpy does it: ``@``, ``+``, ``-``, ``*``, ``/``, unary ``-``.

Elementwise operations need no communication when both operands share a
layout: each rank combines its own pieces. The other operand may be a scalar,
a DistMatrix of the same global shape on the same grid (moved to the left
operand's layout first when its blocks differ: one all-to-all), or an ndarray
(the same on every rank) that broadcasts to the global shape, of which each
rank reads only its own entries. Result dtypes follow numpy's rules.

``a @ b`` of two DistMatrix is SUMMA (``matmul``); ``a @ x`` and ``x @ a``
with an ndarray ``x`` held whole on every rank give the ndarray product,
whole on every grid rank (one sum-allreduce of the result).
"""

from __future__ import annotations

import numbers
import operator

import numpy as np

from hpcmac.linalg.checks import require, same_grid
from hpcmac.linalg.distmatrix import DistMatrix

OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
       "truediv": operator.truediv}


def _piece(a: DistMatrix, other, what: str):
    """``other``'s entries at ``a``'s local positions (a scalar stays a scalar); None when
    ``other`` is not an operand we know (the operator then returns NotImplemented)."""
    if isinstance(other, DistMatrix):
        same_grid(what, a, other)
        require(other.gshape == a.gshape,
                f"{what}: operands could not be broadcast together with shapes "
                f"{a.gshape} {other.gshape}")
        if (other.mb, other.nb) != (a.mb, a.nb):
            other = other.redistribute(a.grid, a.mb, a.nb)
        return other.local
    if isinstance(other, numbers.Number) or (isinstance(other, np.generic)):
        return other
    if isinstance(other, (np.ndarray, list, tuple)):
        arr = np.asarray(other)
        if arr.ndim == 0:
            return arr[()]
        try:
            ok = np.broadcast_shapes(arr.shape, a.gshape) == tuple(a.gshape)
        except ValueError:
            ok = False
        require(ok, f"{what}: operands could not be broadcast together with shapes "
                    f"{a.gshape} {arr.shape}")
        full = np.broadcast_to(arr, a.gshape)
        return full[np.ix_(a.rows, a.cols)]
    return None


def elementwise(a: DistMatrix, other, name: str, reflected: bool = False):
    """Collective only when ``other`` is a DistMatrix in another layout: ``a <op> other``
    (``other <op> a`` when ``reflected``) as a DistMatrix in ``a``'s layout."""
    if not a.grid.in_grid:   # ranks outside the grid hold nothing (and may not know shapes)
        return a.copy()
    piece = _piece(a, other, name)
    if piece is None:
        return NotImplemented
    op = OPS[name]
    local = op(piece, a.local) if reflected else op(a.local, piece)
    local = np.asfortranarray(np.asarray(local).reshape(a.lshape))
    return DistMatrix(local, a.gshape, a.mb, a.nb, a.grid)


def matmul_dense(a: DistMatrix, x, reflected: bool = False):
    """Collective over the grid: ``a @ x`` (``x @ a`` when ``reflected``) for an ndarray
    ``x`` held whole on every rank; the ndarray result whole on every grid rank."""
    if not a.grid.in_grid:
        return None
    x = np.asarray(x)
    require(x.ndim in (1, 2), f"matmul: expected a 1-D or 2-D array, got shape {x.shape}")
    m, n = a.gshape
    if not reflected:
        require(x.shape[0] == n, f"matmul: shapes {a.gshape} and {x.shape} not aligned: "
                                 f"{n} (dim 1) != {x.shape[0]} (dim 0)")
        x2 = x.reshape(n, -1)
        out = np.zeros((m, x2.shape[1]), dtype=np.result_type(a.dtype, x.dtype))
        if a.local.size:
            out[a.rows] = a.local @ x2[a.cols]
    else:
        require(x.shape[-1] == m, f"matmul: shapes {x.shape} and {a.gshape} not aligned: "
                                  f"{x.shape[-1]} (dim {x.ndim - 1}) != {m} (dim 0)")
        x2 = x.reshape(-1, m)
        out = np.zeros((x2.shape[0], n), dtype=np.result_type(a.dtype, x.dtype))
        if a.local.size:
            out[:, a.cols] = x2[:, a.rows] @ a.local
    if a.grid.all.size > 1:
        a.grid.all.allreduce(out, out=out)
    if x.ndim == 1:
        return out.reshape(-1)
    return out
