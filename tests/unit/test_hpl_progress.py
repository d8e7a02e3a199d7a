"""Progress line (rank 0, terminals only) and the BLAS-thread policy."""

import io

import pytest

from hpcmac.hpl import progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_want_progress():
    assert progress.want_progress("auto", Tty()) is True
    assert progress.want_progress("auto", io.StringIO()) is False
    assert progress.want_progress("on", io.StringIO()) is True
    assert progress.want_progress("off", Tty()) is False


def test_work_fraction_counts_flops_not_columns():
    assert progress.work_fraction(0, 100) == 0.0
    assert progress.work_fraction(100, 100) == 1.0
    assert progress.work_fraction(50, 100) == pytest.approx(0.875)


def test_progress_line_shows_columns_elapsed_eta():
    out = Tty()
    p = progress.Progress("WR11C2R4 N=100", stream=out, min_interval=0.0)
    p(50, 100)
    p(100, 100)
    text = out.getvalue()
    assert "\rWR11C2R4 N=100:  50/100 columns ( 87.5% of flops)" in text
    assert "elapsed" in text and "ETA" in text and text.endswith("\n")


def test_progress_on_a_pipe_is_whole_lines():
    out = io.StringIO()
    p = progress.Progress("X", stream=out, min_interval=0.0)
    p(1, 4)
    p(4, 4)
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and len(lines) == 3 and lines[1].startswith("X: 4/4")
