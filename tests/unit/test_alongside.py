"""tools/alongside (make test's MPI and cluster phases beside the unit workers): the side's
output in one piece after the main's, each one's wall seconds, the exit status."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def alongside(main: str, side: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "alongside"), main, side],
                          capture_output=True, text=True, timeout=60)


def took(out: str) -> tuple[int, int]:
    m = re.search(r"the main phases took (\d+) s, the side's (\d+) s", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def test_the_side_prints_after_the_main_and_each_says_its_time():
    p = alongside("echo m1; sleep 0.3; echo m2", "echo s1; sleep 3; echo s2")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[:2] == ["m1", "m2"] and "waiting" in lines[2], lines
    assert lines[3:5] == ["s1", "s2"], lines   # in one piece, after the main's
    t_main, t_side = took(p.stdout)
    assert t_side >= 3 and t_main < t_side, (t_main, t_side)


def test_a_side_ending_first_is_timed_at_its_end_and_its_failure_counts():
    p = alongside("sleep 3", "exit 3")
    assert p.returncode == 3
    t_main, t_side = took(p.stdout)
    assert t_main >= 3 and t_side < t_main, (t_main, t_side)
    assert alongside("exit 4", "exit 3").returncode == 4   # the main's failure first
