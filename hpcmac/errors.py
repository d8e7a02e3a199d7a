"""Errors meant for people: the error type bad input raises, and the parser.

A :class:`UsageError` is bad input: a file, a line or a field, what was
expected and what was found. Commands raise it; :func:`hpcmac.lifecycle.run_cli`
turns it into one line on stderr and exit code 2, with no traceback. This
module imports nothing of hpcmac's, so any module may raise a UsageError
without an import circle; the process lifecycle lives in :mod:`hpcmac.lifecycle`.
"""

from __future__ import annotations

import argparse
import os


class UsageError(Exception):
    """Bad input: the message is one line naming where and what was expected."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors (one line on rank 0, exit 2, no usage
    block, every rank leaving together) and whose help only rank 0 prints.
    Subcommand parsers made with ``add_subparsers`` are of this class too."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message} (see --help)")

    def print_help(self, file=None):  # type: ignore[override]
        if world_rank() == 0:
            super().print_help(file)


def world_rank() -> int:
    """This process's rank in the launcher's world, without initialising MPI."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "MLX_RANK"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def world_size() -> int:
    """Number of ranks the launcher started, without initialising MPI."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "MLX_WORLD_SIZE"):
        value = os.environ.get(var)
        if value is not None and value.isdigit():
            return int(value)
    return 1
