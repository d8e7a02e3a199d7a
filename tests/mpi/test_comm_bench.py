"""``python -m hpcmac.bench.comm`` runs at any rank count and writes its JSON."""

import json

import pytest

from hpcmac import comm
from hpcmac.bench.comm import main
from hpcmac.errors import UsageError
from hpcmac.testing import parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def test_quick_run_writes_tables_and_json(tmp_path, capsys):
    w = comm.init("mpi")
    path = w.bcast_obj(str(tmp_path / "comm.json"))
    code = main(["--quick", "--rounds", "1", "--transports", "mpi", "--max-bandwidth", "64K",
                 "--max-latency", "64", "--max-collective", "512", "--json", path])
    out = capsys.readouterr().out
    ok, why = code == 0, ""
    if w.rank == 0:
        data = json.load(open(path))
        ops = {r["op"] for r in data["collectives"]}
        ok = ok and ops == {"bcast", "allreduce", "allgather"} and data["info"]["ranks"] == w.size
        ok = ok and all(r["mpi"] > 0 and r["raw mpi4py"] > 0 for r in data["collectives"])
        if w.size >= 2:
            ok = ok and [r["bytes"] for r in data["latency"]] == [1, 2, 4, 8, 16, 32, 64]
            ok = ok and "latency_within_2us" in data["verdict"] and "## criterion" in out
        else:
            ok = ok and data["latency"] == [] and "need 2 ranks" in out
        why = out[-1500:]
    parallel_assert(ok, why, w)


def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="'tcp' is not one of mpi, ring, rdma"):
        main(["--transports", "mpi,tcp"])
    with pytest.raises(UsageError, match="--rounds must be >= 1"):
        main(["--rounds", "0"])
    parallel_assert(True, "", comm.init("mpi"))
