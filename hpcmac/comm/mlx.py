"""MLX distributed transports: ``ring`` (TCP) and ``rdma`` (JACCL over Thunderbolt).

Two ways to start:

* under **mpirun** (the usual way): rank and size come from MPI, the MLX group
  is bootstrapped over MPI (ring: free ports exchanged by allgather, written
  to a hostfile; rdma: MPI's allgather is JACCL's side channel), and the MPI
  world stays alongside for what MLX lacks: sub-groups (``split``), tagged
  point-to-point, dtypes MLX has no type for, ``abort``;
* under **mlx.launch**: the launcher's environment (``MLX_RANK``,
  ``MLX_HOSTFILE`` or ``MLX_IBV_DEVICES``) is used directly and there is no
  MPI; point-to-point goes over MLX (ring: neighbours only), ``split`` works
  only when it yields the whole group or single ranks.

Data moves numpy -> ``mx.array`` (one copy in) -> MLX op on the CPU stream ->
numpy (one copy out). MLX's own ``mpi`` backend is never used: it calls
``MPI_Init`` itself and clashes with mpi4py.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import numpy as np

from hpcmac.comm import rdma_env, ring_env, wire
from hpcmac.comm.base import Group, Request, check_op, pick_maxloc

NAMES = ("ring", "rdma")
_BACKEND = {"ring": "ring", "rdma": "jaccl"}

# numpy dtypes MLX has a type for (float64 is CPU-only in MLX: we use the CPU stream)
_MLX_KINDS = {
    np.dtype(t)
    for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
              np.uint32, np.uint64, np.float16, np.float32, np.float64, np.complex64)
}


def _mx():
    import mlx.core as mx

    return mx


def is_available(name: str) -> tuple[bool, str]:
    """(usable here, reason if not) for ``name`` in ("ring", "rdma"); not collective.

    ``rdma`` needs mlx with JACCL (macOS 26.2+), RDMA enabled (``rdma_ctl``),
    an ``rdma_en*`` device and a device matrix.
    """
    if name not in NAMES:
        return False, f"{name}: not an MLX transport (expected one of {', '.join(NAMES)})"
    if name == "rdma" and sys.platform.startswith("linux"):
        # no Linux build of mlx has JACCL: say so without importing mlx (start-up time)
        return False, rdma_env.rdma_reason(sys.platform, False, None, None, None)
    try:
        mx = _mx()
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"{name}: mlx does not import ({type(exc).__name__}); install hpcmac[mlx]"
    backend = _BACKEND[name]
    try:
        has = bool(mx.distributed.is_available(backend))
    except Exception:
        has = False
    if name == "ring":
        return (True, "") if has else (False, "ring: this mlx build has no ring backend")
    reason = rdma_env.probe(has)
    if not reason and not _has_all_gather_factory(mx):
        reason = f"rdma: mlx {mx.__version__} is too old (needs >= 0.32.1 for all_gather_factory)"
    return (not reason), reason


def _has_all_gather_factory(mx) -> bool:
    return "all_gather_factory" in (mx.distributed.init.__doc__ or "")


def launched_by_mlx(env: dict[str, str] | None = None) -> str | None:
    """The MLX transport ``mlx.launch`` set up for this process, or None (not launched by it).

    mlx.launch exports ``MLX_RANK`` with ``MLX_HOSTFILE`` (ring) or
    ``MLX_IBV_DEVICES`` (jaccl); an MPI launcher's variables mean mpirun instead.
    """
    env = os.environ if env is None else env
    if any(v in env for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")):
        return None
    if "MLX_RANK" not in env:
        return None
    if env.get("MLX_IBV_DEVICES"):
        return "rdma"
    if "MLX_HOSTFILE" in env:
        return "ring"
    return None


# -- bootstrap -----------------------------------------------------------------

def init_group(name: str, world: Group | None, hostfile=None) -> MLXGroup:
    """Collective over ``world`` (an MPI group) or over the mlx.launch job when None.

    Builds the MLX ``name`` group ("ring" or "rdma") and returns it wrapped as
    a :class:`MLXGroup`, with ``world`` as the fallback for what MLX lacks.
    ``hostfile`` (global): the job's parsed hostfile; its links choose the ring's
    addresses.
    """
    mx = _mx()
    if world is None:
        group = mx.distributed.init(strict=True, backend=_BACKEND[name])
        return MLXGroup(group, name, None)
    if world.size == 1:  # nobody to connect to: MLX's singleton group (ops are copies)
        unset = {k: None for k in ("MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_RANK")}
        group = _with_env(unset, lambda: mx.distributed.init(strict=False, backend=_BACKEND[name]))
    elif name == "ring":
        group = _ring_over_mpi(mx, world, hostfile)
    else:
        group = _jaccl_over_mpi(mx, world)
    if group.size() != world.size or group.rank() != world.rank:
        raise RuntimeError(
            f"{name}: MLX group is rank {group.rank()} of {group.size()}, "
            f"MPI says {world.rank} of {world.size}"
        )
    return MLXGroup(group, name, world)


def _with_env(extra: dict[str, str | None], fn):
    """Call ``fn`` with ``extra`` set in os.environ (None: unset), then restore it."""
    saved = {k: os.environ.get(k) for k in extra}
    for k, v in extra.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ring_over_mpi(mx, world: Group, hf=None):
    import socket

    conns = int(os.environ.get("HPCMAC_RING_CONNECTIONS", "1"))
    hosts = world.allgather_obj(socket.gethostname())
    mine = ring_env.local_ipv4() if len(set(hosts)) > 1 else []
    ips = world.allgather_obj(mine)
    hf = hf if hf is not None and hf.links else None
    mesh = world.allgather_obj(ring_env.mesh_host(hf, mine) if hf is not None else None)
    ip = ring_env.listen_address(world.rank, hosts, ips, mesh, hf)
    mine = [f"{ip}:{ring_env.free_port(ip)}" for _ in range(conns)]
    text = ring_env.ring_hostfile(world.allgather_obj(mine))
    with tempfile.NamedTemporaryFile("w", prefix="hpcmac-ring-", suffix=".json",
                                     delete=False) as fh:
        fh.write(text)
    try:
        env = {"MLX_HOSTFILE": fh.name, "MLX_RANK": str(world.rank)}
        return _with_env(env, lambda: mx.distributed.init(strict=True, backend="ring"))
    finally:
        os.unlink(fh.name)


def mpi_all_gather_factory(comm):
    """JACCL's side channel over an mpi4py communicator.

    Returns ``factory(rank, size)`` -> ``all_gather(src: bytes, n_bytes) -> bytes``
    (every rank's ``n_bytes`` in rank order), the callable MLX's
    ``init(backend="jaccl", all_gather_factory=...)`` expects.
    """

    def factory(rank: int, size: int):
        if (rank, size) != (comm.Get_rank(), comm.Get_size()):
            raise RuntimeError(f"jaccl asks for rank {rank} of {size}, MPI has "
                               f"{comm.Get_rank()} of {comm.Get_size()}")

        def all_gather(src: bytes, n_bytes: int) -> bytes:
            out = bytearray(size * n_bytes)
            comm.Allgather(bytes(src[:n_bytes]), out)
            return bytes(out)

        return all_gather

    return factory


def rdma_matrix_problem(size: int, rank: int) -> tuple[list | None, str]:
    """(device matrix, '') when this rank's matrix fits ``size`` ranks, else (None, reason).

    Not collective: each rank reads its own ``HPCMAC_IBV_DEVICES``/``MLX_IBV_DEVICES``
    and checks it against this host's ``ibv_devices``.
    """
    spec = rdma_env.matrix_spec_from_env()
    if not spec:
        return None, "rdma: no device matrix (HPCMAC_IBV_DEVICES)"
    try:
        matrix = rdma_env.load_device_matrix(spec)
    except ValueError as exc:
        return None, f"rdma: {exc}"
    problem = rdma_env.check_device_matrix(matrix, size, rank, rdma_env.local_devices(),
                                           rdma_env.local_port_states())
    if not problem:
        problem = rdma_env.port_problem(rank, matrix[rank], rdma_env.local_ports())
    return (None, f"rdma: {problem}") if problem else (matrix, "")


def _jaccl_over_mpi(mx, world: Group):
    matrix, problem = rdma_matrix_problem(world.size, world.rank)
    problems = [p for p in world.allgather_obj(problem) if p]
    if problems:
        raise RuntimeError(problems[0])
    # its own communicator: a rank whose JACCL fails may reach the outcome check in
    # select.init_or_fallback while others are still inside JACCL's allgathers
    factory = mpi_all_gather_factory(world.comm.Dup())
    import json

    with tempfile.NamedTemporaryFile("w", prefix="hpcmac-ibv-", suffix=".json",
                                     delete=False) as fh:
        json.dump(matrix, fh)
    try:
        env = rdma_env.jaccl_env(world.rank, fh.name,
                                 ring=os.environ.get("HPCMAC_JACCL_RING", "0") == "1")
        return _with_env(env, lambda: mx.distributed.init(
            strict=True, backend="jaccl", all_gather_factory=factory))
    finally:
        os.unlink(fh.name)


# -- the group -----------------------------------------------------------------

class _MLXRequest(Request):
    __slots__ = ("_arr", "_buf", "_done")

    def __init__(self, arr, buf: np.ndarray | None):
        self._arr, self._buf, self._done = arr, buf, False

    def wait(self) -> None:
        if self._done:
            return
        _mx().eval(self._arr)
        if self._buf is not None:
            self._buf[...] = np.asarray(self._arr).reshape(self._buf.shape)
        self._done = True

    def test(self) -> bool:
        # MLX has no completion query: finishing the operation is the only answer
        self.wait()
        return True


class MLXGroup(Group):
    """A Group over an ``mx.distributed.Group`` (ring or jaccl).

    ``fallback`` is the MPI group over the same ranks in the same order (None
    under mlx.launch). Collectives run over MLX; ``split``, point-to-point and
    dtypes MLX has no type for (complex128, ...) go to ``fallback``.
    """

    def __init__(self, group, name: str, fallback: Group | None):
        mx = _mx()
        self.transport = name
        self._g = group
        self._mx = mx
        self._rank = group.rank()
        self._size = group.size()
        self._fallback = fallback
        self._stream = mx.cpu
        self._send_stream = mx.new_stream(mx.cpu) if fallback is None else None
        self._recv_stream = mx.new_stream(mx.cpu) if fallback is None else None
        self._ops = {"sum": mx.distributed.all_sum, "max": mx.distributed.all_max,
                     "min": mx.distributed.all_min}

    @property
    def native(self):
        """The ``mx.distributed.Group`` itself, for collectives inside an MLX graph (the
        LLM's tensor-parallel sums: :class:`hpcmac.llm.parallel.tensor.GraphSum`)."""
        return self._g

    @property
    def fallback(self) -> Group | None:
        """The MPI group used for what MLX lacks (None under mlx.launch)."""
        return self._fallback

    def fallback_note(self) -> str:
        """One phrase for the log: which calls do not run over MLX."""
        if self._fallback is not None:
            return "split, send/recv and non-MLX dtypes over mpi"
        if self.transport == "ring":
            return "no mpi: send/recv to ring neighbours only, split to whole/single ranks only"
        return "no mpi: split to whole/single ranks only"

    # -- helpers ------------------------------------------------------------
    def _arr(self, a: np.ndarray):
        """numpy -> mx.array, keeping the dtype (MLX would turn float64 into float32)."""
        return self._mx.array(a, dtype=_mx_dtype(self._mx, a.dtype))

    def _run(self, arr) -> np.ndarray:
        self._mx.eval(arr)
        return np.asarray(arr)

    def _native(self, dtype: np.dtype) -> bool:
        return dtype in _MLX_KINDS

    def _need_fallback(self, what: str) -> Group:
        if self._fallback is None:
            raise TypeError(f"{self.transport} without mpi: {what} is not supported by MLX")
        return self._fallback

    # -- point to point -----------------------------------------------------
    def _check_peer(self, peer: int, tag: int) -> None:
        if tag != 0:
            raise ValueError(f"{self.transport} without mpi: MLX has no message tags "
                             f"(tag {tag}); launch with mpirun for tagged messages")
        if not 0 <= peer < self._size:
            raise ValueError(f"peer {peer} is not a rank of a group of {self._size}")
        if self.transport == "ring" and self._size > 2 and peer not in (
                (self._rank + 1) % self._size, (self._rank - 1) % self._size):
            raise ValueError(
                f"ring without mpi: rank {self._rank} can only talk to its ring neighbours, "
                f"not {peer} (launch with mpirun for any-to-any)")

    def send(self, buf, dest, tag=0):
        if self._fallback is not None:
            return self._fallback.send(buf, dest, tag)
        self.isend(buf, dest, tag).wait()

    def recv(self, buf, source, tag=0):
        if self._fallback is not None:
            return self._fallback.recv(buf, source, tag)
        self.irecv(buf, source, tag).wait()
        return buf

    def isend(self, buf, dest, tag=0):
        if self._fallback is not None:
            return self._fallback.isend(buf, dest, tag)
        self._check_peer(dest, tag)
        buf = np.ascontiguousarray(buf)
        if not self._native(buf.dtype):
            buf = buf.view(np.uint8)
        if buf.size == 0:
            return _MLXRequest(self._mx.array(0), None)
        arr = self._mx.distributed.send(self._arr(buf), dest, group=self._g,
                                        stream=self._send_stream)
        self._mx.async_eval(arr)
        return _MLXRequest(arr, None)

    def irecv(self, buf, source, tag=0):
        if self._fallback is not None:
            return self._fallback.irecv(buf, source, tag)
        self._check_peer(source, tag)
        if buf.size == 0:
            return _MLXRequest(self._mx.array(0), None)
        if self._native(buf.dtype):
            shape, dtype, target = buf.shape, _mx_dtype(self._mx, buf.dtype), buf
        else:
            shape, dtype, target = (buf.nbytes,), self._mx.uint8, buf.view(np.uint8).reshape(-1)
        arr = self._mx.distributed.recv(shape, dtype, source, group=self._g,
                                        stream=self._recv_stream)
        self._mx.async_eval(arr)
        return _MLXRequest(arr, target)

    def waitall(self, requests):
        if self._fallback is not None:
            return self._fallback.waitall(requests)
        for req in requests:
            req.wait()

    # -- collectives ----------------------------------------------------------
    def bcast(self, buf, root=0):
        if not 0 <= root < self._size:
            raise ValueError(f"root {root} is not a rank of a group of {self._size}")
        if buf.size == 0 or self._size == 1:
            return buf
        # bit-exact: root's bytes, zeros elsewhere, combined with an unsigned max
        raw = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
        word = next(w for w in (np.uint64, np.uint32, np.uint16, np.uint8)
                    if raw.nbytes % np.dtype(w).itemsize == 0)
        if self._rank == root:
            mine = raw.view(word)
        else:
            mine = np.zeros(raw.nbytes // np.dtype(word).itemsize, word)
        got = self._run(self._mx.distributed.all_max(self._arr(mine), group=self._g,
                                                     stream=self._stream))
        buf[...] = got.view(np.uint8).view(buf.dtype).reshape(buf.shape)
        return buf

    def allreduce(self, buf, op="sum", out=None):
        fn = self._ops[check_op(op)]
        buf = np.asarray(buf)
        if out is None:
            out = np.empty(buf.shape, dtype=buf.dtype)
        if buf.size == 0:
            return out
        src = buf
        if buf.dtype == np.complex128 and op == "sum":
            src = np.ascontiguousarray(buf).view(np.float64)  # (re, im) pairs sum independently
        elif not self._native(buf.dtype):
            return self._need_fallback(f"allreduce of {buf.dtype}").allreduce(buf, op, out)
        src = np.ascontiguousarray(src)
        got = self._run(fn(self._arr(src), group=self._g, stream=self._stream))
        out[...] = got.view(buf.dtype).reshape(buf.shape)
        return out

    def allreduce_maxloc(self, value, index):
        pair = np.array([value, index], dtype=np.float64)
        return pick_maxloc(self.allgather(pair))

    def allgather(self, buf, out=None):
        buf = np.asarray(buf)
        if out is None:
            out = np.empty((self._size, *buf.shape), dtype=buf.dtype)
        if buf.size == 0:
            return out
        src = np.ascontiguousarray(buf)
        if not self._native(src.dtype):
            src = src.view(np.uint8)
        got = self._run(self._mx.distributed.all_gather(
            self._arr(src.reshape(1, -1)), group=self._g, stream=self._stream))
        out[...] = got.reshape(-1).view(buf.dtype).reshape(out.shape)
        return out

    def reduce_scatter(self, buf, op="sum"):
        check_op(op)
        buf = np.asarray(buf)
        if buf.shape[0] != self._size:
            raise ValueError(
                f"reduce_scatter: leading dimension {buf.shape[0]} != group size {self._size}")
        if self.transport == "rdma" and op == "sum" and self._native(buf.dtype) and buf.size:
            got = self._run(self._mx.distributed.sum_scatter(
                self._arr(np.ascontiguousarray(buf)), group=self._g, stream=self._stream))
            return np.array(got.reshape(buf.shape[1:]), dtype=buf.dtype)
        # MLX's ring has no reduce-scatter: reduce everything, keep my block
        return np.array(self.allreduce(buf, op)[self._rank], copy=True)

    def barrier(self):
        self._run(self._mx.distributed.all_sum(self._arr(np.zeros(1, np.int32)),
                                               group=self._g, stream=self._stream))

    def split(self, color, key=0):
        if self._fallback is not None:
            return self._fallback.split(color, key)
        pairs = self.allgather_obj((int(color), int(key)))
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == color)
        order = [r for _, r in members]
        if len(order) == 1:
            from hpcmac.comm.local import LocalGroup

            return LocalGroup()
        if order == list(range(self._size)):
            return self
        raise NotImplementedError(
            f"{self.transport} without mpi: split into {len(order)} of {self._size} ranks "
            "needs an MPI launch (mpirun) for sub-groups")

    def abort(self, code=1):
        sys.stderr.flush()
        if self._fallback is not None:
            self._fallback.abort(code)
        os._exit(code)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        # plain tagged bytes (comm.wire), never pickle: a ring link is a TCP port
        data = wire.encode(obj) if self._rank == root else b""
        n = np.array([len(data)], dtype=np.int64)
        self.bcast(n, root)
        payload = np.frombuffer(data, dtype=np.uint8).copy() if self._rank == root \
            else np.zeros(int(n[0]), dtype=np.uint8)
        self.bcast(payload, root)
        return obj if self._rank == root else wire.decode(payload.tobytes())

    def allgather_obj(self, obj: Any) -> list[Any]:
        data = wire.encode(obj)
        lengths = self.allgather(np.array([len(data)], dtype=np.int64))[:, 0]
        width = int(lengths.max())
        padded = np.zeros(width, dtype=np.uint8)
        padded[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        rows = self.allgather(padded)
        return [wire.decode(rows[r, : int(lengths[r])].tobytes()) for r in range(self._size)]


def _mx_dtype(mx, dtype: np.dtype):
    return getattr(mx, np.dtype(dtype).name if dtype != np.bool_ else "bool_")
