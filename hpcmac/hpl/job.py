"""The job skeleton both HPL commands share (``hpcmac.hpl``, ``hpcmac.hpl_mxp``): the
input read once and broadcast, the outputs checked and locked before any run,
``--json`` written as runs end, HPL.out replacing the old file only when whole.

Collective calls say so; everything else is local.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from hpcmac.errors import UsageError
from hpcmac.hpl import config as hplconfig
from hpcmac.io.inputs import read_text


def read_input(world, dat: str | None) -> tuple[str, str]:
    """Collective: (text, name) of the HPL.dat to use, read on world rank 0 and
    broadcast (other hosts need not see the file); ("", "") means the embedded default."""
    got = None
    if world.rank == 0:
        path = dat if dat is not None else ("HPL.dat" if os.path.exists("HPL.dat") else None)
        if path is None:
            got = ("ok", "", "")
        else:
            try:  # at most 1 MiB, from a regular file (a FIFO or /dev/zero is refused)
                got = ("ok", read_text(path, "--dat" if dat is not None else "./HPL.dat"), path)
            except UsageError as exc:
                got = ("error", str(exc), "")
    status, text, name = world.bcast_obj(got, 0)
    if status == "error":
        raise UsageError(text)
    return text, name


def load_config(world, args) -> hplconfig.HPLConfig:
    """Collective: the HPLConfig from ``args.dat`` / ./HPL.dat / the embedded default,
    with ``-N``, ``--nb``, ``-P``, ``-Q`` applied (the same on every rank)."""
    text, name = read_input(world, args.dat)
    cfg = hplconfig.parse_hpl_dat(text, name) if name else hplconfig.default_config(world.size)
    return hplconfig.apply_overrides(cfg, world.size, args.ns, args.nbs, args.P, args.Q)


def open_outputs(world, cfg: hplconfig.HPLConfig, json_path: str | None):
    """Collective: (HPL.out's stream, locks) on rank 0, (None, []) elsewhere.

    Before any run: both outputs are checked writable and locked against a
    second job; HPL.out, when it is a file, goes to a temporary beside it that
    replaces the old file only when complete (see hpcmac.io.outputs).
    """
    from hpcmac.io.outputs import AtomicText, OutputLock, check_writable

    err = None
    out = None
    locks: list = []
    if world.rank == 0:
        try:
            if json_path:
                check_writable(json_path, "--json")
                locks.append(OutputLock(json_path, "--json"))
            if cfg.device == 6:
                out = sys.stdout
            elif cfg.device == 7:
                out = sys.stderr
            else:
                what = f"{cfg.source}:3: output file"
                check_writable(cfg.outfile, what)
                locks.append(OutputLock(cfg.outfile, what))
                out = AtomicText(cfg.outfile, what)
        except (UsageError, OSError) as exc:
            for lock in locks:
                lock.release()
            err = str(exc) if isinstance(exc, UsageError) else f"output: {exc}"
    err = world.bcast_obj(err, 0)
    if err:
        raise UsageError(err)
    return out, locks


def json_writers(world, json_path: str | None, write):
    """(on_result, finish) for ``--json``, ``write(path, results)`` doing the writing.

    A file's list is rewritten after each run (a kill leaves the runs finished so
    far); a stream (a FIFO, a device) gets the list once, at the end, as one JSON
    document (a reader of a FIFO sees one list, and a second open never waits for a
    reader that has gone). ``finish(results)`` is collective: a failed write is one
    line on every rank.
    """
    from hpcmac.io.outputs import OutputError, target

    if not json_path:
        return None, lambda results: None
    stream = target(json_path, "--json").how == "stream"

    def finish(results) -> None:
        err = None
        if world.rank == 0 and (stream or not results):
            try:
                write(json_path, results)
            except OutputError as exc:
                err = str(exc)
        err = world.bcast_obj(err, 0)
        if err:
            raise OutputError(err, local=False)

    return (None if stream else lambda results: write(json_path, results)), finish


def run(world, cfg: hplconfig.HPLConfig, json_path: str | None,
        write_json: Callable[[str, list], None],
        make_driver: Callable[[TextIO | None, Any], Any]) -> int:
    """Collective: open and lock the outputs, announce the transport, run the driver
    ``make_driver(out, on_result)`` over every combination; 1 when a run FAILED."""
    from hpcmac import comm

    out, locks = open_outputs(world, cfg, json_path)  # checked writable, locked
    comm.announce()
    on_result, finish_json = json_writers(world, json_path, write_json)
    done = False
    try:
        d = make_driver(out, on_result)
        failed = d.run()
        finish_json(d.results)
        done = True
    finally:
        if out is not None and out not in (sys.stdout, sys.stderr):
            # HPL.out replaces the previous file only when complete
            out.commit() if done else out.discard()
        for lock in locks:
            lock.release()
    return 1 if failed else 0
