"""hpcmac.plan's MLX path: the sync-count rule, the published step costs, labels, refusals.

No MPI, no MLX: the rule is the one the MLX backend's counters are held to
(tests/unit/test_llm_mlx_sync.py and test_llm_mlx_matrix.py measure it on the backend).
The comparison with exo's published rows is in test_plan_llm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.parallel import host_syncs
from hpcmac.plan import cluster as clmod
from hpcmac.plan import llm
from hpcmac.plan import machines as mc
from hpcmac.plan.cli import main
from hpcmac.plan.mlx_cost import LABEL, MLX
from hpcmac.plan.shape import load_shape

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json")   # 8 layers


# ------------------------------------------------------------- the sync-count rule

@pytest.mark.parametrize("layers, first, tp, transport, pp, want", [
    (3, True, 1, "ring", 1, 1),     # one rank: the token id
    (2, True, 1, "ring", 2, 1),     # --pp 2: each stage its hand-over / the id
    (1, False, 1, "ring", 2, 1),
    (3, True, 2, "ring", 1, 1),     # --tp 2 over ring: sums and max-loc in the graph
    (3, True, 3, "rdma", 1, 1),     # --tp 3 over JACCL
    (3, True, 2, "mpi", 1, 8),      # the bridge: 2 a layer, the embedding's, the head's
    (2, True, 2, "ring", 2, 6),     # --tp 2 --pp 2, layers [2, 1]: MPI sub-groups (mlx#3205)
    (1, False, 2, "ring", 2, 3),
])
def test_stage_syncs_are_the_backends_counts(layers, first, tp, transport, pp, want):
    """The counts the backend's own counters give (3-layer llama; generate --json)."""
    graph = host_syncs.graph_sums(tp, pp, transport)
    assert host_syncs.stage_syncs(layers, first, tp, graph) == want
    assert host_syncs.pipelined(tp, pp) == (tp == 1 and pp == 1)


def test_a_stage_without_layers_is_refused():
    with pytest.raises(ValueError, match=">= 1 layer"):
        host_syncs.stage_syncs(0, True, 1, False)


# ------------------------------------------------------------- the terms add up

def m3(nodes: int, link: str = "tb5-rdma", machine: str = "m3-ultra") -> clmod.Cluster:
    return clmod.build(machine=machine, nodes=nodes, link=link if nodes > 1 else None)


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("transport, fast", [("", False), ("rdma", True), ("mpi", False)])
def test_mlx_terms_add_up(tp, pp, transport, fast):
    """Each published term, and nothing else, on top of the table part's prediction:
    the weights at the GPU's sustained 670 GB/s instead of 819, kernels and command
    buffers per stage, host syncs as the layout makes them (none waited on at one
    rank), a CPU-GPU crossing per collective in the graph beside the edge collectives'
    messages; the pipeline's hops unchanged."""
    shape = load_shape(SMALL)
    cl = m3(tp * pp)
    base = llm.predict(cl, shape, llm.LlmCase(tp=tp, pp=pp))
    r = llm.predict(cl, shape, llm.LlmCase(tp=tp, pp=pp, backend="mlx", transport=transport,
                                           fast_synch=fast))
    assert 1 / r.decode_tok_s == pytest.approx(
        r.stream_s + r.fixed_s + r.allreduce_s + r.sync_s + r.hops_s, rel=1e-12)
    assert r.stream_s == pytest.approx(base.stream_s * 819 / 670, rel=1e-12)
    assert r.fixed_s - base.fixed_s == pytest.approx(
        sum(MLX.step_fixed_s(n) for n in r.layers), rel=1e-12)
    graph = host_syncs.graph_sums(tp, pp, transport or "rdma")
    syncs = [host_syncs.stage_syncs(n, s == 0, tp, graph) for s, n in enumerate(r.layers)]
    assert r.host_syncs == sum(syncs)
    assert r.sync_s == pytest.approx(0.0 if tp * pp == 1 else sum(syncs) * MLX.host_sync_s)
    want_ar = 0.0
    if tp > 1:
        edge = [(s == 0) + (s == pp - 1) for s in range(pp)]
        msg = shape.hidden * 2
        want_ar = sum(e * llm.allreduce_s(cl.link, tp, msg) for e in edge)
        if graph:
            want_ar += sum((2 * n + e) for n, e in zip(r.layers, edge)) * MLX.crossing(fast)
    assert r.allreduce_s - base.allreduce_s == pytest.approx(want_ar, rel=1e-9, abs=1e-15)
    assert r.hops_s == base.hops_s and r.layers == base.layers
    assert (r.backend, r.sums) == ("mlx", ("in the graph" if graph else "numpy bridge")
                                   if tp > 1 else "")


def test_without_a_sustained_figure_the_peak_is_used_and_said():
    shape = load_shape(SMALL)
    r = llm.predict(m3(1, machine="m4-max"), shape, llm.LlmCase(backend="mlx"))
    base = llm.predict(m3(1, machine="m4-max"), shape, llm.LlmCase())
    assert r.stream_s == pytest.approx(base.stream_s, rel=1e-12)   # 546 GB/s both
    assert "546 GB/s peak [apple-m4-max]" in r.figures
    assert "670 GB/s sustained [mlx-bw]" in llm.predict(
        m3(1), shape, llm.LlmCase(backend="mlx")).figures


def test_every_figure_is_labelled_and_sourced():
    shape = load_shape(SMALL)
    r = llm.predict(m3(2), shape, llm.LlmCase(tp=2, backend="mlx"))
    assert r.figures.startswith(LABEL)
    for key in ("mlx-cbuf", "mlx-async-eval", "mlx-fence", "mlx-bw"):
        assert key in r.figures
    assert "default fence" in r.figures
    assert "MLX_METAL_FAST_SYNCH=1" in llm.predict(
        m3(2), shape, llm.LlmCase(tp=2, backend="mlx", fast_synch=True)).figures
    plain = llm.predict(m3(2), shape, llm.LlmCase(tp=2))
    assert (plain.backend, plain.figures, plain.host_syncs, plain.sync_s) == ("", "", 0.0, 0.0)
    # every source key the figures name is in docs/plan.md's list
    doc = (ROOT / "docs" / "plan.md").read_text()
    for key in ("mlx-cbuf", "mlx-async-eval", "mlx-fence", "mlx-bw", "exo-fast-synch"):
        assert f"- [{key}]" in doc, key


def test_the_cli_prints_the_label_and_the_json_keeps_it(capsys, tmp_path):
    argv = ["llm", SMALL, "--machine", "m3-ultra", "--nodes", "2", "--link", "tb5-rdma",
            "--backend", "mlx"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"--backend mlx: {LABEL}" in out and "syncs 1: 0.38 (sums: in the graph)" in out
    js = tmp_path / "m.json"
    assert main([*argv, "--json", str(js)]) == 0
    recs = json.loads(js.read_text())
    assert recs and all(r["backend"] == "mlx" and LABEL in r["figures"] for r in recs)


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("extra, says", [
    (["--numpy"], "--numpy and --backend mlx name two backends"),
    (["--calibration", "node.json"], "--calibration measures hpcmac's CPU decoder"),
    (["--layout", "star"], "the star layout is llama.cpp RPC's"),
    (["--nodes", "2", "--link", "tb5-tcp", "--transport", "rdma"],
     "--transport rdma (JACCL) needs an RDMA link"),
])
def test_bad_mlx_flags_are_one_line(extra, says):
    with pytest.raises(UsageError, match=None) as e:
        main(["llm", SMALL, "--machine", "m3-ultra", "--backend", "mlx", *extra])
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("extra", [["--transport", "ring"], ["--mlx-fast-synch"]])
def test_mlx_flags_without_the_backend_are_refused(extra):
    with pytest.raises(UsageError, match="describe the MLX backend: add --backend mlx"):
        main(["llm", SMALL, "--machine", "m3-ultra", *extra])


def test_a_measured_node_has_no_gpu_figures():
    rates = mc.Rates("measured", cores=2, memory_gb=8, dgemm={1: 50.0}, mem_bw={1: 20.0})
    cl = clmod.Cluster((clmod.Node("here", rates),), clmod.SHARED_MEMORY)
    with pytest.raises(UsageError, match="node here has no published GPU figures"):
        llm.predict(cl, load_shape(SMALL), llm.LlmCase(backend="mlx"))
    with pytest.raises(UsageError, match="backend must be '' or 'mlx'"):
        llm.predict(cl, load_shape(SMALL), llm.LlmCase(backend="cuda"))


def test_bad_flags_exit_2_with_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "hpcmac.plan", "llm", SMALL, "--machine",
                        "m3-ultra", "--backend", "mlx", "--numpy"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
