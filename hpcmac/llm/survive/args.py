"""``serve --survive``'s flags (read by the front, :mod:`hpcmac.llm.survive.supervisor`;
``--channel`` is the one the front hands the job)."""

from __future__ import annotations

import argparse

from hpcmac.io.inputs import float_arg


def add_survive_args(s) -> None:
    g = s.add_argument_group("survive (a front outside the MPI job; docs/faults.md)")
    g.add_argument("--survive", action="store_true",
                   help="run a front process that owns the HTTP port and relaunches the job "
                        "on the hosts left when one is lost (needs --hostfile)")
    g.add_argument("--agent", default=None,
                   help="--survive: Open MPI launch agent instead of ssh (plm_ssh_agent), "
                        "also used by the doctor checks")
    g.add_argument("--survive-heartbeat", type=float_arg, default=8.0, metavar="S",
                   help="--survive: seconds of silence that end the job and start a "
                        "recovery (the job's HPCMAC_HEARTBEAT_TIMEOUT; default 8)")
    g.add_argument("--survive-start-timeout", type=float_arg, default=300.0, metavar="S",
                   help="--survive: seconds a job may take to load (default 300)")
    g.add_argument("--readmit-after", type=float_arg, default=None, metavar="S",
                   help="--survive: re-admit a lost host S seconds after it was lost when "
                        "launch doctor passes it, retrying every S seconds (default: only "
                        "when asked, POST /admin/hosts/HOST/readmit)")
    g.add_argument("--channel", default=None, help=argparse.SUPPRESS)
