"""``python -m hpcmac.hpl``'s main() in an MPI job: HPL.dat in, HPL.out file and JSON out."""

import json
import os
import shutil
import tempfile

import pytest

from hpcmac import comm
from hpcmac.hpl.__main__ import main
from hpcmac.testing import parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

DAT = """\
HPLinpack benchmark input file
test
{out}      output file name (if any)
8            device out (6=stdout,7=stderr,file)
2            # of problems sizes (N)
45 7         Ns
1            # of NBs
16           NBs
{pmap}            PMAP process mapping (0=Row-,1=Column-major)
2            # of process grids (P x Q)
1 {big}        Ps
{q} 1        Qs
16.0         threshold
1            # of panel fact
1            PFACTs (0=left, 1=Crout, 2=Right)
1            # of recursive stopping criterium
2            NBMINs (>= 1)
1            # of panels in recursion
2            NDIVs
1            # of recursive panel fact.
2            RFACTs (0=left, 1=Crout, 2=Right)
2            # of broadcast
4 5          BCASTs (0=1rg,1=1rM,2=2rg,3=2rM,4=Lng,5=LnM)
1            # of lookahead depth
1            DEPTHs (>=0)
1            SWAP (0=bin-exch,1=long,2=mix)
64           swapping threshold
1            L1 in (0=transposed,1=no-transposed) form
1            U  in (0=transposed,1=no-transposed) form
0            Equilibration (0=no,1=yes)
4            memory alignment in double (> 0)
"""


@pytest.mark.parametrize("pmap", [0, 1])
def test_main_writes_hpl_out_file_and_json(pmap):
    world = comm.init("mpi")
    tmp = world.bcast_obj(tempfile.mkdtemp(prefix="hpl-main-") if world.rank == 0 else None)
    out, dat, js = (os.path.join(tmp, f) for f in ("HPL.out", "HPL.dat", "r.json"))
    if world.rank == 0:
        with open(dat, "w") as fh:
            # the second grid never fits: skipped with a note
            fh.write(DAT.format(out=out, pmap=pmap, big=world.size + 1, q=world.size))
    world.barrier()
    code = main(["--dat", dat, "--json", js, "--progress", "off"])
    world.barrier()
    ok, why = code == 0, f"exit {code}"
    if world.rank == 0:
        text = open(out).read()
        recs = json.load(open(js))
        tvs = [r["tv"] for r in recs]
        c = "C" if pmap else "R"
        ok = ok and tvs == [f"W{c}14R2C2", f"W{c}15R2C2"] * 2
        ok = ok and all(r["passed"] and r["q"] == world.size for r in recs)
        ok = ok and [r["n"] for r in recs] == [45, 45, 7, 7]
        ok = ok and text.count("PASSED") == 4 and "4 tests skipped" in text
        ok = ok and "L1     : no-transposed form" in text and "EQUIL  : no" in text
        why = text[-1200:]
        shutil.rmtree(tmp)
    parallel_assert(ok, why, world)
