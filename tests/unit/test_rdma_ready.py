"""RDMA readiness verdicts from recorded command outputs (fixtures/rdma, data/launch).

Every variant a Mac is known to print is parsed to the right verdict, and each
refusal names the host, the port and why.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcmac.comm import rdma_ready as rr

FIX = Path(__file__).parent / "fixtures" / "rdma"
STUDIO = Path(__file__).parent / "data" / "launch" / "studio4"


def read(name: str) -> str:
    return (FIX / name).read_text()


@pytest.mark.parametrize("text,verdict", [
    (read("rdma_ctl_status_enabled.txt"), True),
    (read("rdma_ctl_status_disabled.txt"), False),
    (read("rdma_ctl_status_not_enabled.txt"), False),  # once read as enabled
    ("RDMA is enabled\n", True),
    ("", None),
    (None, None),
    ("usage: rdma_ctl [enable|disable|status]\n", None),
    ("zsh: command not found: rdma_ctl\n", None),
])
def test_rdma_ctl_variants(text, verdict):
    assert rr.parse_rdma_ctl(text) is verdict


@pytest.mark.parametrize("name,devices", [
    ("ibv_devices_5ports.txt", [f"rdma_en{i}" for i in range(2, 7)]),
    ("ibv_devices_none.txt", []),
    ("ibv_devices_no_devices.txt", []),  # once a device named "No"
])
def test_ibv_devices_variants(name, devices):
    assert rr.parse_ibv_devices(read(name)) == devices


def test_ibv_devinfo_port_states():
    states = rr.parse_ibv_devinfo(read("ibv_devinfo_studio_en3_en4_en5_active.txt"))
    assert states == {"rdma_en2": "PORT_DOWN", "rdma_en3": "PORT_ACTIVE",
                      "rdma_en4": "PORT_ACTIVE", "rdma_en5": "PORT_ACTIVE",
                      "rdma_en6": "PORT_DOWN", "rdma_en7": "PORT_DOWN"}
    assert rr.parse_ibv_devinfo(read("ibv_devinfo_none.txt")) == {}


def test_thunderbolt_speed_and_model_decide_which_ports_can_do_rdma():
    hp = rr.parse_hardware_ports((STUDIO / "mac1.ports.txt").read_text())
    ports = {p.iface: p for p in rr.parse_thunderbolt(
        (STUDIO / "mac1.thunderbolt.json").read_text(), hp)}
    assert ports["en3"].speed_gbps == 120 and ports["en3"].model == "Mac Studio"
    assert rr.port_cannot_rdma(ports["en3"]) == ""
    assert "next to the Ethernet jack" in rr.port_cannot_rdma(ports["en2"])
    mini = rr.parse_thunderbolt(read("thunderbolt_macmini_tb4.json"),
                                rr.parse_hardware_ports(read("ports_macmini.txt")))
    assert [(p.iface, p.speed_gbps) for p in mini] == [("en2", 40.0), ("en3", 40.0)]
    # a Mac mini's en2 is not the Studio's: refused for its 40 Gb/s, not its name
    assert "40 Gb/s (a Thunderbolt 4 port" in rr.port_cannot_rdma(mini[0])
    with pytest.raises(rr.ProfilerError):
        rr.parse_thunderbolt("not json", hp)


def test_ifconfig_and_sw_vers():
    ifs = rr.parse_ifconfig(read("ifconfig_studio.txt"))
    assert ifs["en3"].ipv4 == ("10.77.12.1",) and ifs["en3"].mtu == 9000 and ifs["en3"].up
    assert ifs["en4"].ipv4 == () and ifs["en5"].up is False and ifs["bridge0"].active is False
    assert rr.parse_sw_vers(read("sw_vers_26_2.txt"))["BuildVersion"] == "25C56"


def studio_host(**over) -> rr.HostOutputs:
    h = rr.HostOutputs(
        name="mac1", rdma_ctl="enabled\n", ibv_devices=(STUDIO / "mac1.ibv.txt").read_text(),
        ibv_devinfo=read("ibv_devinfo_studio_en3_en4_en5_active.txt"),
        thunderbolt=(STUDIO / "mac1.thunderbolt.json").read_text(),
        hardware_ports=(STUDIO / "mac1.ports.txt").read_text(),
        ifconfig=read("ifconfig_studio.txt"), sw_vers=read("sw_vers_26_2.txt"))
    for k, v in over.items():
        setattr(h, k, v)
    return h


def test_a_ready_mac_has_no_refusal_and_each_fault_names_host_port_and_fix():
    assert rr.host_refusals(studio_host(), [("en3", "10.77.12.1", "rdma_en3")]) == []
    got = rr.host_refusals(studio_host(), [
        ("en2", "10.77.11.1", "rdma_en2"),   # the Studio port beside the Ethernet jack
        ("en4", "10.77.13.1", "rdma_en4"),   # no IPv4 address
        ("en5", "10.77.14.1", "rdma_en5"),   # interface down
        ("en6", "10.77.15.1", "rdma_en6"),   # PORT_DOWN
        ("en3", "10.77.12.1", None),         # no device in the hostfile
    ])
    lines = [r.line() for r in got]
    assert lines[0].startswith("mac1 en2: en2 is the Mac Studio's")
    assert lines[1].startswith("mac1 en4: has no IPv4 address, the hostfile says 10.77.13.1")
    assert "sudo ifconfig en4 inet 10.77.13.1 netmask 255.255.255.252 up" in lines[1]
    assert lines[2].startswith("mac1 en5: the interface is down (fix: sudo ifconfig en5 up)")
    assert lines[3].startswith("mac1 en6: rdma_en6 port state is PORT_DOWN, not PORT_ACTIVE")
    assert lines[4].startswith("mac1 en3: the hostfile names no rdma device")
    assert len(got) == 5


@pytest.mark.parametrize("over,start", [
    ({"rdma_ctl": read("rdma_ctl_status_not_enabled.txt")},
     "mac1 -: RDMA is disabled (rdma_ctl status: 'RDMA is not enabled') (fix: boot into "
     "Recovery"),
    ({"rdma_ctl": None}, "mac1 -: no rdma_ctl: this macOS has no RDMA over Thunderbolt"),
    ({"ibv_devices": read("ibv_devices_no_devices.txt")},
     "mac1 en3: rdma_en3 is not in ibv_devices (none)"),
    ({"ibv_devinfo": read("ibv_devinfo_none.txt")},
     "mac1 en3: rdma_en3 port state is not listed, not PORT_ACTIVE"),
])
def test_host_level_refusals(over, start):
    got = rr.host_refusals(studio_host(**over), [("en3", "10.77.12.1", "rdma_en3")])
    assert got and got[0].line().startswith(start), got


def test_tb4_port_is_refused_even_with_a_device():
    mini = rr.HostOutputs(name="mini", rdma_ctl="enabled", ibv_devices=read(
        "ibv_devices_5ports.txt"), thunderbolt=read("thunderbolt_macmini_tb4.json"),
        hardware_ports=read("ports_macmini.txt"))
    got = rr.host_refusals(mini, [("en2", "10.77.0.1", "rdma_en2")])
    assert len(got) == 1 and got[0].port == "en2" and "40 Gb/s" in got[0].why


def test_macos_builds_must_match():
    hosts = [studio_host(), studio_host(name="mac2"),
             studio_host(name="mac3", sw_vers=read("sw_vers_26_3.txt"))]
    got = rr.cluster_refusals(hosts)
    assert [r.line() for r in got] == [
        "mac3 -: macOS build 25D125 differs from mac1's 25C56 (fix: update every Mac to the "
        "same macOS build (System Settings > Software Update))"]
    assert rr.cluster_refusals(hosts[:2]) == []
