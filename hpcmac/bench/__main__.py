"""``python -m hpcmac bench <name>``: run one benchmark module ``hpcmac.bench.<name>``."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "comm": "latency, bandwidth and collectives per transport vs raw mpi4py",
    "hpl": "hpcmac HPL vs netlib HPL and the DGEMM ceiling",
    "linalg": "SUMMA matmul and Cholesky vs numpy/scipy",
    "solvers": "eigh, lstsq, inv vs scipy on one core (run it under mpirun)",
    "sparse": "DistCSR SpMV, CG + Jacobi, CG + AMG vs PETSc (petsc4py) at 1 and 2 ranks",
    "llm": "decode tok/s vs the memory-bandwidth bound and llama.cpp",
    "llm_pipeline": "pipeline decode at 1/2/4 ranks: TTFT, prefill, decode, bytes per link, busy",
    "llm_parallel": "tensor vs pipeline at 2 ranks vs 1, quiet and loaded; all-reduce costs",
    "serve": "a live serve at 1/4/16 clients: tok/s, TTFT, ITL vs generate --batch",
    "spec": "speculative decoding (draft model, n-grams) vs plain decode and llama.cpp's",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m hpcmac bench <name> [args]\n\nbenchmarks:")
        for name, desc in BENCHES.items():
            print(f"  {name:<8} {desc}")
        return 0
    if args[0] not in BENCHES:
        print(f"error: unknown benchmark {args[0]!r}; expected one of: {', '.join(BENCHES)}",
              file=sys.stderr)
        return 2
    module = importlib.import_module(f"hpcmac.bench.{args[0]}")
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(main))
