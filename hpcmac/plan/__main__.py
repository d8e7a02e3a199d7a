"""``python -m hpcmac.plan``: see :mod:`hpcmac.plan.cli`."""

from hpcmac.lifecycle import run_cli
from hpcmac.plan.cli import main

raise SystemExit(run_cli(main))
