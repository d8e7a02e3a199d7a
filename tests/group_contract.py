"""The Group contract: one pytest class every transport must pass (a test helper: it lives
under tests/, not in the library, because it needs pytest).

Subclass :class:`GroupContract` once per transport and give it a ``group``
fixture; the tests call every Group method and compare with values computed
from the rank numbers alone, at any group size, asserting collectively
(``parallel_assert``), so every rank reaches the same verdict::

    class TestMyTransport(GroupContract):
        @pytest.fixture
        def group(self):
            return comm.init("mytransport")

Capability flags say what a transport cannot do; the tests then check that
it refuses clearly instead of skipping silently.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcmac.comm.base import Group
from hpcmac.testing import parallel_allclose, parallel_assert

DTYPES = [np.float64, np.float32, np.int32, np.int64, np.uint8, np.complex128, np.bool_]


def value(rank: int, shape=(5,), dtype=np.float64, salt: int = 0) -> np.ndarray:
    """A rank's test data: small integers (exact in every dtype), distinct per rank and salt."""
    n = int(np.prod(shape))
    base = (np.arange(n) * 3 + rank * 7 + salt) % 11
    if np.dtype(dtype) == np.bool_:
        out = (base % 2).astype(np.bool_)
    elif np.dtype(dtype).kind == "c":
        out = (base + 1j * (base % 5 - rank)).astype(dtype)
    else:
        out = base.astype(dtype)
    return out.reshape(shape)


def strided(arr: np.ndarray) -> np.ndarray:
    """A non-contiguous view holding ``arr``'s values (every other element of a bigger array)."""
    big = np.zeros((*arr.shape[:-1], 2 * arr.shape[-1]), dtype=arr.dtype)
    view = big[..., ::2]
    view[...] = arr
    return view


class GroupContract:
    """Every Group call against values computed from rank numbers."""

    #: the transport name the group must report
    transport = "?"
    #: point-to-point between any two ranks (False: ring neighbours only)
    any_peer = True
    #: message tags are honoured (False: one ordered stream per peer)
    tags = True
    #: split into arbitrary sub-groups (False: only whole group or single ranks)
    any_split = True

    @pytest.fixture
    def group(self) -> Group:  # pragma: no cover - subclasses provide it
        raise NotImplementedError("subclass GroupContract and give it a group fixture")

    # -- basics ---------------------------------------------------------------
    def test_rank_size_and_name(self, group):
        ranks = group.allgather_obj(group.rank)
        parallel_assert(ranks == list(range(group.size)), f"ranks {ranks}", group)
        parallel_assert(group.transport == self.transport,
                        f"transport {group.transport!r}, expected {self.transport!r}", group)

    def test_barrier(self, group):
        for _ in range(3):
            group.barrier()
        parallel_assert(True, "", group)

    # -- point to point -------------------------------------------------------
    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
    def test_ring_shift_nonblocking(self, group, dtype):
        right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        got = np.empty((2, 3), dtype=dtype)
        rreq = group.irecv(got, left)
        sreq = group.isend(value(group.rank, (2, 3), dtype), right)
        sreq.wait()
        rreq.wait()
        parallel_assert(rreq.test() and sreq.test(), "requests not complete after wait", group)
        parallel_assert(np.array_equal(got, value(left, (2, 3), dtype)), f"got {got}", group)

    def test_blocking_pairs(self, group):
        # even ranks send to the odd rank above, which answers with twice the data
        partner = group.rank + 1 if group.rank % 2 == 0 else group.rank - 1
        ok = True
        if partner < group.size:
            if group.rank % 2 == 0:
                group.send(value(group.rank, (4,)), partner, tag=0)
                back = group.recv(np.empty(4), partner, tag=0)
                ok = np.array_equal(back, 2 * value(group.rank, (4,)))
            else:
                got = group.recv(np.empty(4), partner, tag=0)
                ok = np.array_equal(got, value(partner, (4,)))
                group.send(2 * got, partner, tag=0)
        parallel_assert(ok, "pairwise exchange gave wrong data", group)

    def test_all_pairs(self, group):
        peers = [p for p in range(group.size) if p != group.rank]
        if not self.any_peer:
            near = {(group.rank + 1) % group.size, (group.rank - 1) % group.size}
            peers = [p for p in peers if p in near]
        bufs = {p: np.empty(6, dtype=np.int64) for p in peers}
        reqs = [group.irecv(bufs[p], p) for p in peers]
        mine = [value(group.rank * 100 + p, (6,), np.int64) for p in peers]
        reqs += [group.isend(m, p) for m, p in zip(mine, peers)]
        group.waitall(reqs)
        ok = all(np.array_equal(bufs[p], value(p * 100 + group.rank, (6,), np.int64))
                 for p in peers)
        parallel_assert(ok, "all-pairs exchange gave wrong data", group)

    def test_non_neighbour_refused_without_any_peer(self, group):
        if self.any_peer or group.size < 4:
            pytest.skip("every peer is reachable here")
        far = (group.rank + 2) % group.size
        with pytest.raises(ValueError, match="neighbour"):
            group.isend(np.zeros(1), far)
        parallel_assert(True, "", group)

    def test_tags_match_out_of_order(self, group):
        right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        if not self.tags:
            with pytest.raises(ValueError, match="no message tags"):
                group.isend(np.zeros(1), right, tag=1)
            parallel_assert(True, "", group)
            return
        right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        a, b = np.empty(3), np.empty(3)
        rb = group.irecv(b, left, tag=2)
        ra = group.irecv(a, left, tag=1)
        s1 = group.isend(value(group.rank, (3,), salt=1), right, tag=1)
        s2 = group.isend(value(group.rank, (3,), salt=2), right, tag=2)
        for r in (ra, rb, s1, s2):
            r.wait()
        ok = (np.array_equal(a, value(left, (3,), salt=1))
              and np.array_equal(b, value(left, (3,), salt=2)))
        parallel_assert(ok, f"tagged messages crossed: {a} {b}", group)

    def test_p2p_noncontiguous_and_empty(self, group):
        right, left = (group.rank + 1) % group.size, (group.rank - 1) % group.size
        dst = strided(np.zeros((3, 4)))
        src = strided(value(group.rank, (3, 4)))
        r = group.irecv(dst, left)
        s = group.isend(src, right)
        s.wait()
        r.wait()
        empty = np.empty((0, 3))
        r0 = group.irecv(empty, left)
        s0 = group.isend(np.zeros((0, 3)), right)
        s0.wait()
        r0.wait()
        parallel_assert(np.array_equal(dst, value(left, (3, 4))), f"strided recv got {dst}", group)

    # -- collectives ----------------------------------------------------------
    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
    def test_bcast_every_root(self, group, dtype):
        for root in range(group.size):
            buf = value(group.rank, (4, 3), dtype, salt=root)
            out = group.bcast(buf, root)
            expect = value(root, (4, 3), dtype, salt=root)
            ok = out is buf and np.array_equal(buf, expect)
            parallel_assert(ok, f"root {root}: {buf}", group)

    def test_bcast_shapes(self, group):
        root = group.size - 1
        scalar = np.array(float(group.rank))
        group.bcast(scalar, root)
        empty = np.empty((0, 4))
        group.bcast(empty, root)
        dst = strided(value(group.rank, (2, 5)))
        group.bcast(dst, root)
        neg = np.array([-0.0, np.inf, -np.inf]) if group.rank == root else np.zeros(3)
        group.bcast(neg, root)
        ok = (float(scalar) == root and np.array_equal(dst, value(root, (2, 5)))
              and np.signbit(neg[0]) and np.array_equal(neg[1:], [np.inf, -np.inf]))
        parallel_assert(ok, f"scalar {scalar}, strided {dst}, specials {neg}", group)

    @pytest.mark.parametrize("op", ["sum", "max", "min"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
    def test_allreduce(self, group, op, dtype):
        if np.dtype(dtype).kind == "c" and op != "sum":
            pytest.skip("max/min of complex numbers is undefined")
        rows = np.stack([value(r, (3, 4), dtype) for r in range(group.size)])
        if np.dtype(dtype) == np.bool_:
            expect = {"sum": rows.any(0), "max": rows.any(0), "min": rows.all(0)}[op]
        else:
            expect = {"sum": rows.sum(0), "max": rows.max(0), "min": rows.min(0)}[op].astype(dtype)
        mine = value(group.rank, (3, 4), dtype)
        fresh = group.allreduce(mine, op)
        sep = np.empty_like(mine)
        group.allreduce(mine, op, out=sep)
        inplace = mine.copy()
        group.allreduce(inplace, op, out=inplace)
        ok = all(np.array_equal(x, expect) for x in (fresh, sep, inplace))
        parallel_assert(ok and fresh.dtype == np.dtype(dtype) and np.array_equal(
            mine, value(group.rank, (3, 4), dtype)), f"{op}: {fresh} vs {expect}", group)

    def test_allreduce_shapes(self, group):
        total = sum(range(group.size))
        scalar = group.allreduce(np.array(float(group.rank)))
        empty = group.allreduce(np.empty((0, 2)))
        src = strided(np.full((2, 3), float(group.rank)))
        out = strided(np.zeros((2, 3)))
        group.allreduce(src, "sum", out=out)
        parallel_allclose(scalar, total, msg="0-d", group=group)
        parallel_assert(empty.shape == (0, 2), f"empty gave {empty.shape}", group)
        parallel_allclose(out, np.full((2, 3), float(total)), msg="strided", group=group)

    def test_allreduce_rejects_unknown_op(self, group):
        with pytest.raises(ValueError, match="sum, max, min"):
            group.allreduce(np.zeros(2), op="prod")
        parallel_assert(True, "", group)

    def test_allreduce_maxloc(self, group):
        # |value| 5 on the last two ranks (if there are two), ties broken to the smaller index
        def pair(r):
            mag = 5.0 if r >= group.size - 2 else float(r % 3)
            return (-mag if r % 2 else mag), 100 - r

        v, i = pair(group.rank)
        got = group.allreduce_maxloc(v, i)
        pairs = [pair(r) for r in range(group.size)]
        expect = min(pairs, key=lambda p: (-abs(p[0]), p[1]))
        parallel_assert(got == expect and isinstance(got[1], int), f"{got} vs {expect}", group)

    @pytest.mark.parametrize("shape", [(), (3,), (2, 3), (0,), (0, 2)], ids=str)
    @pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex128, np.bool_],
                             ids=lambda d: np.dtype(d).name)
    def test_allgather(self, group, shape, dtype):
        got = group.allgather(value(group.rank, shape, dtype))
        expect = np.stack([value(r, shape, dtype) for r in range(group.size)])
        parallel_assert(got.shape == (group.size, *shape) and got.dtype == np.dtype(dtype)
                        and np.array_equal(got, expect), f"{got} vs {expect}", group)

    def test_allgather_noncontiguous_and_out(self, group):
        src = strided(value(group.rank, (2, 3)))
        out = np.empty((group.size, 2, 3))
        got = group.allgather(src, out=out)
        expect = np.stack([value(r, (2, 3)) for r in range(group.size)])
        parallel_assert(got is out and np.array_equal(out, expect), f"{out}", group)

    @pytest.mark.parametrize("op", ["sum", "max", "min"])
    def test_reduce_scatter(self, group, op):
        def mine(r):
            return np.stack([value(r, (2, 2), np.int64, salt=b) for b in range(group.size)])

        allr = np.stack([mine(r) for r in range(group.size)])
        expect = {"sum": allr.sum(0), "max": allr.max(0), "min": allr.min(0)}[op][group.rank]
        got = group.reduce_scatter(mine(group.rank), op)
        ok = got.shape == (2, 2) and np.array_equal(got, expect)
        parallel_assert(ok, f"{got} vs {expect}", group)

    def test_reduce_scatter_rejects_wrong_leading_dim(self, group):
        with pytest.raises(ValueError, match="leading dimension"):
            group.reduce_scatter(np.zeros((group.size + 1, 2)))
        parallel_assert(True, "", group)

    # -- sub-groups -----------------------------------------------------------
    def test_split_even_odd_reversed(self, group):
        color = group.rank % 2
        members = [r for r in range(group.size) if r % 2 == color]
        trivial = len(members) in (1, group.size)
        if not self.any_split and not trivial:
            with pytest.raises(NotImplementedError, match="sub-groups"):
                group.split(color, key=-group.rank)
            parallel_assert(True, "", group)
            return
        sub = group.split(color, key=-group.rank)
        order = sorted(members, reverse=True)  # key -rank: the highest world rank comes first
        ok = sub.size == len(members) and sub.rank == order.index(group.rank)
        total = sub.allreduce(np.array([group.rank], dtype=np.int64))
        seen = sub.allgather_obj(group.rank)
        ok = ok and int(total[0]) == sum(members) and seen == order
        parallel_assert(ok, f"sub {sub.rank}/{sub.size}, total {total}, order {seen}", group)

    def test_split_whole_and_single(self, group):
        whole = group.split(0, key=group.rank)
        single = group.split(group.rank, key=0)
        s = whole.allreduce(np.array([1.0]))
        one = single.allreduce(np.array([float(group.rank)]))
        ok = (whole.size == group.size and whole.rank == group.rank and s[0] == group.size
              and single.size == 1 and single.rank == 0 and one[0] == group.rank)
        parallel_assert(ok, f"whole {whole.rank}/{whole.size}, single {single.size}", group)

    # -- objects --------------------------------------------------------------
    def test_objects(self, group):
        for root in range(group.size):
            obj = {"root": root, "rank": group.rank, "data": list(range(group.rank))}
            got = group.bcast_obj(obj if group.rank == root else None, root)
            parallel_assert(got == {"root": root, "rank": root, "data": list(range(root))},
                            f"bcast_obj from {root}: {got}", group)
        seen = group.allgather_obj(("r", group.rank, "x" * group.rank))
        parallel_assert(seen == [("r", r, "x" * r) for r in range(group.size)], f"{seen}", group)
