"""Hostfile fields: a misspelt field is refused with the nearest known name (it used to be
dropped silently: "memroy_gb" lost "memory_gb"), at every level and in both formats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.launch.hostfile import parse

ROOT = Path(__file__).resolve().parents[2]
MESH2 = json.loads((ROOT / "hostfiles" / "mesh-2.json").read_text())


def _mesh2(edit):
    d = json.loads(json.dumps(MESH2))
    edit(d)
    return d


@pytest.mark.parametrize("edit,expect", [
    (lambda d: d.update(topolgy="ring"),
     "f.json: unknown field 'topolgy': did you mean 'topology'?"),
    (lambda d: d["hosts"][0].update(memroy_gb=512),
     "host 'mac1': unknown field 'memroy_gb': did you mean 'memory_gb'?"),
    (lambda d: d["links"][0].update(subnett="10.0.0.0/30"),
     "links[0]: unknown field 'subnett': did you mean 'subnet'?"),
    (lambda d: d["links"][0]["ends"][1].update(ifac="en3"),
     "links[0].ends[1]: unknown field 'ifac': did you mean 'iface'?"),
    (lambda d: d["hosts"][1].update(colour="red"),
     "host 'mac2': unknown field 'colour': expected one of name, ssh, slots,"),
])
def test_unknown_field_names_the_nearest_known_one(edit, expect):
    with pytest.raises(UsageError) as exc:
        parse(_mesh2(edit), "f.json")
    assert expect in str(exc.value)


def test_mlx_format_and_comments():
    with pytest.raises(UsageError, match=r"hosts\[0\]: unknown field 'ipz': did you mean 'ips'"):
        parse([{"ssh": "a", "ipz": ["10.0.0.1"]}], "m.json")
    hf = parse(_mesh2(lambda d: (d.update(_comment="two Macs"),
                                 d["hosts"][0].update(_note="the 512 GB one"))), "f.json")
    assert hf.names == ["mac1", "mac2"]


def test_launch_check_refuses_a_misspelt_field_in_one_line(tmp_path):
    f = tmp_path / "typo.json"
    f.write_text(json.dumps(_mesh2(lambda d: d["hosts"][0].update(memroy_gb=512))))
    res = subprocess.run([sys.executable, "-m", "hpcmac.launch", "check", "--hostfile", str(f)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.count("\n") == 1 and "did you mean 'memory_gb'?" in res.stderr
