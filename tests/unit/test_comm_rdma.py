"""The rdma transport's pure parts on recorded outputs, and its real refusal on Linux."""

import json
import sys
from pathlib import Path

import pytest

from hpcmac.comm import rdma_env, rdma_ready, ring_env
from hpcmac.comm.mlx import is_available, launched_by_mlx

FIX = Path(__file__).parent / "fixtures" / "rdma"


def read(name: str) -> str:
    return (FIX / name).read_text()


def test_device_matrix_from_mlx_hostfile_path_and_inline():
    m = rdma_env.load_device_matrix(str(FIX / "hostfile_jaccl_4mesh.json"))
    assert m[0] == [None, "rdma_en2", "rdma_en3", "rdma_en4"] and len(m) == 4
    assert rdma_env.check_device_matrix(m, 4) == ""
    inline = rdma_env.load_device_matrix(json.dumps(m))
    assert inline == m
    hosts = json.loads(read("hostfile_jaccl_4mesh.json"))["hosts"]
    hosts_only = rdma_env.load_device_matrix(json.dumps(hosts))
    assert hosts_only == m


def test_device_matrix_several_cables_and_local_devices():
    m = rdma_env.load_device_matrix(str(FIX / "matrix_2node_dual_cable.json"))
    here = rdma_ready.parse_ibv_devices(read("ibv_devices_5ports.txt"))
    assert rdma_env.check_device_matrix(m, 2, rank=0, local_devices=here) == ""
    assert rdma_env.check_device_matrix(m, 2, rank=1, local_devices=["rdma_en5"]) == (
        "rank 1: device rdma_en6 (towards rank 0) not in ibv_devices (rdma_en5)")
    states = rdma_ready.parse_ibv_devinfo(read("ibv_devinfo_studio_en3_en4_en5_active.txt"))
    assert rdma_env.check_device_matrix(
        [[None, "rdma_en3"], ["rdma_en4", None]], 2, 0, here, states) == ""
    assert rdma_env.check_device_matrix(
        [[None, "rdma_en6"], ["rdma_en4", None]], 2, 0, here, states) == (
        "rank 0: device rdma_en6 (towards rank 1) port is PORT_DOWN, not PORT_ACTIVE "
        "(reseat the cable; restart both Macs if it stays down)")


@pytest.mark.parametrize("matrix,size,problem", [
    ("matrix_3node_missing_link.json", 3, "[0][2] is null: ranks 0 and 2 are not cabled"),
    ("hostfile_jaccl_4mesh.json", 2, "has 4 rows for 2 ranks"),
])
def test_device_matrix_problems_are_named(matrix, size, problem):
    m = rdma_env.load_device_matrix(str(FIX / matrix))
    assert problem in rdma_env.check_device_matrix(m, size)


def test_device_matrix_bad_input_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        rdma_env.load_device_matrix(str(tmp_path / "absent.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[[null, 'rdma_en2']]")
    with pytest.raises(ValueError, match=r"bad.json: not JSON \(line 1"):
        rdma_env.load_device_matrix(str(bad))
    assert "must be null" in rdma_env.check_device_matrix([["rdma_en2"]], 1)
    assert "not null, a name" in rdma_env.check_device_matrix([[None, 3], [None, None]], 2)


def test_jaccl_env():
    env = rdma_env.jaccl_env(2, "/tmp/m.json")
    assert env == {"MLX_RANK": "2", "MLX_IBV_DEVICES": "/tmp/m.json"}
    env = rdma_env.jaccl_env(0, "/tmp/m.json", coordinator="10.0.0.1:5000", ring=True)
    assert env["MLX_JACCL_COORDINATOR"] == "10.0.0.1:5000" and env["MLX_JACCL_RING"] == "1"


@pytest.mark.parametrize("args,reason", [
    (("linux", False, None, None, None), "rdma: mlx has no jaccl backend on Linux"),
    (("darwin", False, None, None, None), "rdma: this mlx build has no jaccl backend"),
    (("darwin", True, "disabled\n", None, None),
     "rdma: RDMA disabled, run rdma_ctl enable from Recovery"),
    (("darwin", True, "RDMA is not enabled\n", "ibv_devices_5ports.txt", "/m.json"),
     "rdma: RDMA disabled, run rdma_ctl enable from Recovery"),
    (("darwin", True, "enabled\n", "ibv_devices_no_devices.txt", "/m.json"),
     "rdma: no rdma_en* device"),
    (("darwin", True, "enabled\n", "ibv_devices_none.txt", None), "rdma: no rdma_en* device"),
    (("darwin", True, "enabled\n", "ibv_devices_5ports.txt", None), "rdma: no device matrix"),
    (("darwin", True, "enabled\n", "ibv_devices_5ports.txt", "/m.json"), ""),
])
def test_rdma_reason_decides_from_recorded_outputs(args, reason):
    platform, has, ctl, ibv, spec = args
    got = rdma_env.rdma_reason(platform, has, ctl, read(ibv) if ibv else None, spec)
    assert got.startswith(reason) and (reason or got == "")


def test_matrix_spec_from_env_prefers_hpcmac():
    both = {"MLX_IBV_DEVICES": "/a", "HPCMAC_IBV_DEVICES": "/b"}
    assert rdma_env.matrix_spec_from_env(both) == "/b"
    assert rdma_env.matrix_spec_from_env({"MLX_IBV_DEVICES": "/a"}) == "/a"
    assert rdma_env.matrix_spec_from_env({}) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="jaccl is absent only on Linux")
def test_rdma_is_unavailable_here_for_real_and_ring_is_available():
    pytest.importorskip("mlx.core")
    assert is_available("rdma") == (False, "rdma: mlx has no jaccl backend on Linux")
    assert is_available("ring") == (True, "")
    ok, why = is_available("nccl")
    assert not ok and "not an MLX transport" in why


def test_launched_by_mlx_reads_the_launcher_environment():
    assert launched_by_mlx({}) is None
    assert launched_by_mlx({"MLX_RANK": "1", "MLX_HOSTFILE": "/h"}) == "ring"
    assert launched_by_mlx({"MLX_RANK": "0", "MLX_IBV_DEVICES": "/d",
                            "MLX_JACCL_COORDINATOR": "1.2.3.4:5"}) == "rdma"
    # mpirun's variables win: MLX_* left over in the environment do not count
    assert launched_by_mlx({"MLX_RANK": "1", "MLX_HOSTFILE": "/h",
                            "OMPI_COMM_WORLD_SIZE": "2"}) is None


def test_ring_hostfile_and_addresses():
    text = ring_env.ring_hostfile([["127.0.0.1:5000"], ["127.0.0.1:5001"]])
    assert json.loads(text) == [["127.0.0.1:5000"], ["127.0.0.1:5001"]]
    with pytest.raises(ValueError, match="same number"):
        ring_env.ring_hostfile([["a:1"], ["b:1", "b:2"]])
    assert ring_env.listen_address(1, ["h", "h"], [[], []]) == "127.0.0.1"
    ip_out = ("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
              "7: tb1    inet 10.77.1.1/30 scope global tb1\\       valid_lft forever\n")
    assert ring_env.parse_ifconfig(ip_out) == ["127.0.0.1", "10.77.1.1"]
    mac_out = ("en2: flags=8863<UP> mtu 9000\n\tinet 192.168.0.1 netmask 0xfffffffc\n"
               "lo0: flags=8049<UP> mtu 16384\n\tinet 127.0.0.1 netmask 0xff000000\n")
    assert ring_env.parse_ifconfig(mac_out) == ["192.168.0.1", "127.0.0.1"]
    port = ring_env.free_port("127.0.0.1")
    assert 0 < port < 65536


def test_a_device_on_a_port_that_cannot_do_rdma_is_refused_before_jaccl_starts():
    studio = Path(__file__).parent / "data" / "launch" / "studio4"
    ports = rdma_ready.parse_thunderbolt(
        (studio / "mac1.thunderbolt.json").read_text(),
        rdma_ready.parse_hardware_ports((studio / "mac1.ports.txt").read_text()))
    assert rdma_env.port_problem(0, [None, "rdma_en3", ["rdma_en4"]], ports) == ""
    assert rdma_env.port_problem(0, [None, "rdma_en2"], ports) == (
        "rank 0: device rdma_en2 (towards rank 1): en2 is the Mac Studio's Thunderbolt port "
        "next to the Ethernet jack, which cannot do RDMA")
    mini = rdma_ready.parse_thunderbolt(read("thunderbolt_macmini_tb4.json"),
                                        rdma_ready.parse_hardware_ports(read("ports_macmini.txt")))
    assert "40 Gb/s" in rdma_env.port_problem(1, ["rdma_en2", None], mini)
    assert rdma_env.port_problem(0, [None, "rdma_en2"], None) == ""  # not a Mac: no data
    assert rdma_env.local_ports() is None  # this Linux machine has no system_profiler
