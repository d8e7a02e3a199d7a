"""``python -m hpcmac <command>``: the command dispatcher."""

from __future__ import annotations

import importlib
import sys

from hpcmac import __version__
from hpcmac.lifecycle import run_cli

# command -> (module whose main(argv) runs it, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("hpcmac.info", "MPI library, ranks and hosts, transports, BLAS, MLX"),
    "hpl": ("hpcmac.hpl.__main__", "distributed FP64 LINPACK (HPL.dat in, HPL.out out)"),
    "llm": ("hpcmac.llm.__main__", "LLM decoding, tensor- and pipeline-parallel across ranks"),
    "launch": ("hpcmac.launch.__main__", "launch over a Thunderbolt mesh via mpirun or mlx.launch"),
    "bench": ("hpcmac.bench.__main__", "benchmarks against references measured in the same run"),
    "plan": ("hpcmac.plan.cli", "predict HPL and LLM decoding on a cluster before building it"),
}


def usage() -> str:
    lines = [f"usage: python -m hpcmac <command> [args]   (hpcmac {__version__})", "", "commands:"]
    lines += [f"  {name:<8} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines.append("\n`python -m hpcmac <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] == "--version":
        print(f"hpcmac {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"error: unknown command {name!r}; expected one of: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return run_cli(module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
