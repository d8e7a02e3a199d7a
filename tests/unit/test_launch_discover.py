"""Discovery parsing and planning on command outputs in their recorded formats (data/launch)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.launch import discover
from hpcmac.launch.hostfile import parse, validate
from hpcmac.launch.topology import is_full_mesh

DATA = Path(__file__).parent / "data" / "launch" / "mesh3"
NAMES = ["mac1", "mac2", "mac3"]


def probe(name: str, **override) -> discover.Probe:
    out = {k: (DATA / f"{name}.{suffix}").read_text() for k, suffix in [
        ("thunderbolt", "thunderbolt.json"), ("ports", "ports.txt"), ("ibv", "ibv.txt"),
        ("rdma_ctl", "rdma_ctl.txt"), ("memsize", "memsize.txt")]}
    out.update(override)
    return discover.Probe(name=name, **out)


def test_hardware_ports():
    ports = discover.parse_hardware_ports((DATA / "mac1.ports.txt").read_text())
    assert ports["Ethernet"] == "en0" and ports["Thunderbolt Bridge"] == "bridge0"
    assert [ports[f"Thunderbolt {i}"] for i in range(1, 7)] == [f"en{i}" for i in range(2, 8)]


def test_thunderbolt_ports_and_their_peers():
    hp = discover.parse_hardware_ports((DATA / "mac2.ports.txt").read_text())
    ports = discover.parse_thunderbolt((DATA / "mac2.thunderbolt.json").read_text(), hp)
    assert [p.iface for p in ports] == [f"en{i}" for i in range(2, 8)]
    cabled = [p for p in ports if p.peer_uuid]
    assert [p.iface for p in cabled] == ["en2", "en3"]  # the SSD on port 5 is no peer
    with pytest.raises(UsageError, match="mac9: system_profiler output"):
        discover.parse_thunderbolt("not json", hp, "mac9: ")


def test_ibv_rdma_ctl_memsize():
    assert discover.parse_ibv_devices((DATA / "mac1.ibv.txt").read_text()) == [
        f"rdma_en{i}" for i in range(2, 8)]
    assert discover.parse_ibv_devices((DATA / "mac3.ibv.txt").read_text()) == []
    assert discover.parse_rdma_ctl("enabled\n") is True
    assert discover.parse_rdma_ctl("disabled\n") is False
    assert discover.parse_rdma_ctl("") is None
    assert discover.parse_memsize("274877906944\n") == 256.0


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
    # mac3 has RDMA disabled: its ends carry no device, the others do
    for lk in hf.links:
        for e in lk.ends:
            assert e.rdma == (None if e.host == "mac3" else f"rdma_{e.iface}")
    assert "backend" not in data
    assert any("mac3: RDMA disabled" in w for w in warnings)
    assert [h.memory_gb for h in hf.hosts] == [512, 512, 256]


def test_plan_with_rdma_everywhere_chooses_jaccl():
    p3 = probe("mac3", ibv=(DATA / "mac1.ibv.txt").read_text(), rdma_ctl="enabled\n")
    data, warnings = discover.plan_hostfile([probe("mac1"), probe("mac2"), p3])
    assert data["backend"] == "jaccl" and warnings == []


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


def test_setup_commands_give_addresses_and_routes():
    data, _ = discover.plan_hostfile([probe(n) for n in NAMES])
    cmds = discover.setup_commands(data)
    assert cmds["mac1"][0] == "sudo ifconfig bridge0 down"
    hf = parse(data)
    lk = hf.link_between("mac1", "mac2")
    e = lk.end_of("mac1")
    assert f"sudo ifconfig {e.iface} inet {e.addr} netmask 255.255.255.252 up" in cmds["mac1"]
    other = hf.link_between("mac2", "mac3").end_of("mac2").addr
    assert f"sudo route -n add -host {other} -interface {e.iface}" in cmds["mac1"]
    assert sum("route" in c for c in cmds["mac1"]) == 2


def test_collect_runs_every_command_through_the_given_ssh(tmp_path):
    # a stand-in ssh that answers from the recorded outputs
    fake = tmp_path / "fake-ssh"
    fake.write_text(f"""#!/bin/sh
host=$1; shift
case "$1" in
  system_profiler) cat {DATA}/$host.thunderbolt.json ;;
  networksetup) cat {DATA}/$host.ports.txt ;;
  ibv_devices) cat {DATA}/$host.ibv.txt ;;
  rdma_ctl) cat {DATA}/$host.rdma_ctl.txt ;;
  sysctl) cat {DATA}/$host.memsize.txt ;;
esac
""")
    fake.chmod(0o755)
    got = discover.collect("mac1", [str(fake)])
    assert got == probe("mac1")
    with pytest.raises(UsageError, match="mac9: system_profiler"):
        discover.collect("mac9", [str(fake)])
