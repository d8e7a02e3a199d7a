"""The ring transport's listen address comes from the hostfile's cables, not routing luck."""

from pathlib import Path

from hpcmac.comm import ring_env
from hpcmac.launch.hostfile import load

MESH4 = load(Path(__file__).resolve().parents[2] / "hostfiles" / "mesh-4.json")


def test_a_host_is_found_by_its_link_addresses():
    mine = ["192.168.1.12", "10.77.12.2", "10.77.23.1", "10.77.24.1", "127.0.0.1"]
    assert ring_env.mesh_host(MESH4, mine) == "mac2"
    assert ring_env.mesh_host(MESH4, ["192.168.1.12"]) is None  # management only: unknown
    assert ring_env.mesh_host(MESH4, ["10.77.12.1", "10.77.12.2"]) is None  # ambiguous


def test_listen_address_is_my_end_of_the_cable_to_my_left_neighbour(monkeypatch):
    monkeypatch.delenv("HPCMAC_RING_ADDR", raising=False)
    hosts = ["n1", "n2", "n3", "n4"]
    # every host lists its management address first, and it routes to every peer
    ips = [[f"192.168.1.1{i}", "10.77.0.1"] for i in range(1, 5)]
    mesh = ["mac1", "mac2", "mac3", "mac4"]
    assert ring_env.listen_address(1, hosts, ips, mesh, MESH4) == "10.77.12.2"
    assert ring_env.listen_address(0, hosts, ips, mesh, MESH4) == "10.77.14.1"  # left: mac4
    assert ring_env.mesh_listen_address(MESH4, "mac1", None) is None
    monkeypatch.setenv("HPCMAC_RING_ADDR", "10.9.9.9")
    assert ring_env.listen_address(1, hosts, ips, mesh, MESH4) == "10.9.9.9"
