"""The MLX backend's experts on the device against the numpy backend's, at any rank count.

The MLX backend routes with MLX ops and runs the chosen experts as one gathered matmul
per projection (``layers.gathered_experts``: ``mx.gather_mm``, ``mx.gather_qmm``); numpy
routes on the host and runs each chosen expert over its rows. Every router kind is here:
softmax top-k (qwen3_moe), sigmoid with correction bias and groups, scaled, with shared
experts (deepseek_v3, glm4_moe; minimax_m2 ungrouped), gpt-oss's biased top-k softmax with
its clamped SwiGLU and expert biases. Each family float and MLX-quantized (affine 4-bit
g32 and MXFP4 as ``mx.quantize`` writes them; gpt-oss's experts MXFP4 as it publishes
them, its other matrices float or affine 4-bit), tensor parallel over all ranks (one
rank: the whole model). Two prompts together, the 40-token one prefilled whole (the
sorted, per-pair gathered path: ``SORT_PAIRS``), then batched decode (the unsorted one):
greedy tokens equal, logits within 1e-4 of the largest; at one rank, one host sync per
decode step (the backend's count: no round trip per MoE layer).
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from family_util import run

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]
pytest.importorskip("mlx.core")

N_NEW = 8
#: widths that are multiples of 32 (and of 32 on each of two tensor ranks' halves of the
#: expert width): every matrix quantizes at group 32
_Q = dict(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
#: family -> (seed, config.json fields over its tiny shapes)
FAMILIES = {
    "qwen3_moe": (5, dict(_Q, moe_intermediate_size=64, intermediate_size=128)),
    "deepseek_v3": (5, dict(hidden_size=64, moe_intermediate_size=64, intermediate_size=128,
                            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                            qk_rope_head_dim=16, v_head_dim=16, num_attention_heads=4,
                            num_key_value_heads=4)),
    "glm4_moe": (5, dict(_Q, moe_intermediate_size=64, intermediate_size=128)),
    "minimax_m2": (5, dict(_Q, intermediate_size=64)),
    "gpt_oss": (5, dict(_Q, intermediate_size=64)),
}
FORMS = ("float", "q4-g32", "mxfp4")


@pytest.fixture(scope="module")
def folders():
    """family -> form -> folder, written by rank 0, the same on every rank."""
    from hpcmac.llm.model.fixtures import mlx_quantized_copy, mxfp4_checkpoint, random_checkpoint

    g = world()
    root = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-mlxmoe-") if g.rank == 0 else None, 0)
    out = {}
    for fam, (seed, fields) in FAMILIES.items():
        base = f"{root}/{fam}"
        out[fam] = {"float": base, "q4-g32": base + "-q4", "mxfp4": base + "-mxfp4"}
        if g.rank == 0:
            random_checkpoint(fam, base, seed=seed, initializer_range=0.3, **fields)
            if fam == "gpt_oss":  # its experts are not .weight matrices: MXFP4 as published
                mxfp4_checkpoint(base, base + "-mxfp4", seed)  # and the rest affine 4-bit:
                mlx_quantized_copy(base + "-mxfp4", base + "-q4", 4, 32)
            else:
                mlx_quantized_copy(base, base + "-q4", 4, 32)
                mlx_quantized_copy(base, base + "-mxfp4", 4, 32, "mxfp4")
    g.barrier()
    yield out
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_mlx_experts_match_numpy(folders, fam, form):
    g = world()
    path = folders[fam][form]
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, 96, n))) for n in (40, 5)]
    got = {be: run(path, g.size, prompts, n_new=N_NEW, chunk=64, backend=be)
           for be in ("numpy", "mlx")}
    for i in range(len(prompts)):
        a, b = got["numpy"].seqs[i], got["mlx"].seqs[i]
        what = f"{fam} {form} np={g.size} seq {i}"
        parallel_assert(a.tokens == b.tokens, f"{what}: mlx {b.tokens} != numpy {a.tokens}", g)
        la, lb = np.array(a.logits), np.array(b.logits)
        err = float(np.max(np.abs(la - lb)))
        parallel_assert(err <= 1e-4 * float(np.max(np.abs(la))),
                        f"{what}: logits differ by {err:.3g}", g)
    if g.size == 1:  # no host round trip per MoE layer: the step's one sync, the tokens
        host = got["mlx"].host_per_token()[0]
        assert host["host_syncs_per_token"] == 0.5, host  # two sequences per decode step
    if form != "float" and g.rank == 0:  # the experts held quantized, as one stack
        from hpcmac.llm.model.backend import QWeight
        from hpcmac.llm.model.config import load_config
        from hpcmac.llm.model.stage import load_stage

        n = load_config(path).n_layers
        e_gu = load_stage(path, n - 1, n, False, True, backend="mlx").layers[-1]["e_gu"]
        assert isinstance(e_gu, QWeight) and e_gu.wq.ndim == 3, (fam, form, type(e_gu))
        mode = "mxfp4" if form == "mxfp4" or fam == "gpt_oss" else "affine"
        assert e_gu.mode == mode, (fam, form, e_gu.mode)
    parallel_assert(len(set(got["numpy"].seqs[0].tokens)) > 2,
                    f"{fam} {form}: degenerate greedy sequence (choose another seed)", g)
