"""Bounded input reading and outputs that cannot be lost (hpcmac.io.inputs, .outputs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from hpcmac.errors import UsageError
from hpcmac.io import inputs, outputs


def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=r"^x .*fifo: expected a regular file, found a pipe"):
        inputs.read_text(fifo, "x")
    assert time.monotonic() - t0 < 2
    with pytest.raises(UsageError, match="found a character device"):
        inputs.read_text("/dev/zero", "x")
    with pytest.raises(UsageError, match="expected a file, found a directory"):
        inputs.read_text(tmp_path, "x")
    with pytest.raises(UsageError, match="cannot read: No such file"):
        inputs.read_text(tmp_path / "nope", "x")
    # asked for: a special file is read, but still only up to the limit
    with pytest.raises(UsageError, match="expected at most 1 KiB, found more"):
        inputs.read_bytes("/dev/zero", "x", limit=1024, special=True)


def test_size_cap_and_strict_utf8(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(b"a" * 2049)
    with pytest.raises(UsageError, match=r"expected at most 2 KiB, found 2049 bytes"):
        inputs.read_text(big, "x", limit=2048)
    assert inputs.read_text(big, "x", limit=4096) == "a" * 2049
    bad = tmp_path / "bad"
    bad.write_bytes(b"ok\nfine\n\xff\xfe")
    with pytest.raises(UsageError, match=r"line 3: expected UTF-8 text, found byte 0xff at "
                                         r"offset 8"):
        inputs.read_text(bad, "x")


@pytest.mark.parametrize("tok,want", [
    ("12", 12), ("-3", -3), ("+7", 7), ("0012", 12),
    ("١٢", None), ("1_000", None), (" 12", None), ("12\n", None), ("1e3", None), ("", None),
    ("0x10", None), ("²", None),
])
def test_parse_int_is_plain_ascii(tok, want):
    assert inputs.parse_int(tok) == want


@pytest.mark.parametrize("tok,want", [
    ("16.0", 16.0), ("-1", -1.0), (".5", 0.5), ("1e-3", 1e-3), ("2.", 2.0),
    ("nan", None), ("NaN", None), ("inf", None), ("-Infinity", None), ("1e999", None),
    ("1_0.0", None), ("١.٠", None), ("0x1p3", None), ("", None),
])
def test_parse_float_is_finite_ascii(tok, want):
    assert inputs.parse_float(tok) == want


def test_parse_json_refuses_nan_and_deep_nesting():
    assert inputs.parse_json('{"a": [1, 2.5, "[[[["]}', "f") == {"a": [1, 2.5, "[[[["]}
    for text in ('{"m": NaN}', '[Infinity]', '[-Infinity]'):
        with pytest.raises(UsageError, match="^f: not JSON: .* is not a number JSON allows"):
            inputs.parse_json(text, "f")
    deep = "[" * 100000 + "]" * 100000
    with pytest.raises(UsageError, match="nested at most 64 levels deep, found 100000"):
        inputs.parse_json(deep, "f")
    with pytest.raises(UsageError, match=r"^f: not JSON \(line 1, column 2"):
        inputs.parse_json("[", "f")


def test_check_writable(tmp_path):
    outputs.check_writable(str(tmp_path / "new.json"), "--json")
    with pytest.raises(UsageError, match="^--json .*: cannot write: it is a directory"):
        outputs.check_writable(str(tmp_path), "--json")
    with pytest.raises(UsageError, match="directory .* does not exist"):
        outputs.check_writable(str(tmp_path / "no" / "x.json"), "--json")
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="is not a directory"):
        outputs.check_writable(str(tmp_path / "f" / "x.json"), "--json")
    outputs.check_writable("/dev/null", "--json")  # a stream: written as it is
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        with pytest.raises(UsageError, match="cannot write in"):
            outputs.check_writable(str(ro / "x"), "--json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe is gone


def test_atomic_text_replaces_only_when_complete(tmp_path):
    path = tmp_path / "HPL.out"
    path.write_text("previous run\n")
    path.chmod(0o640)
    out = outputs.AtomicText(str(path))
    out.write("half of a new")
    out.flush()
    assert path.read_text() == "previous run\n"  # readers still see the old file
    out.discard()
    assert path.read_text() == "previous run\n"
    assert [p.name for p in tmp_path.iterdir()] == ["HPL.out"]
    with outputs.AtomicText(str(path)) as out:
        out.write("complete\n")
    assert path.read_text() == "complete\n"
    assert (path.stat().st_mode & 0o777) == 0o640
    with pytest.raises(RuntimeError):
        with outputs.AtomicText(str(path)) as out:
            out.write("broken")
            raise RuntimeError
    assert path.read_text() == "complete\n"
    assert [p.name for p in tmp_path.iterdir()] == ["HPL.out"]


def test_write_atomic_survives_a_kill_mid_write(tmp_path):
    """A writer killed at random moments leaves either the old or the new JSON, whole."""
    path = tmp_path / "r.json"
    script = textwrap.dedent(f"""
        import json, sys
        from hpcmac.io.outputs import write_atomic
        k = 0
        while True:
            k += 1
            write_atomic({str(path)!r}, json.dumps([{{"run": k, "pad": "x" * 200000}}]))
    """)
    import json

    for delay in (0.01, 0.07, 0.13):
        proc = subprocess.Popen([sys.executable, "-c", script])
        deadline = time.monotonic() + 60  # start-up on a loaded machine: wait for a first file
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)  # then kill it somewhere in the middle of its rewrites
        proc.kill()
        proc.wait()
        assert json.loads(path.read_text())[0]["run"] >= 1


def test_lock_second_job_refuses(tmp_path):
    path = str(tmp_path / "HPL.out")
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\nfrom hpcmac.io.outputs import OutputLock\n"
         f"lock = OutputLock({path!r}, 'out')\nprint('held', flush=True)\ntime.sleep(30)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UsageError, match=rf"^out {path}: another job \(pid {holder.pid}\) "
                                             "is writing it"):
            outputs.OutputLock(path, "out")
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: the lock died with it
    with outputs.OutputLock(path, "out"):
        assert os.path.exists(tmp_path / ".HPL.out.lock")
    assert not os.path.exists(tmp_path / ".HPL.out.lock")


def _node(path, minor: int):
    """A character device made under tmp_path: (1, 3) null, (1, 7) full (never /dev's)."""
    import stat

    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")
    return str(path)


def _is_chr(path) -> bool:
    import stat

    return stat.S_ISCHR(os.lstat(path).st_mode)


def test_outputs_respect_what_the_path_is(tmp_path, capsys):
    """A device, a FIFO and a symlink are written through, never renamed over; a
    directory or a socket is refused before any work (issue 32)."""
    import socket
    import threading

    null = _node(tmp_path / "null", 3)
    assert outputs.check_writable(null, "--json").how == "stream"
    outputs.write_atomic(null, "x" * 5000)
    with outputs.AtomicText(null) as out:  # HPL.out's stream
        out.write("y" * 5000)
    assert _is_chr(null)

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    outputs.write_atomic(str(fifo), "through the pipe\n")
    reader.join(10)
    assert got == ["through the pipe\n"] and fifo.is_fifo()

    elsewhere = tmp_path / "results"
    elsewhere.mkdir()
    (elsewhere / "t.json").write_text("old")
    link = tmp_path / "l.json"
    link.symlink_to(elsewhere / "t.json")
    assert outputs.check_writable(str(link), "--json").how == "atomic"
    with outputs.OutputLock(str(link), "--json"):  # the lock sits beside the target
        assert (elsewhere / ".t.json.lock").exists()
        outputs.write_atomic(str(link), "new")
    assert link.is_symlink() and (elsewhere / "t.json").read_text() == "new"
    dangling = tmp_path / "d.json"
    dangling.symlink_to(elsewhere / "born.json")
    outputs.write_atomic(str(dangling), "created through the link")
    assert dangling.is_symlink() and (elsewhere / "born.json").read_text().startswith("created")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["born.json", "t.json"]

    with pytest.raises(UsageError, match=r"^--json .*: cannot write: it is a directory$"):
        outputs.check_writable(str(elsewhere), "--json")
    (tmp_path / "dlink").symlink_to(elsewhere)
    with pytest.raises(UsageError, match="it is a directory"):
        outputs.check_writable(str(tmp_path / "dlink"), "--json")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s"))
    with pytest.raises(UsageError, match="it is a socket"):
        outputs.check_writable(str(tmp_path / "s"), "--json")
    sock.close()
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(UsageError, match="^--json .*loop: cannot write: "):
        outputs.check_writable(str(loop), "--json")
    with pytest.raises(UsageError, match="^--json: empty path"):
        outputs.check_writable("", "--json")
    assert capsys.readouterr().err == ""


def test_symlink_target_directory_without_room_is_written_in_place(tmp_path, monkeypatch,
                                                                    capsys):
    """The target's directory takes no temporary (read-only, root-squashed): the target
    is written in place, and one note line says so."""
    import tempfile

    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "t.out").write_text("old")
    link = tmp_path / "l.out"
    link.symlink_to(ro / "t.out")
    real_mkstemp = tempfile.mkstemp

    def refuse(*a, dir=None, **k):  # what a read-only directory answers, even to root
        if os.path.samefile(dir, ro):
            raise PermissionError(13, "Permission denied")
        return real_mkstemp(*a, dir=dir, **k)

    monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)
    assert outputs.check_writable(str(link), "HPL.out").how == "inplace"
    with outputs.OutputLock(str(link), "HPL.out"):
        with outputs.AtomicText(str(link), "HPL.out") as out:
            out.write("complete\n")
    assert link.is_symlink() and (ro / "t.out").read_text() == "complete\n"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("note: HPL.out ") and "in place" in err[0]
    assert sorted(p.name for p in ro.iterdir()) == ["t.out"]


def test_full_device_is_one_line(tmp_path):
    """A write that fails (a full disk: a mknod'd (1, 7)) is an OutputError naming the
    path and the reason; the device is left as it was."""
    full = _node(tmp_path / "full", 7)
    with pytest.raises(outputs.OutputError, match=rf"^--json {full}: cannot write: "
                                                  "no space left on device$"):
        outputs.write_atomic(full, "x" * 100, "--json")
    assert _is_chr(full)


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    """A writer killed mid-write (kill -9) leaves its temporary; the next writer of the
    same file removes it, and keeps a live writer's and other files'."""
    path = tmp_path / "HPL.out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = outputs._host()
    stale = tmp_path / f".HPL.out.{host}.{dead}.abc123.tmp"
    live = tmp_path / f".HPL.out.{host}.{os.getppid()}.def456.tmp"
    other_host = tmp_path / f".HPL.out.elsewhere.{dead}.ghi789.tmp"
    other_file = tmp_path / f".r.json.{host}.{dead}.jkl012.tmp"
    for p in (stale, live, other_host, other_file):
        p.write_text("half")
    outputs.check_writable(str(path), "out")
    assert not stale.exists() and live.exists() and other_host.exists() and other_file.exists()
    stale.write_text("half")
    with outputs.AtomicText(str(path)) as out:
        out.write("done\n")
    assert not stale.exists() and path.read_text() == "done\n"
    # the lock holder knows no other job writes the file: every temporary of it is stale,
    # another host's and an older version's unnamed one too; other files' stay
    legacy = tmp_path / ".HPL.out.k3j_x9q2.tmp"
    legacy.write_text("half")
    live.write_text("half")  # this host, a live pid that is not a writer (the lock says so)
    with outputs.OutputLock(str(path), "out"):
        assert not legacy.exists() and not other_host.exists() and other_file.exists()
        assert live.exists()  # a live process of this host is never guessed at


def test_check_on_root_refuses_on_every_rank(tmp_path):
    """What mpirun-run benchmarks call before measuring: rank 0's verdict, everywhere."""
    from hpcmac.comm.local import LocalGroup

    outputs.check_on_root(LocalGroup(), str(tmp_path / "r.json"), "--json")
    outputs.check_on_root(LocalGroup(), None, "--json")
    with pytest.raises(UsageError, match="^--json .*: cannot write: it is a directory$"):
        outputs.check_on_root(LocalGroup(), str(tmp_path), "--json")


def test_closed_standard_output_is_a_quiet_exit(tmp_path):
    """`cmd | head`: the reader goes away; the command leaves as a SIGPIPE'd tool does
    (exit 141, nothing on stderr), not with a BrokenPipeError traceback."""
    code = ("from hpcmac.lifecycle import run_cli\n"
            "def main(argv):\n"
            "    for _ in range(10**6):\n"
            "        print('x' * 100)\n"
            "raise SystemExit(run_cli(main))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and err == "", err


@pytest.mark.parametrize("name", ["/dev/stdout", "/dev/fd/1", "-"])
def test_standard_output_by_any_name_is_written_through(tmp_path, name):
    """`--json /dev/stdout > out.txt`: the JSON follows what the process printed, in the
    same file (neither truncated by a second open nor renamed over the shell's file)."""
    out = tmp_path / "out.txt"
    code = ("from hpcmac.io.outputs import write_atomic\n"
            "print('printed first', flush=True)\n"
            f"write_atomic({name!r}, '[1, 2]\\n', '--json')\n"
            "print('printed after')\n")
    with open(out, "w") as fh:
        ino = os.fstat(fh.fileno()).st_ino
        subprocess.run([sys.executable, "-c", code], stdout=fh, check=True, timeout=60)
    assert out.read_text() == "printed first\n[1, 2]\nprinted after\n"
    assert out.stat().st_ino == ino
