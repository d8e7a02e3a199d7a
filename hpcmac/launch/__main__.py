"""``python -m hpcmac.launch``: launch over a Thunderbolt mesh, check and convert hostfiles.

Usage::

    python -m hpcmac.launch --hostfile F [--via mpirun|mlx] [--np N] [--dry-run] -- COMMAND...
    python -m hpcmac.launch check   --hostfile F
    python -m hpcmac.launch convert --hostfile F --to openmpi|mpich|mlx|ibv|mca
    python -m hpcmac.launch routes  --hostfile F [--os macos|linux] [--check]
    python -m hpcmac.launch discover HOST... [-o FILE] [--print-setup]
    python -m hpcmac.launch doctor  --hostfile F [--ssh CMD] [--need-gb G]

Bad input (a hostfile that is not JSON, a missing field, a half mesh,
duplicate addresses, shell metacharacters in a name) is one line naming the
file and the problem, exit 2, and nothing is launched.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile

from hpcmac.errors import UsageError
from hpcmac.io.inputs import float_arg, int_arg
from hpcmac.io.outputs import checked_output, write_atomic
from hpcmac.launch import convert, discover, runner
from hpcmac.launch.hostfile import load
from hpcmac.lifecycle import run_cli

SUBCOMMANDS = ("check", "convert", "routes", "discover", "doctor")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every hpcmac command
        raise UsageError(f"{self.prog}: {message}")


def _run_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m hpcmac.launch",
                 description="Launch COMMAND on the hosts of a hostfile. Subcommands: "
                 + ", ".join(SUBCOMMANDS) + " (see --help of each).")
    ap.add_argument("--hostfile", required=True, help="hpcmac or mlx.launch JSON hostfile")
    ap.add_argument("--via", default="mpirun", choices=runner.VIAS)
    ap.add_argument("--np", type=int_arg, default=None, help="ranks (default: all slots)")
    ap.add_argument("--dry-run", action="store_true", help="print the launch, run nothing")
    ap.add_argument("--mpirun", default=None, help="mpirun to use (default: this venv's)")
    ap.add_argument("--agent", default=None,
                    help="Open MPI launch agent instead of ssh (plm_ssh_agent)")
    ap.add_argument("--mca", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--transport", default=None, help="HPCMAC_TRANSPORT for the ranks")
    ap.add_argument("--backend", default=None, help="mlx.launch backend (ring, jaccl)")
    ap.add_argument("--port", type=int, default=None,
                    help="--via mlx: first TCP port (mlx.launch --starting-port)")
    ap.add_argument("--oversubscribe", action="store_true")
    ap.add_argument("--timeout", type=float_arg, default=None, help="wall-clock limit in seconds")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    return ap


def _warn(hf) -> None:
    from hpcmac.launch.hostfile import advise

    for line in advise(hf):
        print(f"warning: {hf.source}: {line}", file=sys.stderr, flush=True)


def _launch(argv: list[str]) -> int:
    a = _run_parser().parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    hf = load(a.hostfile)
    _warn(hf)
    opts = runner.Options(via=a.via, np=a.np, mpirun=a.mpirun, agent=a.agent,
                          mca=[tuple(m) for m in a.mca], env=a.env, transport=a.transport,
                          backend=a.backend, port=a.port, oversubscribe=a.oversubscribe,
                          timeout=a.timeout)
    with tempfile.TemporaryDirectory(prefix="hpcmac-launch-") as work:
        p = runner.plan(hf, command, opts, work)
        if a.dry_run:
            print(p.describe())
            return 0
        rc = runner.run(p, opts)
    if rc != 0:
        print(f"error: job on {hf.source} ended with exit code {rc}", file=sys.stderr, flush=True)
    return rc


def _check(argv: list[str]) -> int:
    ap = _Parser(prog="python -m hpcmac.launch check")
    ap.add_argument("--hostfile", required=True)
    a = ap.parse_args(argv)
    hf = load(a.hostfile)
    _warn(hf)
    from hpcmac.launch.topology import is_full_mesh, ring_order

    shape = "full mesh" if is_full_mesh(hf) else (
        f"ring {' -> '.join(ring_order(hf) or [])}" if hf.links else "no Thunderbolt links")
    print(f"{hf.source}: ok: {len(hf.hosts)} hosts, {hf.total_slots()} slots, "
          f"{len(hf.links)} links, {shape}")
    return 0


def _convert(argv: list[str]) -> int:
    ap = _Parser(prog="python -m hpcmac.launch convert")
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--to", required=True, choices=("openmpi", "mpich", "mlx", "ibv", "mca"))
    ap.add_argument("--backend", default=None, help="for --to mlx: ring, jaccl or jaccl-ring")
    a = ap.parse_args(argv)
    hf = load(a.hostfile)
    if a.to == "openmpi":
        sys.stdout.write(convert.openmpi_hostfile(hf))
    elif a.to == "mpich":
        sys.stdout.write(convert.mpich_hostfile(hf))
    elif a.to == "mlx":
        print(json.dumps(convert.mlx_hostfile(hf, a.backend), indent=2))
    elif a.to == "ibv":
        print(convert.ibv_devices_env(hf))
    else:
        print(" ".join(f"--mca {k} {shlex.quote(v)}" for k, v in convert.openmpi_mca(hf)))
    return 0


def _routes(argv: list[str]) -> int:
    ap = _Parser(prog="python -m hpcmac.launch routes")
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--os", default="macos", choices=("macos", "linux"))
    ap.add_argument("--check", action="store_true",
                    help="read each host's route table over ssh; print only what is missing")
    ap.add_argument("--ssh", default="ssh", help="ssh command (or a launch agent) to reach hosts")
    a = ap.parse_args(argv)
    hf = load(a.hostfile)
    from hpcmac.launch.topology import required_routes

    routes = required_routes(hf)
    if a.check:
        show = ["netstat", "-rn", "-f", "inet"] if a.os == "macos" \
            else ["ip", "-4", "route", "show"]
        tables = {}
        for h in hf.hosts:
            res = subprocess.run([*shlex.split(a.ssh), h.ssh, *show], capture_output=True,
                                 text=True, timeout=30)
            if res.returncode != 0:
                raise UsageError(f"{h.name}: cannot read the route table ({res.stderr.strip()})")
            tables[h.name] = res.stdout
        routes = convert.missing_routes(hf, tables)
        if not routes:
            print(f"{hf.source}: every host has a direct route to every address of its peers")
            return 0
        print(f"# {len(routes)} routes missing; add them with:")
    for line in convert.route_commands(routes, a.os):
        print(line)
    return 1 if a.check else 0


def _discover(argv: list[str]) -> int:
    ap = _Parser(prog="python -m hpcmac.launch discover")
    ap.add_argument("hosts", nargs="+", help="ssh names of the Macs")
    ap.add_argument("-o", "--output", default=None, type=checked_output("--output"),
                    help="write the hostfile here (default stdout; hpcmac.io.outputs: "
                         "checked before any host is probed)")
    ap.add_argument("--subnet", default="10.77.0.0/16", help="where the /30 per cable comes from")
    ap.add_argument("--ssh", default="ssh -o BatchMode=yes -o ConnectTimeout=5")
    ap.add_argument("--print-setup", action="store_true",
                    help="print the ifconfig/route commands for each host")
    a = ap.parse_args(argv)
    from hpcmac.launch.hostfile import is_safe_word, is_ssh_name

    for h in a.hosts:
        if not is_safe_word(h):
            raise UsageError(f"discover: host {h!r} has shell metacharacters")
        if not is_ssh_name(h):
            raise UsageError(f"discover: host {h!r}: expected host or user@host (letters, "
                             "digits, '.', '-')")
    probes = [discover.collect(h, shlex.split(a.ssh)) for h in a.hosts]
    data, warnings = discover.plan_hostfile(probes, a.subnet)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    text = json.dumps(data, indent=2) + "\n"
    if a.output:
        write_atomic(a.output, text, what="--output")
    else:
        sys.stdout.write(text)
    if a.print_setup:
        for host, cmds in discover.setup_commands(data, discover.services(probes)).items():
            print(f"# on {host}")
            for c in cmds:
                print(c)
    return 0


def _doctor(argv: list[str]) -> int:
    ap = _Parser(prog="python -m hpcmac.launch doctor",
                 description="Check every host over ssh before a job; exit 1 when anything "
                 "fails, with the command that fixes it.")
    ap.add_argument("--hostfile", required=True)
    ap.add_argument("--ssh", default="ssh -o BatchMode=yes -o ConnectTimeout=5",
                    help="ssh command (or a launch agent) to reach hosts")
    ap.add_argument("--need-gb", type=float, default=None,
                    help="memory the job needs on each host (GiB)")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per host")
    a = ap.parse_args(argv)
    from hpcmac.launch import doctor

    hf = load(a.hostfile)
    python = doctor.python_paths(hf)
    reports = doctor.collect(hf, shlex.split(a.ssh), python, a.timeout)
    checks = doctor.evaluate(hf, reports, python, a.need_gb)
    print(doctor.table(checks))
    failed = [c for c in checks if not c.ok]
    hosts = sorted({c.host for c in failed})
    print(f"{hf.source}: " + (f"{len(failed)} checks failed on {', '.join(hosts)}" if failed
                              else f"all {len(checks)} checks passed on {len(hf.hosts)} "
                              f"host{'s' if len(hf.hosts) > 1 else ''}"))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args and args[0] in SUBCOMMANDS:
            return {"check": _check, "convert": _convert, "routes": _routes,
                     "discover": _discover, "doctor": _doctor}[args[0]](args[1:])
        return _launch(args)
    except BrokenPipeError:  # output piped into `head`: not an error worth a traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
