"""Hostfile schema and pure validation: examples pass, each bad input is one clear line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.launch.hostfile import advise, load, parse, validate
from hpcmac.launch.topology import is_full_mesh, missing_mesh_pairs, ring_order

HOSTFILES = Path(__file__).resolve().parents[2] / "hostfiles"


def mesh4() -> dict:
    return json.loads((HOSTFILES / "mesh-4.json").read_text())


def problems(data: dict) -> list[str]:
    return validate(parse(data, "t.json"))


@pytest.mark.parametrize("path", sorted(HOSTFILES.glob("*.json")), ids=lambda p: p.name)
def test_every_example_hostfile_is_valid(path):
    hf = load(path)
    assert hf.hosts
    if hf.links:
        assert is_full_mesh(hf)
        # a /30 per cable and 2 to 4 Macs
        assert all(lk.subnet.endswith("/30") for lk in hf.links)
        assert 2 <= len(hf.hosts) <= 4


def test_mixed_hostfile_has_512_and_256_gb_nodes():
    hf = load(HOSTFILES / "mesh-4-mixed.json")
    assert sorted(h.memory_gb for h in hf.hosts) == [256, 256, 512, 512]


def test_mlx_launch_hostfile_is_accepted_both_forms():
    data = json.loads((HOSTFILES / "mlx-jaccl-4.json").read_text())
    hf = parse(data, "m.json")
    assert hf.mlx_format and hf.backend == "jaccl"
    assert [h.name for h in hf.hosts] == [h.ssh for h in hf.hosts]
    assert hf.hosts[0].rdma == (None, "rdma_en3", "rdma_en4", "rdma_en5")
    assert validate(hf) == []
    bare = parse(data["hosts"], "m.json")  # the list form
    assert bare.names == hf.names and validate(bare) == []


def test_not_json_names_the_file_and_position(tmp_path):
    p = tmp_path / "h.json"
    p.write_text('{"hosts": [\n  {"name": "a",}\n]}')
    with pytest.raises(UsageError, match=r"h\.json: not JSON \(line 2"):
        load(p)


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="hostfile .*: cannot read"):
        load(tmp_path / "nope.json")


@pytest.mark.parametrize("edit,expect", [
    (lambda d: d["hosts"][0].pop("name"), r"hosts\[0\]: missing field 'name'"),
    (lambda d: d["links"][0].pop("subnet"), r"links\[0\]: missing field 'subnet'"),
    (lambda d: d["links"][0]["ends"][1].pop("addr"),
     r"links\[0\]\.ends\[1\]: missing field 'addr'"),
    (lambda d: d["hosts"][1].update(slots="2"), r"host 'mac2': field 'slots' should be an integer"),
    (lambda d: d["links"][0].update(ends=d["links"][0]["ends"][:1]), r"'ends' should have 2"),
    (lambda d: d.update(hosts=[]), r"'hosts' is empty"),
])
def test_missing_or_mistyped_field(edit, expect):
    d = mesh4()
    edit(d)
    with pytest.raises(UsageError, match=expect):
        parse(d, "t.json")


def test_half_mesh_names_the_missing_pairs():
    d = mesh4()
    d["links"] = [lk for lk in d["links"] if {e["host"] for e in lk["ends"]} != {"mac2", "mac4"}]
    (p,) = problems(d)
    assert "not a full mesh" in p and "mac2-mac4" in p


def test_ring_topology_said_so_is_valid_and_gives_the_cycle():
    d = mesh4()
    d["topology"] = "ring"
    drop = [{"mac1", "mac3"}, {"mac2", "mac4"}]
    d["links"] = [lk for lk in d["links"] if {e["host"] for e in lk["ends"]} not in drop]
    assert problems(d) == []
    hf = parse(d)
    assert ring_order(hf) == ["mac1", "mac2", "mac3", "mac4"]
    assert set(missing_mesh_pairs(hf)) == {("mac1", "mac3"), ("mac2", "mac4")}
    d["links"] = d["links"][:2]  # a chain, not a ring
    assert any("do not join every host into one cycle" in p for p in problems(d))


def test_ring_order_finds_a_cycle_when_hostfile_order_is_not_one():
    d = mesh4()
    d["topology"] = "ring"
    keep = [{"mac1", "mac3"}, {"mac3", "mac2"}, {"mac2", "mac4"}, {"mac4", "mac1"}]
    d["links"] = [lk for lk in d["links"] if {e["host"] for e in lk["ends"]} in keep]
    assert ring_order(parse(d)) == ["mac1", "mac3", "mac2", "mac4"]


def test_duplicate_addresses():
    d = mesh4()
    d["links"][1]["ends"][0]["addr"] = "10.77.13.2"  # already mac3's
    assert any("duplicates" in p and "10.77.13.2" in p for p in problems(d))
    d = mesh4()
    d["hosts"][1]["ips"] = list(d["hosts"][0]["ips"])
    assert any("host 'mac2': field 'ips' address 192.168.1.11 is also host 'mac1'" in p
               for p in problems(d))


def test_address_outside_its_subnet_and_overlapping_subnets():
    d = mesh4()
    d["links"][0]["ends"][1]["addr"] = "10.77.12.5"
    assert any("link 0 (mac1-mac2): field 'addr' 10.77.12.5 on 'mac2' is not a host address "
               "inside subnet 10.77.12.0/30" in p for p in problems(d))
    d = mesh4()
    d["links"][0]["ends"][1]["addr"] = "10.77.12.3"  # the broadcast address of the /30
    assert any("not a host address" in p for p in problems(d))
    d = mesh4()
    d["links"][1]["subnet"] = "10.77.12.0/29"
    assert any("is not a network" in p or "overlaps" in p for p in problems(d))
    d = mesh4()
    d["links"][1]["subnet"] = "10.77.0.0/16"
    d["links"][1]["ends"][0]["addr"] = "10.77.200.1"
    assert any("overlaps link 0" in p or "overlaps" in p for p in problems(d))


@pytest.mark.parametrize("name", ["a;rm -rf /", "$(reboot)", "a b", "-oProxyCommand=x", "a|b",
                                  "a`b`", ""])
def test_shell_metacharacters_in_names_are_refused(name):
    d = mesh4()
    d["hosts"][0]["ssh"] = name
    assert any("field 'ssh'" in p for p in problems(d))
    d = mesh4()
    old = d["hosts"][0]["name"]
    d["hosts"][0]["name"] = name
    for lk in d["links"]:
        for e in lk["ends"]:
            if e["host"] == old:
                e["host"] = name
    assert any("field 'name'" in p for p in problems(d))
    d = mesh4()
    d["links"][0]["ends"][0]["iface"] = name
    assert any("field 'iface'" in p for p in problems(d))


@pytest.mark.parametrize("ssh", ["a%b", "a+b", "a=b", "a,b", "a:b", "a/b", "u@a@b", "u%x@host",
                                 "u=1,x:/@host", "@host", "[::1]"])
def test_ssh_names_that_would_reach_the_mpi_hostfile_verbatim_are_refused(ssh):
    """``%+=,:/@`` were written as they are into Open MPI's hostfile (issue 32)."""
    d = mesh4()
    d["hosts"][0]["ssh"] = ssh
    out = [p for p in problems(d) if "field 'ssh'" in p]
    assert out and "must be a plain host name or user@host" in out[0], (ssh, problems(d))


def test_plain_ssh_names_are_accepted():
    for ssh in ("mac1", "mac1.local", "admin@mac1.local", "first.last@10.0.0.2", "m-1_x@h-2"):
        d = mesh4()
        d["hosts"][0]["ssh"] = ssh
        assert not [p for p in problems(d) if "field 'ssh'" in p], ssh


def test_load_reports_one_line_with_the_file_and_the_first_problem(tmp_path):
    d = mesh4()
    d["hosts"][0]["name"] = "a;rm -rf /"
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UsageError) as e:
        load(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: host 'a;rm -rf /': field 'name'")


def test_rdma_matrix_must_match_the_links_with_null_diagonal():
    d = mesh4()
    names = [h["name"] for h in d["hosts"]]
    hf = parse(d)
    for i, h in enumerate(d["hosts"]):
        row = []
        for j, other in enumerate(names):
            lk = hf.link_between(names[i], other) if i != j else None
            row.append(lk.end_of(names[i]).rdma if lk else None)
        h["rdma"] = row
    assert problems(d) == []
    bad = copy.deepcopy(d)
    bad["hosts"][0]["rdma"][0] = "rdma_en9"
    assert any("entry 0 (itself) must be null" in p for p in problems(bad))
    bad = copy.deepcopy(d)
    bad["hosts"][2]["rdma"][1] = "rdma_en7"
    assert any("host 'mac3': field 'rdma' entry 1 (mac2) is 'rdma_en7' but the link says "
               "'rdma_en4'" in p for p in problems(bad))
    bad = copy.deepcopy(d)
    bad["hosts"][1]["rdma"] = bad["hosts"][1]["rdma"][:3]
    assert any("has 3 entries, expected one per host (4)" in p for p in problems(bad))


def test_slots_memory_and_more_than_four_meshed_hosts_is_a_warning():
    d = mesh4()
    d["hosts"][0]["slots"] = 0
    d["hosts"][1]["memory_gb"] = -1
    out = problems(d)
    assert any("host 'mac1': field 'slots' must be a positive integer (at most 1024), found 0"
               in p for p in out)
    assert any("host 'mac2': field 'memory_gb' must be positive" in p for p in out)
    # five hosts, fully meshed: flagged as a cabling that cannot exist
    hosts = [{"name": f"m{i}"} for i in range(5)]
    links = []
    k = 0
    for i in range(5):
        for j in range(i + 1, 5):
            links.append({"subnet": f"10.9.{k}.0/30", "ends": [
                {"host": f"m{i}", "iface": f"en{j + 2}", "addr": f"10.9.{k}.1"},
                {"host": f"m{j}", "iface": f"en{i + 2}", "addr": f"10.9.{k}.2"}]})
            k += 1
    five = parse({"hosts": hosts, "links": links})
    assert validate(five) == []
    (warning,) = advise(five)
    assert "5 hosts in a Thunderbolt full mesh" in warning and "more than 4 Macs" in warning
    assert advise(parse(mesh4())) == []


def test_envs_backend_topology_checked():
    d = mesh4()
    d["envs"] = ["GOOD=1", "bad key=1", "NOEQUALS", "NEWLINE=a\nb", "TAB=a\tb"]
    d["backend"] = "nccl2"
    d["topology"] = "star"
    out = problems(d)
    assert sum("field 'envs'" in p for p in out) == 4
    assert sum("control character" in p for p in out) == 2
    assert any("field 'backend'" in p for p in out)
    assert any("field 'topology'" in p for p in out)


def test_hostile_hostfiles_are_one_line_and_fast(tmp_path):
    """Bounds from the format: special files, size, nesting, NaN, empty lists, names with
    a newline, one machine listed twice, counts that would take minutes to check."""
    import os
    import time

    def refused(content, match):
        path = tmp_path / "h.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(UsageError, match=match):
            load(path)

    with pytest.raises(UsageError, match="expected a regular file, found a character device"):
        load("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="found a pipe"):
        load(tmp_path / "fifo")
    refused(b'{"hosts": [{"name": "a\xff"}]}', "expected UTF-8 text, found byte 0xff")
    refused(" " * (1 << 20) + "{}", r"expected at most 1 MiB, found 1048578 bytes")
    refused("[" * 5000 + "]" * 5000, "nested at most 64 levels deep")
    refused("[]", "expected a list of hosts, found an empty list")
    refused('{"hosts": [{"name": "a", "memory_gb": NaN}]}', "is not a number JSON allows")
    refused('{"hosts": [{"name": "a", "memory_gb": 1e400}]}', "'memory_gb' must be positive "
            r"\(at most 1e\+06\), found inf")
    refused('{"hosts": [{"name": "a", "slots": 1000000000000000000}]}',
            r"'slots' must be a positive integer \(at most 1024\)")
    refused('{"hosts": [{"name": "a\\n"}]}', "field 'name' must be letters")
    refused('{"hosts": [{"name": "a", "ssh": "x"}, {"name": "b", "ssh": "x"}]}',
            "host 'b': field 'ssh' 'x' is also host 'a''s")
    many = json.dumps({"hosts": [{"name": f"h{i}"} for i in range(2000)]})
    refused(many, "'hosts' should have at most 1024 entries, found 2000")

    # a valid 1024-host ring (hostfile order shuffled) checks in well under a second
    n = 1024
    hosts = [{"name": f"h{i}"} for i in range(n)]
    links = []
    for i in range(n):
        j = (i + 1) % n
        net = 4 * i
        base = f"10.{net >> 16 & 255}.{net >> 8 & 255}"
        links.append({"subnet": f"{base}.{net & 255}/30", "ends": [
            {"host": f"h{i}", "iface": "en1", "addr": f"{base}.{(net & 255) + 1}"},
            {"host": f"h{j}", "iface": "en2", "addr": f"{base}.{(net & 255) + 2}"}]})
    hosts[1], hosts[5] = hosts[5], hosts[1]
    path = tmp_path / "ring.json"
    path.write_text(json.dumps({"topology": "ring", "hosts": hosts, "links": links}))
    t0 = time.monotonic()
    hf = load(path)
    assert ring_order(hf) is not None and len(ring_order(hf)) == n
    assert time.monotonic() - t0 < 5
    # the same links declared a mesh: the missing pairs are counted, not listed forever
    path.write_text(json.dumps({"hosts": hosts, "links": links}))
    t0 = time.monotonic()
    with pytest.raises(UsageError, match="not a full mesh"):
        load(path)
    assert time.monotonic() - t0 < 5
