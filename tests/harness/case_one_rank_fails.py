"""A test that fails on the last rank only: run only by tests/unit/test_harness.py."""

from hpcmac.testing import parallel_assert, world


def test_fails_on_last_rank():
    group = world()
    parallel_assert(group.rank != group.size - 1, "the last rank says no", group)
