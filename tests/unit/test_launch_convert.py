"""Conversions for each launcher, checked against the launchers' own readers where they exist."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest

from hpcmac.launch import convert
from hpcmac.launch.hostfile import load, local_cores, parse
from hpcmac.launch.topology import required_routes

HOSTFILES = Path(__file__).resolve().parents[2] / "hostfiles"


@pytest.fixture
def mesh4():
    return load(HOSTFILES / "mesh-4.json")


def test_openmpi_and_mpich_hostfiles(mesh4):
    assert convert.openmpi_hostfile(mesh4).splitlines() == [
        f"mac{i}.local slots=1" for i in range(1, 5)]
    local = load(HOSTFILES / "localhost.json")  # "slots": "auto": this machine's cores
    assert convert.mpich_hostfile(local) == f"localhost:{local_cores()}\n"


def test_mca_keeps_mpi_on_the_mesh_subnets_only(mesh4):
    mca = dict(convert.openmpi_mca(mesh4))
    assert mca["btl"] == "tcp,self"
    assert "oob_tcp_if_include" not in mca  # crashes PRRTE 3 when it matches several interfaces
    cover = ipaddress.ip_network(mca["btl_tcp_if_include"])
    for lk in mesh4.links:
        assert ipaddress.ip_network(lk.subnet).subnet_of(cover)
    for h in mesh4.hosts:  # management (Ethernet) addresses stay out
        assert all(ipaddress.ip_address(ip) not in cover for ip in h.ips)


def test_mca_lists_the_subnets_when_a_cover_would_catch_ethernet(mesh4):
    d = json.loads((HOSTFILES / "mesh-4.json").read_text())
    d["hosts"][0]["ips"] = ["10.77.40.1"]  # Ethernet inside the mesh's covering /18
    value = dict(convert.openmpi_mca(parse(d)))["btl_tcp_if_include"]
    assert value.split(",") == [lk.subnet for lk in mesh4.links]


def test_mlx_ring_hostfile_is_read_by_mlx_and_each_ip_faces_the_left_neighbour(mesh4, tmp_path):
    common = pytest.importorskip("mlx._distributed_utils.common")
    out = convert.mlx_hostfile(mesh4, "ring")
    p = tmp_path / "ring.json"
    p.write_text(json.dumps(out))
    mlx_hf = common.Hostfile.from_file(p)  # MLX's own reader is the oracle for the format
    assert mlx_hf.backend == "ring"
    hosts = mlx_hf.hosts
    by_ssh = {h.ssh: h.name for h in mesh4.hosts}
    for i, h in enumerate(hosts):
        me, left = by_ssh[h.ssh_hostname], by_ssh[hosts[i - 1].ssh_hostname]
        lk = mesh4.link_between(me, left)
        assert h.ips == [lk.end_of(me).addr]
        assert ipaddress.ip_address(h.ips[0]) in ipaddress.ip_network(lk.subnet)


def test_mlx_jaccl_hostfile_matches_the_mlx_example_and_mlx_reads_it(mesh4, tmp_path):
    common = pytest.importorskip("mlx._distributed_utils.common")
    out = convert.mlx_hostfile(mesh4, "jaccl")
    example = json.loads((HOSTFILES / "mlx-jaccl-4.json").read_text())
    assert out["hosts"] == example["hosts"]
    p = tmp_path / "j.json"
    p.write_text(json.dumps(out))
    hosts = common.Hostfile.from_file(p).hosts
    n = len(hosts)
    # the checks mlx.launch's jaccl launcher makes before starting
    assert all(len(h.rdma) == n for h in hosts)
    assert all(h.rdma[i] is None for i, h in enumerate(hosts))
    assert all(h.rdma[j] for i, h in enumerate(hosts) for j in range(n) if i != j)


def test_ibv_matrix_is_symmetric_in_cables_and_round_trips_an_mlx_hostfile(mesh4):
    m = json.loads(convert.ibv_devices_env(mesh4))
    names = mesh4.names
    for i in range(4):
        for j in range(4):
            lk = mesh4.link_between(names[i], names[j])
            assert m[i][j] == (lk.end_of(names[i]).rdma if lk else None)
    mlx_in = load(HOSTFILES / "mlx-jaccl-4.json")
    assert convert.ibv_matrix(mlx_in) == m


def test_required_routes_reach_every_other_address_of_each_peer(mesh4):
    routes = required_routes(mesh4)
    assert len(routes) == 4 * 3 * 2
    for r in routes:
        lk = mesh4.link_between(r.host, r.peer)
        assert r.iface == lk.end_of(r.host).iface
        assert r.addr in [x.end_of(r.peer).addr for x in mesh4.links_of(r.peer) if x is not lk]
    assert routes[0].linux() == "ip route replace 10.77.23.1/32 dev en3"
    assert routes[0].macos() == "sudo route -n add -host 10.77.23.1 -interface en3"


LINUX_TABLE = """\
10.77.12.0/30 dev en3 proto kernel scope link src 10.77.12.1
10.77.13.0/30 dev en4 proto kernel scope link src 10.77.13.1
10.77.14.0/30 dev en5 proto kernel scope link src 10.77.14.1
10.77.23.1 dev en3 scope link
10.77.24.1 dev en3 scope link
10.77.23.2 dev en5 scope link
"""

# netstat -rn -f inet on macOS: abbreviated networks, host routes, link# gateways
MACOS_TABLE = """\
Routing tables

Internet:
Destination        Gateway            Flags               Netif Expire
default            192.168.1.1        UGScg                 en0
10.77.12/30        link#18            UC                    en3      !
10.77.12.2         8e:3a:1f:0:12:2    UHLWIi                en3   1190
10.77.13/30        link#19            UC                    en4      !
10.77.23.1         link#18            UHS                   en3
10.77.24.1         link#18            UHS                   en3
10.77.23.2         link#20            UHS                   en5
127                127.0.0.1          UCS                   lo0
127.0.0.1          127.0.0.1          UH                    lo0
192.168.1          link#11            UCS                   en0      !
"""


@pytest.mark.parametrize("table", [LINUX_TABLE, MACOS_TABLE], ids=["linux", "macos"])
def test_missing_routes_from_a_route_table(mesh4, table):
    missing = convert.missing_routes(mesh4, {"mac1": table})
    assert {r.host for r in missing} == {"mac1"}
    # 6 needed on mac1; 10.77.23.1 and 10.77.24.1 are right; 10.77.23.2 goes out the wrong cable
    assert sorted(r.addr for r in missing) == ["10.77.23.2", "10.77.24.2", "10.77.34.1",
                                               "10.77.34.2"]
    lines = convert.route_commands(missing, "linux")
    assert lines[0] == "# on mac1" and "ip route replace 10.77.23.2/32 dev en4" in lines


def test_route_table_parser_reads_abbreviated_macos_networks():
    rows = dict((str(n), d) for n, d in convert.parse_route_table(MACOS_TABLE))
    assert rows["10.77.12.0/30"] == "en3"
    assert rows["10.77.12.2/32"] == "en3"
    assert rows["127.0.0.0/8"] == "lo0"
    assert rows["192.168.1.0/24"] == "en0"
    assert convert.route_iface(convert.parse_route_table(MACOS_TABLE), "10.77.12.2") == "en3"


def test_rank_placement_and_memory_share_follow_mpiruns_by_slot_mapping():
    from hpcmac.launch.topology import memory_per_rank, rank_hosts

    d = json.loads((HOSTFILES / "mesh-4-mixed.json").read_text())
    d["hosts"][0]["slots"] = 2
    hf = parse(d)
    assert rank_hosts(hf) == ["mac1", "mac1", "mac2", "mac3", "mac4"]
    assert memory_per_rank(hf) == [256, 256, 512, 256, 256]
    assert rank_hosts(hf, 7)[5:] == ["mac1", "mac1"]  # oversubscribed: wraps around


def test_mlx_launch_needs_addresses(tmp_path):
    from hpcmac.errors import UsageError
    from hpcmac.launch import runner

    d = json.loads((HOSTFILES / "mesh-2.json").read_text())
    d["hosts"][0]["ips"] = []
    hf = parse(d, "h.json")
    with pytest.raises(UsageError, match="host 'mac1': field 'ips' is needed for --backend jaccl"):
        runner.plan(hf, ["x"], runner.Options(via="mlx"), str(tmp_path))
    runner.plan(hf, ["x"], runner.Options(via="mlx", backend="ring"), str(tmp_path))  # links
    d.pop("links")
    with pytest.raises(UsageError, match="field 'ips' is needed for --backend ring"):
        runner.plan(parse(d, "h.json"), ["x"], runner.Options(via="mlx", backend="ring"),
                    str(tmp_path))


def test_ibv_rank_matrix_follows_rank_placement():
    d = json.loads((HOSTFILES / "mesh-2.json").read_text())
    d["hosts"][0]["slots"] = 2
    hf = parse(d)
    assert convert.ibv_rank_matrix(hf) == [[None, None, "rdma_en3"],
                                           [None, None, "rdma_en3"],
                                           ["rdma_en3", "rdma_en3", None]]
    assert convert.ibv_rank_matrix(hf, 2) == [[None, None], [None, None]]  # both on mac1
    one_each = load(HOSTFILES / "mesh-4.json")
    assert convert.ibv_rank_matrix(one_each) == convert.ibv_matrix(one_each)
