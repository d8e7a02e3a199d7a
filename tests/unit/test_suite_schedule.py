"""tests/conftest.py's work units and hand-out order under ``--dist loadfile`` (make test's
unit workers): which tests must stay in one worker, and which go first."""

from __future__ import annotations

import pytest

from tests.conftest import handout_order, unit_of

MATRIX = "tests/unit/test_llm_mlx_matrix.py::test_mlx_matrix_greedy_tokens_equal_numpy"
DOCS = "tests/unit/test_docs_commands.py::test_marked_block_runs_as_written"


def test_a_file_is_one_unit_but_for_the_split_ones():
    assert unit_of("tests/unit/test_llm_tools.py::test_calls_parse[np2-tp2]") \
        == "tests/unit/test_llm_tools.py"
    assert unit_of("tests/unit/test_x.py::TestA::test_b[1-2]") == "tests/unit/test_x.py"
    # each docs block alone
    assert unit_of(f"{DOCS}[README.md:95]") == f"{DOCS}[README.md:95]"
    stops = "tests/unit/test_stops.py::test_repeated_stops_leave_nothing"
    assert unit_of(f"{stops}[np1]") != unit_of(f"{stops}[np2]")
    # the ring's launcher tests each alone (a job each), its singleton contract class whole
    ring = "tests/unit/test_comm_ring.py"
    assert unit_of(f"{ring}::test_ring_contract_under_mpirun[4]") \
        != unit_of(f"{ring}::test_ring_contract_under_mpirun[2]")
    single = {unit_of(f"{ring}::TestRingSingletonContract::{t}") for t in
              ("test_bcast_every_root[int32]", "test_objects")}
    assert single == {f"{ring}::TestRingSingletonContract"}
    # the matrix's cells of a family together (they share its folders), families apart
    fams = {unit_of(f"{MATRIX}[{f}-{form}-{lay}]") for f in ("qwen3_moe", "glm4_moe_lite")
            for form in ("float", "q4") for lay in ("np1", "tp2pp2")}
    assert fams == {f"{MATRIX}[qwen3_moe", f"{MATRIX}[glm4_moe_lite"}
    assert unit_of("tests/unit/test_llm_mlx_matrix.py::test_plain") \
        == "tests/unit/test_llm_mlx_matrix.py"
    # a serve file's tests of one layout together (they share its server), layouts apart
    serve = "tests/unit/test_llm_serve_structured.py"
    assert {unit_of(f"{serve}::{t}[np2-tp2]") for t in ("test_a", "test_b")} \
        == {f"{serve}[np2-tp2"}
    assert unit_of(f"{serve}::test_a[np1]") == f"{serve}[np1"
    assert unit_of(f"{serve}::test_plain") == serve


class _Item:
    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name):
        return pytest.mark.slow.mark if name == "slow" and self.slow else None


def test_units_go_out_longest_first_each_in_its_own_order():
    ids = ["a.py::t1", "a.py::t2", "b.py::t1", "c.py::t1", "c.py::t2", "d.py::t1",
           "e.py::t1"]
    items = [_Item(i, slow=i == "e.py::t1") for i in ids]
    handout_order(items, {"a.py": 5.0, "b.py": 1.0, "c.py": 30.0, "d.py": 3.0})
    # e.py: unknown with a slow test, first; then by seconds; a file's tests in order
    assert [i.nodeid for i in items] == ["e.py::t1", "c.py::t1", "c.py::t2", "a.py::t1",
                                         "a.py::t2", "d.py::t1", "b.py::t1"]
    # an unknown unit without a slow test counts as the median (here 3.0 + 5.0 -> 5.0)
    items = [_Item(i) for i in ("x.py::t", "a.py::t", "b.py::t", "d.py::t")]
    handout_order(items, {"a.py": 5.0, "b.py": 1.0, "d.py": 3.0, "c.py": 30.0})
    assert [i.nodeid for i in items][-2:] == ["d.py::t", "b.py::t"]
