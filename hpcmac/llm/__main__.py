"""``python -m hpcmac.llm generate|bench ...``: see :mod:`hpcmac.llm.cli`."""

from __future__ import annotations

from hpcmac.lifecycle import run_cli
from hpcmac.llm.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(run_cli(main))
