"""The ring transport's listen address comes from the hostfile's cables, not routing luck."""

import socket
from pathlib import Path

import pytest

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


def _hold_run(base: int, n: int):
    socks = [socket.socket() for _ in range(n)]
    for k, s in enumerate(socks):
        s.bind(("127.0.0.1", base + k))
    return socks


def test_free_ports_hands_out_a_run_that_binds_all_at_once():
    base = ring_env.free_ports("127.0.0.1", 4)
    for s in _hold_run(base, 4):   # OSError here: the run was not free
        s.close()


def test_free_ports_skips_a_base_whose_run_is_taken(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        picks = iter([taken - 1, ring_env.free_port("127.0.0.1")])
        monkeypatch.setattr(ring_env, "free_port", lambda ip: next(picks))
        base = ring_env.free_ports("127.0.0.1", 2)
        assert base != taken - 1
        for s in _hold_run(base, 2):
            s.close()


def test_free_ports_gives_up_with_an_oserror(monkeypatch):
    monkeypatch.setattr(ring_env, "free_port", lambda ip: 65535)   # no room for 2 after it
    with pytest.raises(OSError, match="no run of 2 free ports"):
        ring_env.free_ports("127.0.0.1", 2, tries=3)


def test_the_mlx_bench_takes_its_ports_from_ring_env(monkeypatch):
    from hpcmac.bench import llm_mlx

    def none(ip, n):
        raise OSError(f"no run of {n} free ports on {ip} in 50 tries")

    monkeypatch.setattr(llm_mlx, "free_ports", none)
    with pytest.raises(SystemExit, match="error: mlx.launch ports: no run of 3"):
        llm_mlx._starting_port(3)
