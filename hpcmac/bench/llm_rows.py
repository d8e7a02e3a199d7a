"""``python -m hpcmac.bench.llm --rows 1,2,4,16,32``: a quantized model's products at a few
activation rows, the explicit-SIMD kernels against dequantized tiles and BLAS.

What ``qkernels.BLOCK_ROWS`` and ``GEMM_ROWS`` are set from, and what a short prompt's
prefill or speculative decoding's verified rows cost: every matrix the numpy backend
keeps quantized in the model's layers (``--model``, default ``smollm2``: SmolLM2-135M's Q4_1
GGUF), multiplied by M random float32 activation rows through the kernels of
:mod:`hpcmac.llm.model.qvec` and through dequantized tiles and BLAS
(:func:`~hpcmac.llm.model.qkernels.tiled_matmul`), on this thread with one BLAS thread.
The time is the thread's CPU time for the whole model, so a loaded machine's waits for
a core do not count; the two paths take turns within each round (the order alternating
between rounds), medians over ``--rounds``. Each M's line says which path
:func:`~hpcmac.llm.model.qkernels.qmatmul` takes there.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from hpcmac.errors import UsageError


def parse_rows(text: str) -> list[int]:
    """``--rows``' comma-separated activation row counts; one clear line for anything else."""
    out = [v.strip() for v in text.split(",") if v.strip()]
    if not out or any(not v.isdigit() or int(v) < 1 for v in out):
        raise UsageError(f"--rows {text!r}: expected activation row counts >= 1, "
                         "comma-separated (e.g. 1,2,4,16,32)")
    return [int(v) for v in out]


def quantized_matrices(stage) -> list:
    """Every :class:`~hpcmac.llm.model.qkernels.NQWeight` of a numpy stage's layers (each
    expert's too, each once); not the head's, which a prefill multiplies by its last row
    alone."""
    from hpcmac.llm.model.qkernels import NQWeight

    return [v for v in stage.held(extra=False) if isinstance(v, NQWeight)]


def _cpu_ms(fn, ws, xs) -> float:
    t = time.thread_time()
    for w in ws:
        fn(xs[w.k], w)
    return (time.thread_time() - t) * 1e3


def run(model: str | None, rows: list[int], rounds: int, json_path: str | None) -> int:
    """Measure and print (see the module docstring); 0 on success."""
    from threadpoolctl import threadpool_limits

    from hpcmac.llm.model import qkernels, qvec
    from hpcmac.llm.model.config import load_config, resolve_model
    from hpcmac.llm.model.stage import load_stage

    path = resolve_model(model or "smollm2")
    stage = load_stage(path, 0, load_config(path).n_layers, True, True, backend="numpy")
    ws = quantized_matrices(stage)
    if not ws:
        raise UsageError(f"--rows --model {path}: no matrix of it stays quantized "
                         "(a float checkpoint: nothing for the kernels to multiply)")
    rng = np.random.default_rng(0)
    xs = {m: {k: rng.standard_normal((m, k)).astype(np.float32) for k in {w.k for w in ws}}
          for m in rows}
    paths = {"kernel": qkernels.kernel_matmul, "tiles": qkernels.tiled_matmul}
    kinds = sorted({w.kind for w in ws})
    load0 = os.getloadavg()
    print(f"# {path.name}: {len(ws)} quantized matrices, {sum(w.n * w.k for w in ws) / 1e6:.0f} M "
          f"weights, code kinds {kinds}; one thread, thread CPU ms for the whole model, "
          f"{rounds} rounds; CPU features: AVX-512F {qvec.HAS_AVX512F}, VBMI {qvec.HAS_VBMI}, "
          f"GFNI {qvec.HAS_GFNI}; load average {load0[0]:.1f} at start", flush=True)
    times = {(p, m): [] for p in paths for m in rows}
    with threadpool_limits(1):
        for fn in paths.values():  # compile (or load numba's cache) before timing
            _cpu_ms(fn, ws, xs[rows[0]])
        for r in range(rounds):
            for m in rows:
                for p in (paths if r % 2 == 0 else reversed(list(paths))):
                    times[p, m].append(_cpu_ms(paths[p], ws, xs[m]))
    med = {f"{p}_ms": {m: statistics.median(times[p, m]) for m in rows} for p in paths}
    limits = {qkernels.row_limit(w) for w in ws}
    print(f"{'rows':>5} {'kernel ms':>10} {'tiles ms':>9} {'kernel/tiles':>12} "
          f"{'ms a row':>9}  qmatmul takes")
    for m in rows:
        k, t = med["kernel_ms"][m], med["tiles_ms"][m]
        took = "kernel" if all(m <= lim for lim in limits) else \
            "tiles" if all(m > lim for lim in limits) else "kernel or tiles (by kind)"
        print(f"{m:5d} {k:10.1f} {t:9.1f} {k / t:12.2f} {k / m:9.2f}  {took}")
    load1 = os.getloadavg()
    print(f"row limits of these matrices: {sorted(limits)} (BLOCK_ROWS {qkernels.BLOCK_ROWS}, "
          f"GEMM_ROWS {qkernels.GEMM_ROWS}); load average {load1[0]:.1f} at the end")
    if json_path:
        from hpcmac.io.outputs import write_atomic

        write_atomic(json_path, json.dumps(dict(
            model=str(path), matrices=len(ws), kinds=kinds, rows=rows, rounds=rounds,
            times={f"{p}_ms": {str(m): times[p, m] for m in rows} for p in paths},
            median={p: {str(m): v for m, v in d.items()} for p, d in med.items()},
            load_start=load0, load_end=load1, cores=os.cpu_count()), indent=1), what="--json")
    return 0
