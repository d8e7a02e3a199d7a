"""The launcher CLI: argument lists, bad input, and real local jobs under mpirun."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcmac.launch.hostfile import local_cores

ROOT = Path(__file__).resolve().parents[2]
HOSTFILES = ROOT / "hostfiles"
LOCAL = str(HOSTFILES / "localhost.json")
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "OMP_NUM_THREADS": "1"}


def cli(*args, timeout=60, **kw):
    return subprocess.run([PY, "-m", "hpcmac.launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT, **kw)


@pytest.fixture
def fake_mpirun(tmp_path):
    """An mpirun that only records that it was started."""
    marker = tmp_path / "launched"
    p = tmp_path / "mpirun"
    p.write_text(f"#!/bin/sh\necho \"$@\" > {marker}\n")
    p.chmod(0o755)
    return p, marker


def test_dry_run_prints_the_argument_list_and_the_generated_hostfile():
    res = cli("--hostfile", str(HOSTFILES / "mesh-4.json"), "--dry-run", "--np", "4",
              "--env", "A=b c", "--", "python", "-m", "hpcmac", "info", "--x=$(rm -rf /)")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert cmd[0].endswith("mpirun")
    i = cmd.index("--")
    # verbatim, with a bare "python" made the launching interpreter
    assert cmd[i + 1:] == [PY, "-m", "hpcmac", "info", "--x=$(rm -rf /)"]
    assert cmd[cmd.index("-np") + 1] == "4"
    assert ["--mca", "btl_tcp_if_include", "10.77.0.0/18"] == cmd[
        cmd.index("btl_tcp_if_include") - 1:cmd.index("btl_tcp_if_include") + 2]
    assert "A=b c" in cmd
    ibv = next(a for a in cmd if a.startswith("HPCMAC_IBV_DEVICES="))
    assert json.loads(ibv.split("=", 1)[1])[0] == [None, "rdma_en3", "rdma_en4", "rdma_en5"]
    assert "#   mac1.local slots=1" in res.stdout


def test_dry_run_via_mlx_writes_mlx_hostfile(tmp_path):
    res = cli("--hostfile", str(HOSTFILES / "mesh-3.json"), "--via", "mlx", "--backend",
              "ring", "--dry-run", "--", "python", "x.py")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert cmd[0].endswith("mlx.launch") and cmd[-2:] == ["--", "x.py"]
    # the bare "python" becomes this interpreter's path, which mlx.launch runs on each host
    assert cmd[cmd.index("--python") + 1] == sys.executable
    assert '"backend": "ring",' in res.stdout
    d = json.loads((HOSTFILES / "mesh-3.json").read_text())
    d["hosts"][1]["python"] = "/opt/py/bin/python3"
    f = tmp_path / "py.json"
    f.write_text(json.dumps(d))
    res = cli("--hostfile", str(f), "--via", "mlx", "--dry-run", "--", "python", "x.py")
    assert res.returncode == 2 and "host 'mac2': field 'python' is /opt/py/bin/python3 but " \
        f"host 'mac1' runs {sys.executable} (no 'python' field: the launcher's)" in res.stderr
    for h in d["hosts"]:
        h["python"] = "/opt/py/bin/python3"
    f.write_text(json.dumps(d))
    res = cli("--hostfile", str(f), "--via", "mlx", "--backend", "ring", "--dry-run", "--",
              "python3", "x.py")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert cmd[cmd.index("--python") + 1] == "/opt/py/bin/python3"
    d["hosts"][2]["python"] = "python3 -c evil"
    f.write_text(json.dumps(d))
    res = cli("--hostfile", str(f), "--via", "mlx", "--dry-run", "--", "python", "x.py")
    assert res.returncode == 2 and "host 'mac3': field 'python' must be an absolute path" \
        in res.stderr


@pytest.mark.parametrize("content,expect", [
    ("{not json", "not JSON"),
    ('{"hosts": [{"ssh": "a"}], "links": []}', "missing field 'name'"),
    ('{"hosts": [{"name": "a;rm -rf /"}]}', "field 'name'"),
    (None, "not a full mesh"),
    (None, "duplicates"),
])
def test_bad_hostfile_is_one_line_exit_2_and_nothing_launched(tmp_path, fake_mpirun,
                                                              content, expect):
    if content is None:
        d = json.loads((HOSTFILES / "mesh-3.json").read_text())
        if expect == "not a full mesh":
            d["links"].pop()
        else:
            d["links"][0]["ends"][1]["addr"] = d["links"][0]["ends"][0]["addr"]
        content = json.dumps(d)
    hf = tmp_path / "h.json"
    hf.write_text(content)
    mpirun, marker = fake_mpirun
    res = cli("--hostfile", str(hf), "--mpirun", str(mpirun), "--", "true")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {hf}: ") and expect in lines[0]
    assert "Traceback" not in res.stderr
    assert not marker.exists()


@pytest.mark.parametrize("args,expect", [
    (["--np", "999"], f"more than the {local_cores()} slots"),
    (["--via", "nope"], "invalid choice"),
    (["--env", "NOEQUALS"], "expected KEY=VALUE"),
    (["--env", "K=a\nb"], "the value has a control character"),
    ([], None),  # no command
])
def test_bad_options_are_one_line_exit_2(fake_mpirun, args, expect):
    mpirun, marker = fake_mpirun
    tail = ["--", "true"] if expect else []
    res = cli("--hostfile", LOCAL, "--mpirun", str(mpirun), *args, *tail)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert (expect or "no command") in res.stderr
    assert not marker.exists()


def test_fake_mpirun_gets_an_argument_list(fake_mpirun):
    mpirun, marker = fake_mpirun
    res = cli("--hostfile", LOCAL, "--mpirun", str(mpirun), "--np", "2", "--", "echo", "a b")
    assert res.returncode == 0, res.stderr
    assert marker.read_text().split()[-3:] == ["--", "echo", "a", "b"][-3:]


# ------------------------------------------------------------ real local jobs

RANK = "int(__import__('os').environ['OMPI_COMM_WORLD_RANK'])"


def test_real_job_returns_its_exit_code():
    code = f"import sys; sys.exit(3 if {RANK} == 0 else 0)"
    res = cli("--hostfile", LOCAL, "--np", "2", "--", PY, "-c", code, timeout=90)
    assert res.returncode == 3, res.stderr
    ok = cli("--hostfile", LOCAL, "--np", "2", "--", PY, "-c", "pass", timeout=90)
    assert ok.returncode == 0, ok.stderr


def _pids_alive(pids):
    """The pids still running (a zombie waiting for init to reap it has ended)."""
    alive = []
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" not in status:
            alive.append(p)
    return alive


def test_one_rank_failing_ends_every_rank(tmp_path):
    code = (f"import os, time, sys; r = {RANK}; "
            f"open('{tmp_path}/pid%d' % r, 'w').write(str(os.getpid())); "
            "time.sleep(0.5) if r == 1 else time.sleep(60); sys.exit(5 if r == 1 else 0)")
    t0 = time.monotonic()
    res = cli("--hostfile", LOCAL, "--np", "2", "--", PY, "-c", code, timeout=90)
    assert res.returncode != 0
    assert time.monotonic() - t0 < 30
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    assert len(pids) == 2 and _pids_alive(pids) == []
    assert "exit code" in res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_and_nothing_is_left(tmp_path, sig):
    code = (f"import os, time; open('{tmp_path}/pid%d' % {RANK}, 'w')"
            ".write(str(os.getpid())); time.sleep(60)")
    p = subprocess.Popen([PY, "-m", "hpcmac.launch", "--hostfile", LOCAL, "--np", "2", "--",
                          PY, "-c", code], env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 40
    while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    pids = [int(f.read_text()) for f in tmp_path.glob("pid*")]
    assert len(pids) == 2
    t0 = time.monotonic()
    p.send_signal(sig)
    _, err = p.communicate(timeout=30)
    assert time.monotonic() - t0 < 15
    assert p.returncode != 0
    time.sleep(0.2)
    assert _pids_alive(pids) == []


def test_timeout_stops_the_job_with_124():
    res = cli("--hostfile", LOCAL, "--np", "2", "--timeout", "3", "--", PY, "-c",
              "import time; time.sleep(60)", timeout=60)
    assert res.returncode == 124
    assert "exceeded --timeout 3 s" in res.stderr


def test_selftest_passes_on_two_local_ranks():
    res = cli("--hostfile", LOCAL, "--np", "2", "--", PY, "-m", "hpcmac.launch.selftest",
              "--mib", "1", timeout=90)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1].endswith("PASSED")


def test_check_convert_and_discover_commands(tmp_path):
    res = cli("check", "--hostfile", str(HOSTFILES / "mesh-4.json"))
    assert res.returncode == 0 and "4 hosts, 4 slots, 6 links, full mesh" in res.stdout
    res = cli("convert", "--hostfile", str(HOSTFILES / "mesh-2.json"), "--to", "mpich")
    assert res.stdout == "mac1.local:1\nmac2.local:1\n"
    data = Path(__file__).parent / "data" / "launch" / "mesh3"
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\nhost=$1; shift\ncase \"$1\" in\n"
                    f"  system_profiler) cat {data}/$host.thunderbolt.json ;;\n"
                    f"  networksetup) cat {data}/$host.ports.txt ;;\n"
                    f"  ibv_devices) cat {data}/$host.ibv.txt ;;\n"
                    f"  ibv_devinfo) cat {data}/$host.ibv_devinfo.txt ;;\n"
                    f"  ipconfig) cat {data}/$host.$3.txt 2>/dev/null || exit 1 ;;\n"
                    f"  rdma_ctl) cat {data}/$host.rdma_ctl.txt ;;\n"
                    f"  sysctl) cat {data}/$host.memsize.txt ;;\nesac\n")
    fake.chmod(0o755)
    (tmp_path / "shared").mkdir()  # the output: a symlink into a shared folder, written through
    out = tmp_path / "found.json"
    out.symlink_to(tmp_path / "shared" / "mesh.json")
    res = cli("discover", "mac1", "mac2", "mac3", "--ssh", str(fake), "-o", str(out),
              "--print-setup")
    assert res.returncode == 0, res.stderr
    assert out.is_symlink() and (tmp_path / "shared" / "mesh.json").stat().st_size > 0
    to_dir = cli("discover", "mac1", "--ssh", str(tmp_path / "no-ssh"), "-o", str(tmp_path))
    assert to_dir.returncode == 2 and to_dir.stderr.strip().splitlines() == [
        f"error: --output {tmp_path}: cannot write: it is a directory"]  # before any ssh
    assert "# on mac3" in res.stdout and "netmask 255.255.255.252" in res.stdout
    assert "warning: mac3: RDMA disabled" in res.stderr
    chk = cli("check", "--hostfile", str(out))
    assert chk.returncode == 0 and "3 links, full mesh" in chk.stdout
    bad = cli("discover", "a;reboot", "--ssh", str(fake))
    assert bad.returncode == 2 and "shell metacharacters" in bad.stderr
    bad = cli("discover", "u=1,x:/@mac1", "--ssh", str(fake))
    assert bad.returncode == 2 and "expected host or user@host" in bad.stderr


def test_env_given_on_the_command_line_wins_over_the_hostfile_once():
    res = cli("--hostfile", str(HOSTFILES / "mesh-2.json"), "--dry-run", "--transport", "mpi",
              "--env", "HPCMAC_HOSTFILE=", "--env", "HPCMAC_TRANSPORT=ring", "--", "true")
    assert res.returncode == 0, res.stderr
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    xs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert [x for x in xs if x.startswith("HPCMAC_HOSTFILE")] == ["HPCMAC_HOSTFILE="]
    assert [x for x in xs if x.startswith("HPCMAC_TRANSPORT=")] == ["HPCMAC_TRANSPORT=ring"]
