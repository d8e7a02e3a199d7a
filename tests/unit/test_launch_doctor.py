"""``launch doctor``'s verdicts on recorded macOS outputs (the Mac side cannot run here;
tests/cluster/test_doctor.py runs the Linux side for real on the namespace mesh).

The reports are assembled from the recorded outputs in fixtures/rdma and data/launch
(hand-written in the commands' formats, see their READMEs), labelled as such.
"""

from __future__ import annotations

from pathlib import Path

from hpcmac.launch import doctor
from hpcmac.launch.hostfile import load

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures" / "rdma"
STUDIO = Path(__file__).parent / "data" / "launch" / "studio4"
MESH2 = load(ROOT / "hostfiles" / "mesh-2.json")  # mac1 en3 10.77.12.1 <-> mac2 en3 .2
PY = "/opt/homebrew/bin/python3"


def read(name: str) -> str:
    return (FIX / name).read_text()


def mac_report(name: str, **over) -> dict[str, str]:
    """A recorded macOS report as probe_script's sections would hold it."""
    ifconfig = read("ifconfig_studio.txt")
    if name == "mac2":
        ifconfig = ifconfig.replace("10.77.12.1 netmask", "10.77.12.2 netmask")
    text = "\n".join([
        "@@@ os", "Darwin", "@@@ sw_vers", read("sw_vers_26_2.txt").rstrip(),
        "@@@ python_path", PY,
        "@@@ versions", "python 3.12.8", "hpcmac 0.1.0", "mlx 0.32.4", "numpy 2.2.1",
        "@@@ openmpi", "mpirun (Open MPI) 5.0.11",
        "@@@ ifconfig", ifconfig.rstrip(),
        "@@@ rdma_ctl", "enabled",
        "@@@ ibv_devices", (STUDIO / "mac1.ibv.txt").read_text().rstrip(),
        "@@@ ibv_devinfo", read("ibv_devinfo_studio_en3_en4_en5_active.txt").rstrip(),
        "@@@ thunderbolt", (STUDIO / "mac1.thunderbolt.json").read_text().rstrip(),
        "@@@ ports", (STUDIO / "mac1.ports.txt").read_text().rstrip(),
        "@@@ memory", read("vm_stat.txt").rstrip(),
        f"@@@ ping en3 10.77.12.{2 if name == 'mac1' else 1}",
        read("ping_macos_ok.txt").rstrip(),
    ]) + "\n"
    rep = doctor.parse_report(text)
    rep.update(over)
    return rep


def run(reports, need_gb=None):
    checks = doctor.evaluate(MESH2, reports, {"mac1": PY, "mac2": PY}, need_gb)
    return checks, [c for c in checks if not c.ok]


def test_two_ready_macs_pass_every_check():
    checks, failed = run({"mac1": mac_report("mac1"), "mac2": mac_report("mac2")})
    assert failed == [], doctor.table(checks)
    items = {(c.host, c.item) for c in checks}
    assert {("mac1", "rdma"), ("mac2", "bridge0"), ("all", "macos"), ("all", "mlx"),
            ("mac1", "link mac1-mac2 en3")} <= items
    mem = next(c for c in checks if c.host == "mac1" and c.item == "memory")
    assert mem.detail == "181.0 GiB free"  # (9830400 + 1966080 + 65536) pages x 16 KiB
    link = next(c for c in checks if c.item == "link mac1-mac2 en3" and c.host == "mac1")
    assert link.detail == "10.77.12.1 -> 10.77.12.2: rtt 0.400 ms, loss 0%, mtu 9000"


def test_each_mac_fault_is_one_failure_with_its_fix():
    bridge_up = read("ifconfig_studio.txt").replace("10.77.12.1 netmask", "10.77.12.2 netmask") \
        .replace("bridge0: flags=8822<BROADCAST", "bridge0: flags=8863<UP,BROADCAST") \
        .replace("member: en2", "member: en3")
    reports = {
        "mac1": mac_report("mac1", rdma_ctl=read("rdma_ctl_status_not_enabled.txt")),
        "mac2": mac_report("mac2", sw_vers=read("sw_vers_26_3.txt"), ifconfig=bridge_up,
                           **{"ping en3 10.77.12.1": read("ping_macos_lost.txt")}),
    }
    checks, failed = run(reports, need_gb=200)
    got = {(c.host, c.item): (c.detail, c.fix) for c in failed}
    assert got[("mac1", "rdma -")][0] == "RDMA is disabled (rdma_ctl status: " \
        "'RDMA is not enabled')"
    assert "rdma_ctl enable" in got[("mac1", "rdma -")][1]
    assert got[("mac2", "macos")] == ("macOS build 25D125 differs from mac1's 25C56",
                                      "update every Mac to the same macOS build (System "
                                      "Settings > Software Update)")
    assert got[("mac2", "bridge0")][0] == "Thunderbolt Bridge up, holding en3"
    assert got[("mac2", "bridge0")][1].startswith(
        "sudo networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' off")
    assert got[("mac2", "link mac1-mac2 en3")][0] == "no answer from mac1 (10.77.12.1) over en3"
    assert got[("mac1", "memory")][0] == "181.0 GiB free, the job needs 200 GiB"
    assert len(failed) == 6, doctor.table(checks)  # memory fails on both hosts
    table = doctor.table(checks)
    assert "fix:" in table and table.count("FAIL") == 6


def test_unreachable_host_and_missing_python():
    reports = {"mac1": "ssh failed: ssh: connect to host mac1.local port 22: Connection refused",
               "mac2": mac_report("mac2", python_path="missing\n")}
    checks, failed = run(reports)
    assert [(c.host, c.item) for c in failed] == [("mac1", "ssh"), ("mac2", "python")]
    assert "ssh-copy-id mac1.local" in failed[0].fix
    assert failed[1].detail == f"{PY} is not there"


def test_probe_script_pings_each_cable_from_its_own_address():
    script = doctor.probe_script(MESH2, "mac1", PY)
    assert "ping -c 2 -t 3 -S 10.77.12.1 10.77.12.2" in script  # macOS
    assert "ping -c 2 -i 0.2 -W 1 -I en3 10.77.12.2" in script  # Linux
    assert doctor.parse_ping(read("ping_macos_lost.txt")) == (100.0, None)
