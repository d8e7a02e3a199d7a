"""Discovery parsing and planning on command outputs in their recorded formats (data/launch)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from hpcmac.comm import rdma_ready
from hpcmac.errors import UsageError
from hpcmac.launch import discover
from hpcmac.launch.hostfile import parse, validate
from hpcmac.launch.topology import is_full_mesh

DATA = Path(__file__).parent / "data" / "launch" / "mesh3"
STUDIO4 = Path(__file__).parent / "data" / "launch" / "studio4"
NAMES = ["mac1", "mac2", "mac3"]
SUFFIXES = [("thunderbolt", "thunderbolt.json"), ("ports", "ports.txt"), ("ibv", "ibv.txt"),
            ("ibv_devinfo", "ibv_devinfo.txt"), ("rdma_ctl", "rdma_ctl.txt"),
            ("memsize", "memsize.txt"), ("en0", "en0.txt")]


def probe(name: str, data: Path = DATA, **override) -> discover.Probe:
    out = {k: (data / f"{name}.{suffix}").read_text() for k, suffix in SUFFIXES}
    out.update(override)
    return discover.Probe(name=name, **out)


def test_thunderbolt_ports_and_their_peers():
    hp = rdma_ready.parse_hardware_ports((DATA / "mac2.ports.txt").read_text())
    ports = rdma_ready.parse_thunderbolt((DATA / "mac2.thunderbolt.json").read_text(), hp)
    assert [p.iface for p in ports] == [f"en{i}" for i in range(2, 8)]
    cabled = [p for p in ports if p.peer_uuid]
    assert [p.iface for p in cabled] == ["en2", "en3"]  # the SSD on port 5 is no peer
    with pytest.raises(UsageError, match="mac9: system_profiler output"):
        discover.plan_hostfile([probe("mac1"), discover.Probe("mac9", "not json", "")])


def test_memsize_and_management_address():
    assert discover.parse_memsize("274877906944\n") == 256.0
    assert probe("mac1").management_ip() == "192.168.1.11"
    assert probe("mac1", en0="", en1="10.0.0.5\n").management_ip() == "10.0.0.5"
    assert discover.Probe("192.168.7.7", "", "").management_ip() == "192.168.7.7"
    assert probe("mac1", en0="", en1="").management_ip() is None


def test_plan_finds_the_full_mesh_gives_a_30_per_cable_and_validates():
    data, warnings = discover.plan_hostfile([probe(n) for n in NAMES])
    hf = parse(data, "<discovered>")
    assert validate(hf) == []
    assert is_full_mesh(hf) and data["topology"] == "mesh"
    assert len(hf.links) == 3
    nets = [ipaddress.ip_network(lk.subnet) for lk in hf.links]
    assert all(n.prefixlen == 30 for n in nets) and len(set(nets)) == 3
    # the cabling written in data/launch/README.md
    expect = {("mac1", "mac2"): ("en2", "en2"), ("mac1", "mac3"): ("en3", "en2"),
              ("mac2", "mac3"): ("en3", "en3")}
    for (a, b), (ia, ib) in expect.items():
        lk = hf.link_between(a, b)
        assert (lk.end_of(a).iface, lk.end_of(b).iface) == (ia, ib)
    # mac3 has RDMA disabled: its ends carry no device; mac1 and mac2 are cabled on
    # en2, the Mac Studio port next to the Ethernet jack: no device there either
    for lk in hf.links:
        for e in lk.ends:
            assert e.rdma == (None if e.host == "mac3" or e.iface == "en2"
                              else f"rdma_{e.iface}")
    assert "backend" not in data
    assert any("mac3: RDMA disabled" in w for w in warnings)
    assert "mac1 en2: en2 is the Mac Studio's Thunderbolt port next to the Ethernet jack, " \
        "which cannot do RDMA; this cable carries TCP only" in warnings
    assert [h.memory_gb for h in hf.hosts] == [512, 512, 256]
    assert [h.ips for h in hf.hosts] == [("192.168.1.11",), ("192.168.1.12",),
                                         ("192.168.1.13",)]


def test_studio_cluster_cabled_off_en2_gets_jaccl_everywhere():
    names = ["mac1", "mac2", "mac3", "mac4"]
    data, warnings = discover.plan_hostfile([probe(n, STUDIO4) for n in names])
    assert warnings == []
    hf = parse(data)
    assert validate(hf) == [] and is_full_mesh(hf) and data["backend"] == "jaccl"
    assert sorted({e.iface for lk in hf.links for e in lk.ends}) == ["en3", "en4", "en5"]


def test_a_port_that_is_down_or_slow_gets_no_device():
    down = (STUDIO4 / "mac1.ibv_devinfo.txt").read_text().replace(
        "PORT_ACTIVE (4)", "PORT_DOWN (1)", 1)
    data, warnings = discover.plan_hostfile(
        [probe("mac1", STUDIO4, ibv_devinfo=down)] + [probe(n, STUDIO4)
                                                      for n in ("mac2", "mac3", "mac4")])
    assert "backend" not in data
    assert warnings == ["mac1 en3: rdma_en3 port is PORT_DOWN, not PORT_ACTIVE; this cable "
                        "carries TCP only"]
    tb4 = (STUDIO4 / "mac2.thunderbolt.json").read_text().replace(
        "Up to 120 Gb/s", "40 Gb/s", 1)
    _, warnings = discover.plan_hostfile(
        [probe("mac1", STUDIO4), probe("mac2", STUDIO4, thunderbolt=tb4)])
    assert len(warnings) == 1 and warnings[0].startswith(
        "mac2 en3: Thunderbolt port 2 runs at 40 Gb/s (a Thunderbolt 4 port or cable)")


def test_a_missing_cable_is_a_warning_and_not_a_mesh():
    # unplug mac2-mac3 on both ends: mac2 sees no peer on port 2
    import json

    tb = json.loads((DATA / "mac2.thunderbolt.json").read_text())
    tb["SPThunderboltDataType"][1].pop("_items")
    data, warnings = discover.plan_hostfile(
        [probe("mac1"), probe("mac2", thunderbolt=json.dumps(tb)), probe("mac3")])
    # mac3 still sees mac2's port, so the cable is found from that side
    assert len(data["links"]) == 3
    tb3 = json.loads((DATA / "mac3.thunderbolt.json").read_text())
    tb3["SPThunderboltDataType"][1].pop("_items")
    data, warnings = discover.plan_hostfile(
        [probe("mac1"), probe("mac2", thunderbolt=json.dumps(tb)),
         probe("mac3", thunderbolt=json.dumps(tb3))])
    assert len(data["links"]) == 2 and data["topology"] == "ring"
    assert any("2 of 3 host pairs are cabled" in w for w in warnings)


def test_setup_commands_give_addresses_mtu_and_routes_now_and_after_a_reboot():
    probes = [probe(n) for n in NAMES]
    data, _ = discover.plan_hostfile(probes)
    cmds = discover.setup_commands(data, discover.services(probes))
    assert cmds["mac1"][:2] == [
        "sudo networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' off",
        "sudo ifconfig bridge0 down"]
    hf = parse(data)
    lk = hf.link_between("mac1", "mac2")
    e = lk.end_of("mac1")
    assert f"sudo ifconfig {e.iface} inet {e.addr} netmask 255.255.255.252 mtu 9000 up" \
        in cmds["mac1"]
    assert f"sudo networksetup -setmanual 'Thunderbolt 1' {e.addr} 255.255.255.252" \
        in cmds["mac1"]
    assert f"sudo networksetup -setMTU {e.iface} 9000" in cmds["mac1"]
    other = hf.link_between("mac2", "mac3").end_of("mac2").addr
    assert f"sudo route -n add -host {other} -interface {e.iface}" in cmds["mac1"]
    gw = lk.end_of("mac2").addr
    assert f"sudo networksetup -setadditionalroutes 'Thunderbolt 1' {other} 255.255.255.255 " \
        f"{gw}" in cmds["mac1"]
    assert sum("route -n add" in c for c in cmds["mac1"]) == 2


def test_collect_runs_every_command_through_the_given_ssh(tmp_path):
    # a stand-in ssh that answers from the recorded outputs
    fake = tmp_path / "fake-ssh"
    fake.write_text(f"""#!/bin/sh
host=$1; shift
case "$1" in
  system_profiler) cat {DATA}/$host.thunderbolt.json ;;
  networksetup) cat {DATA}/$host.ports.txt ;;
  ibv_devices) cat {DATA}/$host.ibv.txt ;;
  ibv_devinfo) cat {DATA}/$host.ibv_devinfo.txt ;;
  rdma_ctl) cat {DATA}/$host.rdma_ctl.txt ;;
  sysctl) cat {DATA}/$host.memsize.txt ;;
  ipconfig) cat {DATA}/$host.$3.txt 2>/dev/null || exit 1 ;;
esac
""")
    fake.chmod(0o755)
    got = discover.collect("mac1", [str(fake)])
    assert got == probe("mac1")
    with pytest.raises(UsageError, match="mac9: system_profiler"):
        discover.collect("mac9", [str(fake)])
