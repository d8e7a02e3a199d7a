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
    p.close()
    lines = out.getvalue().split("\n")
    assert "\r" not in out.getvalue() and len(lines) == 4 and lines[1].startswith("X: 4/4")
    assert lines[1].endswith("; solving and checking the residual")
    assert lines[2].startswith("X: solve and residual check took ")


def test_eta_after_a_tenth_of_the_flops_is_within_25_percent(monkeypatch):
    # the run: 100 s of matrix generation (before the first panel), then the
    # factorisation at a steady flop rate, 200 s in all; the ETA used to count the
    # generation as factorisation time and said 10x too much
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    p = progress.Progress("X", stream=out, min_interval=0.0)
    n, nb, t_gen, t_lu = 10000, 100, 100.0, 200.0
    etas = []
    for done in range(nb, n + 1, nb):
        clock[0] = t_gen + t_lu * progress.work_fraction(done, n)
        p(done, n)
        frac = progress.work_fraction(done, n)
        if 0.1 <= frac < 1.0:
            eta = float(out.getvalue().splitlines()[-1].split("ETA")[1].rstrip("s"))
            etas.append((frac, eta, t_gen + t_lu - clock[0]))
    assert etas and etas[0][0] < 0.15
    for frac, eta, left in etas:  # the factorisation's predicted end vs its real one
        assert abs(eta - left) <= 0.25 * t_lu, (frac, eta, left)
