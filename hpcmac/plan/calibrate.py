"""``python -m hpcmac.plan calibrate``: measure this node in seconds.

* DGEMM (numpy, this BLAS, one thread each) on one core and on every core at
  once, at a large inner dimension; and at k = 64, 128, 256 on one core, as
  the fraction of the large-k rate (HPL's update is a rank-NB DGEMM);
* memory bandwidth: numpy copies of 64 MiB per thread, 1 thread and every
  core (bytes read + bytes written, as STREAM's copy counts them);
* read bandwidth (the decoder's own matrix-vector kernel over float32 weights
  far larger than cache, as a decode step reads them) and SGEMM, on one core
  and every core;
* hpcmac's own panel factorisation (the HPL panel, one process) at two panel
  heights: its fixed cost per column and its flop rate;
* hpcmac's decoder on two tiny random Llamas (2 and 10 layers, weights in
  cache): its fixed cost per layer and per decode step (needs the llm extra);
* hpcmac's tensor runtime on the same tiny Llamas, a 2-rank job against one
  rank (:mod:`hpcmac.plan.tensor_cost`): its cost per all-reduce beyond the
  link, and per decode step (needs the llm extra and mpi4py).

Each figure is the median of a few repeats, so a briefly busy machine does
not decide it. The JSON it writes is what ``--calibration FILE`` reads.
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np

from hpcmac.plan.machine import cores, last_cache_bytes, memory_gb


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first touch, thread pool start
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def dgemm_rates(configs: list[tuple[int, int]], n: int = 2048,
                rounds: int = 3) -> dict[tuple[int, int], float]:
    """Node Gflop/s of C = A @ B (A n x k, B k x n) for each (busy, k) in ``configs``.

    ``busy`` threads each multiply their own matrices with one BLAS thread,
    as ``busy`` one-thread ranks of HPL do (numpy releases the GIL in matmul).
    The configurations are timed in turn, round after round, and each one's
    median is kept: a machine busy for a moment slows one sample of each, not
    one configuration, so their ratios hold.
    """
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    most = max(b for b, _ in configs)
    ks = sorted({k for _, k in configs})
    mats = [{k: (np.asfortranarray(rng.standard_normal((n, k))),
                 np.asfortranarray(rng.standard_normal((k, n))),
                 np.empty((n, n), order="F")) for k in ks} for _ in range(most)]

    def together(busy: int, k: int) -> None:
        ts = [threading.Thread(target=np.matmul, args=m[k][:2], kwargs={"out": m[k][2]})
              for m in mats[:busy]]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    with threadpool_limits(limits=1, user_api="blas"):
        for c in configs:  # warm-up
            together(*c)
        for _ in range(rounds):
            for c in configs:
                t = time.perf_counter()
                together(*c)
                times[c].append(time.perf_counter() - t)
    return {(b, k): b * 2.0 * n * n * k / statistics.median(times[(b, k)]) / 1e9
            for b, k in configs}


#: bytes one bandwidth sample moves, all threads together: long enough (tens of ms)
#: that a moment of another job's traffic does not decide it
SAMPLE_BYTES = 1 << 30


def _per_thread(threads: int, floor: int) -> int:
    """Bytes per thread: the sample split over the threads, never below ``floor`` or
    past-cache sizes (4x the largest cache over the threads)."""
    return max(floor, SAMPLE_BYTES // threads, 4 * last_cache_bytes() // threads)


def copy_gbs(threads: int, repeats: int = 9) -> float:
    """GB/s of numpy copies, ``threads`` threads at once (numpy releases the GIL);
    bytes read plus bytes written, as STREAM's copy counts them."""
    words = _per_thread(threads, 64 << 20) // 16  # source and destination
    src = [np.ones(words) for _ in range(threads)]
    dst = [np.empty(words) for _ in range(threads)]

    def run() -> None:
        ts = [threading.Thread(target=np.copyto, args=(dst[i], src[i])) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    t = _median_time(run, repeats)
    return 2.0 * words * 8 * threads / t / 1e9


class ReadProbe:
    """Weights read by ``threads`` threads at once, each multiplying a vector by its own
    float32 weight far larger than cache with the decoder's kernel (the numpy backend's
    :meth:`~hpcmac.llm.model.backend.NumpyBackend.linear` over
    :class:`~hpcmac.llm.model.backend.Panels`): the access of a decode step. Measured
    at ``k`` threads, not derived from one: a kernel that keeps fewer reads in flight
    than a plain dot gets less of the memory at every thread count (the streaming
    kernel of :mod:`~hpcmac.llm.model.fvec` reads at about a dot's rate on one core
    here: 15.5-16.1 against 15.1-16.9 GB/s; BLAS sgemv per panel reached 0.8x).
    Kept to be read again: allocating and freeing a
    GiB between readings sets the kernel's memory threads working beside what is
    measured next. ``per_thread`` (bytes) replaces the past-cache size, for smoke runs
    whose figure means nothing (``bench.llm_parallel``'s test)."""

    def __init__(self, threads: int, per_thread: int | None = None):
        from hpcmac.llm.model.backend import NumpyBackend, Panels

        self.be = NumpyBackend()
        inp, r = 1024, self.be.panel
        size = _per_thread(threads, 64 << 20) if per_thread is None else per_thread
        nb = max(1, size // (4 * inp * r))
        self.weights = [Panels.of(np.ones((nb, inp, r), np.float32)) for _ in range(threads)]
        self.x = np.ones((1, inp), np.float32)

    def _run(self) -> None:
        ts = [threading.Thread(target=self.be.linear, args=(self.x, w)) for w in self.weights]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    def gbs(self, repeats: int = 9) -> float:
        """GB/s, all threads together (the median of ``repeats`` passes)."""
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            t = _median_time(self._run, repeats)
        return sum(w.nbytes for w in self.weights) / t / 1e9


def read_gbs(threads: int, repeats: int = 9) -> float:
    """GB/s of weights read by ``threads`` threads at once (:class:`ReadProbe`)."""
    return ReadProbe(threads).gbs(repeats)


def sgemm_gflops(threads: int, n: int = 1024, repeats: int = 5) -> float:
    """Node Gflop/s of float32 C = A @ B, ``threads`` one-thread products at once."""
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(2)
    mats = [(rng.standard_normal((n, n), dtype=np.float32),
             rng.standard_normal((n, n), dtype=np.float32)) for _ in range(threads)]

    def run() -> None:
        ts = [threading.Thread(target=np.matmul, args=m) for m in mats]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    with threadpool_limits(limits=1, user_api="blas"):
        t = _median_time(run, repeats)
    return threads * 2.0 * n ** 3 / t / 1e9


#: decodes of the big model in ``llm_fixed_costs``, each beside a reading of the kernel
BIG_PAIRS = 5


def llm_fixed_costs(layers: tuple[int, int] = (2, 10), steps: int = 24) -> dict[str, float]:
    """hpcmac's decoder (numpy backend, one thread) on random Llamas.

    Two tiny ones whose weights sit in cache: the time per decode step against
    the layer count gives the runtime's fixed cost per layer (slope) and per step
    (intercept). One of hidden 1024 and 45 MB per layer, at least 190 MB and
    twice the largest cache: what is left of its step once the fixed costs are
    taken off is the weights streamed, so bytes read over that time is the
    bandwidth the decoder's matrix-vector products reach (``decode_bw_gbs``), and
    over :class:`ReadProbe`'s one-core rate read next to each decode, how much of
    its kernel's rate the whole step streams at (``stream_eff``).
    """
    import tempfile
    from pathlib import Path

    from threadpoolctl import threadpool_limits

    from hpcmac.llm.model.stage import load_stage
    from hpcmac.measure.llm import decode_rate, write_random_llama

    def step_s(stage) -> float:
        return 1.0 / statistics.median(decode_rate(stage, 1, steps) for _ in range(3))

    times = []
    with tempfile.TemporaryDirectory(prefix="hpcmac-calibrate-") as tmp, \
            threadpool_limits(limits=1, user_api="blas"):
        for n in layers:
            path = write_random_llama(Path(tmp) / f"l{n}", hidden=64, layers=n,
                                      intermediate=128, vocab=256, heads=4, kv_heads=2)
            times.append(step_s(load_stage(path, 0, n, True, True)))
        (l1, l2), (t1, t2) = layers, times
        per_layer = max(0.0, (t2 - t1) / (l2 - l1))
        per_step = max(0.0, t1 - l1 * per_layer)
        hidden, vocab = 1024, 2048
        n_big = max(4, -(-2 * last_cache_bytes() // (45 << 20)))
        path = write_random_llama(Path(tmp) / "big", hidden=hidden, layers=n_big,
                                  intermediate=2816, vocab=vocab, heads=16, kv_heads=4)
        big = load_stage(path, 0, n_big, True, True)
        read = big.nbytes - vocab * hidden * 4  # the embedding: one row per token
        fixed = per_step + n_big * per_layer
        # the big model's decode and the kernel alone on one core, in turn: each
        # decode's streaming rate over the reading next to it (the one-core read of a
        # shared VM moves 20-40% between minutes), the median of five such pairs
        probe, rates, effs = ReadProbe(1), [], []
        for _ in range(BIG_PAIRS):
            rate = read / max(1.0 / decode_rate(big, 1, steps) - fixed, 1e-9) / 1e9
            rates.append(rate)
            effs.append(rate / probe.gbs(repeats=3))
    return {"layer_s": per_layer, "token_s": per_step,
            "decode_bw_gbs": statistics.median(rates), "stream_eff": statistics.median(effs)}


def panel_cost(nb: int = 256, heights: tuple[int, int] = (1024, 6144),
               repeats: int = 3) -> dict[str, float]:
    """hpcmac's HPL panel on one process: seconds per column and Gflop/s.

    ``t(m) = nb * col_s + m * nb^2 / rate`` from two panel heights.
    """
    from threadpoolctl import threadpool_limits

    from hpcmac.linalg import _blas as blas
    from hpcmac.linalg.panel import PanelFactor
    from hpcmac.linalg.pivot import LocalPivot

    rng = np.random.default_rng(1)
    times = []
    for m in heights:
        base = np.asfortranarray(rng.random((m, nb)) - 0.5)
        w = np.empty_like(base, order="F")

        def run(w=w, base=base, m=m) -> None:
            w[...] = base
            ptr = blas.addr(w)
            piv = LocalPivot(w, ptr, m, nb, np.arange(m, dtype=np.int64))
            PanelFactor(w, ptr, m, nb, 0, piv, "right", "crout", 4, 2).run()

        with threadpool_limits(limits=1, user_api="blas"):
            times.append(_median_time(run, repeats))
    (m1, m2), (t1, t2) = heights, times
    per_row = max((t2 - t1) / (m2 - m1), 1e-12)
    col_s = max(0.0, (t1 - m1 * per_row) / nb)
    return {"col_s": col_s, "gflops": nb * nb / per_row / 1e9, "nb": nb,
            "t_small_s": t1, "t_large_s": t2}


def calibrate(quick: bool = False, decoder: bool = True) -> dict:
    """Every measurement of this node, as the JSON ``--calibration`` reads.

    ``decoder=False`` leaves out the decoder's and the tensor runtime's figures
    (:func:`llm_fixed_costs`, :func:`hpcmac.plan.tensor_cost.measure`), which only
    ``plan llm`` reads: HPL's figures alone, in about half the time (quick, at load
    8-14 on 2 cores, interleaved: 30 and 37 s against 55 and 77 s with them)."""
    t0 = time.perf_counter()
    nc = cores()
    reps = 3 if quick else 5
    busy = sorted({1, nc})
    ks = (64, 128, 256, 1024)
    rates = dgemm_rates([(1, k) for k in ks] + [(b, 1024) for b in busy if b > 1],
                        rounds=reps)
    dgemm = {b: rates[(b, 1024)] for b in busy}
    dgemm_k = {k: min(1.0, rates[(1, k)] / rates[(1, 1024)]) for k in ks}
    bw = {b: copy_gbs(b) for b in busy}
    rd = {b: read_gbs(b) for b in busy}
    sg = {b: sgemm_gflops(b, repeats=reps) for b in busy}
    panel = panel_cost(repeats=reps)
    try:
        fixed = llm_fixed_costs() if decoder else {}
    except ImportError:  # the llm extra is not installed: no decoder to measure
        fixed = {}
    tensor = {}
    if fixed:
        from hpcmac.plan.tensor_cost import measure

        tensor = measure()  # empty when no 2-rank job can start here
    return {
        "name": "this node", "cores": nc, "memory_gb": round(memory_gb(), 2),
        "dgemm_gflops": {str(k): round(v, 3) for k, v in dgemm.items()},
        "dgemm_k": {str(k): round(v, 4) for k, v in dgemm_k.items()},
        "mem_bw_gbs": {str(k): round(v, 3) for k, v in bw.items()},
        "read_bw_gbs": {str(k): round(v, 3) for k, v in rd.items()},
        "sgemm_gflops": {str(k): round(v, 3) for k, v in sg.items()},
        **{k: round(min(1.0, v) if k == "stream_eff" else v, 9) for k, v in fixed.items()},
        **({"tensor": {k: round(v, 9) for k, v in tensor.items()}} if tensor else {}),
        "panel": {k: (round(v, 9) if isinstance(v, float) else v) for k, v in panel.items()},
        "seconds": round(time.perf_counter() - t0, 2),
    }
