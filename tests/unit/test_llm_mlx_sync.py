"""The MLX backend's host syncs, counted by the backend (``MLXBackend.host``), and its tokens.

One rank: a decode step is one evaluation (the step's graph, its KV cache writes and
the greedy argmax together), and only the chosen ids cross (4 bytes a token); a
sampled step brings its logits row instead, still one sync. Greedy tokens equal the
numpy backend's (float folder) and mlx-lm's own generation (a folder mlx-lm
quantized, 4-bit affine). Several ranks through ``tools/mpirun``: a pipeline of two
stages is one sync per stage per hand-over; tensor parallel over MLX's ring
(``--transport ring``) sums inside the graph (``mx.distributed.all_sum``) and takes
the greedy max-loc there too: one sync per rank per token, only the leader's ids
cross. Over MPI the sums go through numpy (two syncs a layer, said once), and
``HPCMAC_TRANSPORT_STRICT=1`` refuses that.

The families whose layers keep more than a KV cache stay on the device too: Gated
DeltaNet's conv and recurrent states (Qwen3-Next, Qwen3.5 and its MoE) and DeepSeek-V3.2's
lightning indexer (its keys, scores and top-k): one sync a token at one rank, the numpy
backend's tokens, through a chunked prefill of a prompt longer than the index's top-k and
an EOS in the middle of a burst of decode steps built ahead (the dropped step's states
put back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("transformers")

from hpcmac.comm.local import LocalGroup  # noqa: E402
from hpcmac.llm.model.fixtures import random_checkpoint  # noqa: E402
from hpcmac.llm.model.sampling import SamplingParams  # noqa: E402
from hpcmac.llm.model.stage import load_stage  # noqa: E402
from hpcmac.llm.parallel.pipeline import Request, run_pipeline  # noqa: E402
from hpcmac.llm.parallel.plan import StageSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[3, 17, 42, 5, 9], [7, 8], [50, 51, 52, 53, 54, 55]]
N = 10

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return random_checkpoint("llama", tmp_path_factory.mktemp("ck") / "llama", seed=4,
                             num_hidden_layers=3, eos_token_id=None)


def one_rank(folder, backend: str, reqs: list[Request]):
    st = load_stage(folder, 0, 3, backend=backend)
    res = run_pipeline(LocalGroup(), st, StageSpec(0, 0, 3, True, True), st.config.hidden,
                       reqs)
    return [s.tokens for s in res.seqs], [s.finish for s in res.seqs], res.host_per_token()


def test_one_rank_greedy_is_one_sync_per_token_and_numpy_tokens(llama):
    ref, _, host = one_rank(llama, "numpy", [Request(PROMPTS[0], N)])
    assert host == [{"rank": 0, "host_syncs_per_token": 0.0, "host_bytes_per_token": 0.0}]
    got, finish, host = one_rank(llama, "mlx", [Request(PROMPTS[0], N)])
    assert got == ref and finish == ["length"]
    assert host == [{"rank": 0, "host_syncs_per_token": 1.0, "host_bytes_per_token": 4.0}]


def test_one_rank_batch_and_an_eos_mid_burst(llama):
    """Three sequences of different lengths, one ending on an EOS while the next step was
    already built on the device (that step is dropped): numpy's tokens, one sync a step."""
    first = one_rank(llama, "numpy", [Request(PROMPTS[0], N)])[0][0]
    eos = first[4]  # its 5th token: a step past it is already queued when it arrives
    reqs = [Request(PROMPTS[0], N, eos_ids=(eos,)), Request(PROMPTS[1], N - 2),
            Request(PROMPTS[2], N + 1)]
    ref, ref_finish, _ = one_rank(llama, "numpy", reqs)
    got, finish, host = one_rank(llama, "mlx", reqs)
    assert got == ref and finish == ref_finish and finish[0] == "eos"
    steps = max(len(t) for t in got) - 1  # decode steps: one sync each, whoever is in them
    decoded = sum(len(t) - 1 for t in got)
    assert host[0]["host_syncs_per_token"] == pytest.approx(steps / decoded)
    assert host[0]["host_bytes_per_token"] == 4.0


def test_one_rank_sampled_step_is_one_sync_of_the_logits(llama):
    reqs = [Request(PROMPTS[0], N, SamplingParams(temperature=0.7, seed=3))]
    got, _, host = one_rank(llama, "mlx", reqs)
    assert len(got[0]) == N
    assert host[0]["host_syncs_per_token"] == 1.0
    assert host[0]["host_bytes_per_token"] == 4 * 96  # one float32 row of the vocabulary


def test_one_rank_mlx_lm_quantized_folder_gives_mlx_lm_tokens(tmp_path):
    pytest.importorskip("mlx_lm")
    from hpcmac.llm.model.fixtures import mlx_lm_greedy, mlx_lm_quantize

    src = random_checkpoint("llama", tmp_path / "hf", seed=5, initializer_range=0.2,
                            hidden_size=128, intermediate_size=256, vocab_size=256,
                            num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    q = mlx_lm_quantize(src, tmp_path / "q4", 4, 64)
    st = load_stage(q, 0, st_layers(q), backend="mlx")
    assert st.formats == {"mlx q4 g64": sum(st.formats.values())}
    res = run_pipeline(LocalGroup(), st, StageSpec(0, 0, st.end, True, True),
                       st.config.hidden, [Request(PROMPTS[0], N)])
    assert res.seqs[0].tokens == mlx_lm_greedy(q, PROMPTS[0], N)
    assert res.host_per_token()[0]["host_syncs_per_token"] == 1.0


def st_layers(folder) -> int:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return cfg.get("text_config", cfg)["num_hidden_layers"]


STATEFUL = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v32"]


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    """Random tiny checkpoints of the families with recurrent states or indexer keys, made
    on first use (``tiny`` shapes: DeepSeek-V3.2's index top-k is 6)."""
    made: dict = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = random_checkpoint(family, tmp_path_factory.mktemp(family) / "ck",
                                             seed=3, eos_token_id=None)
        return made[family]
    return get


def whole(folder, backend: str, reqs: list[Request], chunk: int | None = None):
    st = load_stage(folder, 0, st_layers(folder), backend=backend)
    res = run_pipeline(LocalGroup(), st, StageSpec(0, 0, st.end, True, True),
                       st.config.hidden, reqs, prefill_chunk=chunk)
    return [s.tokens for s in res.seqs], [s.finish for s in res.seqs], res.host_per_token()


@pytest.mark.parametrize("family", STATEFUL)
def test_stateful_family_is_one_sync_per_token_and_numpy_tokens(family, stateful):
    folder = stateful(family)
    ref, _, _ = whole(folder, "numpy", [Request(PROMPTS[0], N)])
    got, finish, host = whole(folder, "mlx", [Request(PROMPTS[0], N)])
    assert got == ref and finish == ["length"]
    assert host == [{"rank": 0, "host_syncs_per_token": 1.0, "host_bytes_per_token": 4.0}]


LONG = [(7 * i + 3) % 90 for i in range(40)]  # longer than the index top-k (6) and a chunk


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v32"])
def test_stateful_chunked_prefill_batch_and_an_eos_mid_burst(family, stateful):
    """A 40-token prompt prefilled in chunks of 16 beside two short ones, decoded together;
    one ends on an EOS while the next step was already built (the others' states and
    indexer keys must come out as if it never was): numpy's tokens, one sync a step."""
    folder = stateful(family)
    first = whole(folder, "numpy", [Request(LONG, N)], chunk=16)[0][0]
    reqs = [Request(LONG, N, eos_ids=(first[4],)), Request(PROMPTS[1], N - 2),
            Request(PROMPTS[2], N + 1)]
    ref, ref_finish, _ = whole(folder, "numpy", reqs, chunk=16)
    got, finish, host = whole(folder, "mlx", reqs, chunk=16)
    assert got == ref and finish == ref_finish and finish[0] == "eos"
    steps = max(len(t) for t in got) - 1
    decoded = sum(len(t) - 1 for t in got)
    assert host[0]["host_syncs_per_token"] == pytest.approx(steps / decoded)
    assert host[0]["host_bytes_per_token"] == 4.0


def run_generate(np_: int, folder, *args: str, tmp: Path, **extra):
    out = tmp / f"g{np_}-{abs(hash(args))}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_QUIET_TRANSPORT="1",
               HPCMAC_MPIRUN_TIMEOUT="200", **extra)
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, "-m", "hpcmac.llm",
           "generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPTS[0])),
           "--max-tokens", str(N), "--quiet", "--json", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240,
                          cwd=ROOT), out


def generate(np_: int, folder, *args: str, tmp: Path) -> dict:
    proc, out = run_generate(np_, folder, *args, tmp=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    doc["stderr"] = proc.stderr
    return doc


def test_pipeline_of_two_stages_is_one_sync_per_stage(llama, tmp_path):
    ref = one_rank(llama, "numpy", [Request(PROMPTS[0], N)])[0][0]
    doc = generate(2, llama, "--pp", "2", "--backend", "mlx", tmp=tmp_path)
    assert doc["tokens"] == ref
    assert [h["host_syncs_per_token"] for h in doc["host"]] == [1.0, 1.0]
    assert doc["host_syncs_per_token"] == 1.0
    hidden = json.loads((Path(llama) / "config.json").read_text())["hidden_size"]
    assert doc["host"][0]["host_bytes_per_token"] == 4 * hidden  # the hand-over
    assert doc["host"][1]["host_bytes_per_token"] == 4.0  # the greedy id


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """A llama folder quantized by mlx-lm itself (4-bit affine, groups of 64)."""
    pytest.importorskip("mlx_lm")
    from hpcmac.llm.model.fixtures import mlx_lm_quantize

    base = tmp_path_factory.mktemp("q4")
    src = random_checkpoint("llama", base / "hf", seed=5, initializer_range=0.2,
                            hidden_size=128, intermediate_size=256, vocab_size=256,
                            num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    return mlx_lm_quantize(src, base / "q4", 4, 64)


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("which", ["float", "q4"])
def test_tensor_parallel_over_ring_sums_in_the_graph(which, tp, llama, q4, tmp_path):
    folder = llama if which == "float" else q4
    # the numpy backend's tokens (q4: it keeps the same 4-bit words, its own kernels)
    ref = one_rank(folder, "numpy", [Request(PROMPTS[0], N)])[0][0] if which == "float" else \
        run_pipeline(LocalGroup(), *_whole(q4, "numpy"), [Request(PROMPTS[0], N)]).seqs[0].tokens
    doc = generate(tp, folder, "--tp", str(tp), "--backend", "mlx", "--transport", "ring",
                   tmp=tmp_path)
    assert doc["tokens"] == ref
    assert "note:" not in doc["stderr"]
    host = doc["host"]
    assert [h["rank"] for h in host] == list(range(tp))
    assert all(h["host_syncs_per_token"] == 1.0 for h in host), host
    assert host[0]["host_bytes_per_token"] == 4.0  # the leader reads the ids alone
    assert all(h["host_bytes_per_token"] == 0.0 for h in host[1:])
    assert doc["host_syncs_per_token"] == 1.0 and doc["host_bytes_per_token"] == 4.0


def test_tensor_parallel_over_ring_with_linear_attention_states(stateful, tmp_path):
    """Qwen3-Next at --tp 2 over ring: each rank's value heads' states on its device, the
    sums in the graph, one sync a token on each rank."""
    folder = stateful("qwen3_next")
    ref = whole(folder, "numpy", [Request(PROMPTS[0], N)])[0][0]
    doc = generate(2, folder, "--tp", "2", "--backend", "mlx", "--transport", "ring",
                   tmp=tmp_path)
    assert doc["tokens"] == ref
    assert "note:" not in doc["stderr"]
    assert [h["host_syncs_per_token"] for h in doc["host"]] == [1.0, 1.0]
    assert [h["host_bytes_per_token"] for h in doc["host"]] == [4.0, 0.0]


def _whole(folder, backend):
    st = load_stage(folder, 0, st_layers(folder), backend=backend)
    return st, StageSpec(0, 0, st.end, True, True), st.config.hidden


def test_tensor_parallel_over_mpi_is_the_bridge_said_once_and_refused_when_strict(
        llama, tmp_path):
    ref = one_rank(llama, "numpy", [Request(PROMPTS[0], N)])[0][0]
    doc = generate(2, llama, "--tp", "2", "--backend", "mlx", "--transport", "mpi",
                   tmp=tmp_path)
    assert doc["tokens"] == ref
    notes = [ln for ln in doc["stderr"].splitlines() if ln.startswith("note: --backend mlx")]
    assert len(notes) == 1 and "cannot carry MLX arrays" in notes[0], doc["stderr"]
    # counted, not estimated: two sums a layer (3 layers), the embedding's, the head's logits
    assert [h["host_syncs_per_token"] for h in doc["host"]] == [8.0, 8.0]
    proc, _ = run_generate(2, llama, "--tp", "2", "--backend", "mlx", "--transport", "mpi",
                           tmp=tmp_path, HPCMAC_TRANSPORT_STRICT="1")
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "HPCMAC_TRANSPORT_STRICT=1" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_index_top_keys_breaks_ties_to_the_earlier_position_on_both_backends():
    """The indexer's choice (``layers.top_keys``): the k highest scores, a tie at the k-th
    value going to the earlier position, numpy and MLX alike (exact zeros are common:
    every head's relu at 0)."""
    import mlx.core as mx
    import numpy as np

    from hpcmac.llm.model.layers import top_keys

    inf = float("inf")
    score = np.array([[0.5, 0.0, 0.0, 0.9, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [1.0, -inf, -inf, 2.0, -inf, -inf],  # fewer finite keys than k
                      [0.0, 0.3, 0.0, 0.3, 0.3, 0.3]], dtype=np.float32)
    want = np.array([[1, 1, 0, 1, 0, 0],
                     [1, 1, 1, 0, 0, 0],
                     [1, 1, 0, 1, 0, 0],
                     [0, 1, 0, 1, 1, 0]], dtype=bool)
    assert (top_keys(np, score, 3) == want).all()
    assert (np.array(top_keys(mx, mx.array(score), 3)) == want).all()
    rng = np.random.default_rng(0)  # many exact zeros, as relu leaves them
    rand = np.maximum(rng.standard_normal((64, 50)), 0).astype(np.float32)
    got = top_keys(np, rand, 7)
    assert (got.sum(axis=-1) == 7).all()
    assert (np.array(top_keys(mx, mx.array(rand), 7)) == got).all()


def test_mlx_cache_keeps_states_and_indexer_keys_as_mlx_arrays():
    """On MLX the indexer keys and the linear-attention states are MLX arrays in the cache:
    a prefix block carries the indexer keys from one slot to another, a snapshot brings a
    slot's states back after they moved, and freeing a slot zeroes its states."""
    import mlx.core as mx
    import numpy as np

    from hpcmac.llm.model import arch
    from hpcmac.llm.model.backend import get_backend
    from hpcmac.llm.model.cache import KVCache

    be, rng = get_backend("mlx"), np.random.default_rng(0)

    def cache_of(family: str) -> KVCache:
        c = arch.config_from_hf({"model_type": family, **arch.family(family, "").tiny})
        return KVCache(c, 0, c.n_layers, 2, 8, be, [arch.layer(c, i) for i in range(c.n_layers)])

    ds = cache_of("deepseek_v32")
    assert all(isinstance(a, mx.array) for a in ds.index)
    for a in ds.k + ds.v + ds.index:
        a[0] = mx.array(rng.standard_normal(a.shape[1:]).astype(np.float32))
    ds.save(0, 0, 4, 7)
    ds.load(1, [7])
    assert ds.lengths[1] == 4
    for a in ds.k + ds.v + ds.index:
        b = np.array(a)
        assert np.array_equal(b[1, :4], b[0, :4]) and not b[1, 4:].any()
    qn = cache_of("qwen3_next")
    assert qn.recurrent and all(isinstance(qn.v[j], mx.array) for j in qn.recurrent)
    for j in qn.recurrent:
        qn.k[j][1] = mx.array(rng.standard_normal(qn.k[j].shape[1:]).astype(np.float32))
        qn.v[j][1] = mx.array(rng.standard_normal(qn.v[j].shape[1:]).astype(np.float32))
    qn.lengths[1] = 3
    before = [np.array(qn.v[j][1]) for j in qn.recurrent]
    snap = qn.snapshot(1)
    for j in qn.recurrent:
        qn.v[j][1] = qn.v[j][1] * 2.0
    qn.restore(1, snap)
    assert all(np.array_equal(np.array(qn.v[j][1]), b) for j, b in zip(qn.recurrent, before))
    qn.free(1)
    assert all(not np.array(qn.k[j][1]).any() and not np.array(qn.v[j][1]).any()
               for j in qn.recurrent)
