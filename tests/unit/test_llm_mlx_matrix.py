"""The MLX backend's correctness matrix (issue #30): every family with a random fixture,
float and quantized, at every layout, against the numpy backend.

Each cell is one family, one form of its folder and one layout:

* forms: ``float`` (float32 safetensors), ``q4`` and ``q8`` (MLX affine, groups of 32,
  as ``mx.quantize`` writes them: :func:`~hpcmac.llm.model.fixtures.mlx_quantized_copy`),
  ``mxfp4`` (MLX ``mode: mxfp4``, as mlx-lm's ``--q-mode mxfp4`` writes it; gpt-oss's
  own release form instead for gpt-oss, its experts' ``*_blocks``/``*_scales``:
  :func:`~hpcmac.llm.model.fixtures.mxfp4_checkpoint`). Widths are multiples of 32, so
  every matrix quantizes; a tensor-parallel slice cut off the groups (``--tp 3``) is
  dequantized by the loader, which is a cell of its own (MLA's ``kv_b_proj`` stays float,
  as the fixture keeps it).
* layouts: one rank (in this process: ``load_stage`` and the pipeline on a local
  group), ``--tp 2`` and ``--tp 3`` over MLX's TCP ring (``--transport ring``: the sums
  and the greedy max-loc inside MLX's graph), and ``--tp 2 --pp 2`` over ring (MLX's
  groups cannot split, mlx#3205: the tensor groups are MPI sub-groups and the sums go
  through the numpy bridge, said once), each through ``tools/mpirun`` and ``generate``:
  a family's forms at one layout in one job (:mod:`generate_cells`, each cell its own
  JSON and stderr), so the job's start-up is paid once a family and layout, not once a
  cell; the cells of a family are one work unit under xdist (tests/conftest.py).

Every cell: greedy tokens equal to the numpy backend's on the same folder at one rank
(a quantized folder kept quantized there too, its own kernels), and the backend's
``host_syncs_per_token`` at the issue's targets where the transport is an MLX group
(one rank: 1; tensor parallel over ring: 1 on every rank, only the leader's ids
cross). The whole matrix is ``slow`` (208 tests, 26 minutes in one worker at load
13-28 on two cores); a few cells, each layout and each form at least once, run always
(about 45 s on a quiet machine).

The mlx-lm reference (mlx-lm's own generation and its ``model.shard``, every family
it implements): ``tests/unit/test_llm_mlx_mlxlm.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("transformers")

from generate_cells import generate_cells, session_cells  # noqa: E402

from hpcmac.comm.local import LocalGroup  # noqa: E402
from hpcmac.llm.parallel.pipeline import Request, run_pipeline  # noqa: E402
from hpcmac.llm.parallel.plan import StageSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 42, 5, 9]
N = 6

#: the first cell of a family at a layout waits for its job, every form's (generate_cells)
pytestmark = pytest.mark.timeout(600)

#: attention widths that are multiples of 32 (heads of 16, 4 query and 2 KV heads)
_A = dict(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2)
_MLA = dict(hidden_size=64, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=16, v_head_dim=16, num_attention_heads=4, num_key_value_heads=4,
            moe_intermediate_size=64, intermediate_size=128)
_LIN = dict(_A, linear_key_head_dim=16, linear_value_head_dim=16)
#: family -> config.json fields over its tiny shapes (seed 5, weights of scale 0.3)
FAMILIES = {
    "llama": dict(_A, intermediate_size=128),
    "qwen2": dict(_A, intermediate_size=128),
    "qwen3": dict(_A, intermediate_size=128),
    "qwen3_moe": dict(_A, moe_intermediate_size=64, intermediate_size=128),
    "deepseek_v3": _MLA,
    "glm4_moe": dict(_A, moe_intermediate_size=64, intermediate_size=128),
    "gpt_oss": dict(_A, intermediate_size=64),
    "minimax_m2": dict(_A, intermediate_size=64),
    "glm4_moe_lite": dict(_MLA, num_key_value_heads=4),
    "deepseek_v32": dict(_MLA, index_n_heads=4, index_head_dim=32),
    "qwen3_next": dict(_LIN, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                       intermediate_size=64),
    "qwen3_5": dict(_LIN, intermediate_size=64),
    "qwen3_5_moe": dict(_LIN, moe_intermediate_size=32, shared_expert_intermediate_size=32),
}
FORMS = ("float", "q4", "q8", "mxfp4")
LAYOUTS = ("np1", "tp2", "tp3", "tp2pp2")
#: the cells that run without ``-m slow``: each layout and each form at least once,
#: dense and MoE, the router kinds apart
CHEAP = {("llama", "q4", "np1"), ("gpt_oss", "mxfp4", "np1"), ("deepseek_v3", "q8", "np1"),
         ("qwen3_moe", "float", "np1"), ("qwen3_moe", "q4", "tp3"),
         ("glm4_moe", "q8", "tp2"), ("qwen3_moe", "float", "tp2pp2")}


def _cells():
    for fam in FAMILIES:
        for form in FORMS:
            for layout in LAYOUTS:
                marks = () if (fam, form, layout) in CHEAP else (pytest.mark.slow,)
                yield pytest.param(fam, form, layout, marks=marks,
                                   id=f"{fam}-{form}-{layout}")


class Folders:
    """The matrix's folders, each written the first time a cell asks for it."""

    def __init__(self, root: Path):
        self.root, self.made = root, {}

    def __call__(self, fam: str, form: str) -> Path:
        if (fam, form) in self.made:
            return self.made[fam, form]
        from hpcmac.llm.model.fixtures import (
            mlx_quantized_copy,
            mxfp4_checkpoint,
            random_checkpoint,
        )

        base = self.root / fam
        if form == "float":
            out = random_checkpoint(fam, base, seed=5, initializer_range=0.3,
                                    eos_token_id=None, **FAMILIES[fam])
        elif fam == "gpt_oss" and form == "mxfp4":  # the release's own form: MXFP4 experts
            out = mxfp4_checkpoint(self(fam, "float"), self.root / f"{fam}-mxfp4", seed=5)
        else:
            bits, mode = {"q4": (4, "affine"), "q8": (8, "affine"), "mxfp4": (4, "mxfp4")}[form]
            out = mlx_quantized_copy(self(fam, "float"), self.root / f"{fam}-{form}", bits,
                                     32, mode)
        self.made[fam, form] = out
        return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("matrix"))


def n_layers(folder) -> int:
    from hpcmac.llm.model.config import load_config

    return load_config(folder).n_layers


def one_rank(folder, backend: str):
    """Greedy tokens and host counts of the whole model on one rank, in this process."""
    from hpcmac.llm.model.stage import load_stage

    n = n_layers(folder)
    st = load_stage(folder, 0, n, backend=backend)
    res = run_pipeline(LocalGroup(), st, StageSpec(0, 0, n, True, True), st.config.hidden,
                       [Request(PROMPT, N)])
    return res.seqs[0].tokens, res.host_per_token()


_REFS: dict = {}


def numpy_tokens(folder) -> list[int]:
    key = str(folder)
    if key not in _REFS:
        toks = one_rank(folder, "numpy")[0]
        assert len(toks) == N and len(set(toks)) > 2, \
            f"{folder}: degenerate greedy sequence {toks} (choose another seed)"
        _REFS[key] = toks
    return _REFS[key]


MATRIX_TEST = "test_mlx_matrix_greedy_tokens_equal_numpy"
#: layout -> (tensor ranks, pipeline stages)
SHAPES = {"tp2": (2, 1), "tp3": (3, 1), "tp2pp2": (2, 2)}


class Jobs:
    """Each family's forms at one layout in one job (:mod:`generate_cells`: its start-up
    once, not once a cell), run the first time a cell of that family and layout asks;
    the forms are the cells of this session (``-m``, ``-k``) that will ask."""

    def __init__(self, items, folders: Folders, root: Path):
        self.items, self.folders, self.root, self.done = items, folders, root, {}

    def __call__(self, fam: str, form: str, layout: str) -> tuple[dict, str] | str:
        if (fam, layout) not in self.done:
            forms = [c["form"] for c in session_cells(self.items, MATRIX_TEST)
                     if (c["fam"], c["layout"]) == (fam, layout)]
            tp, pp = SHAPES[layout]
            flags = ["--tp", str(tp), *(["--pp", str(pp)] if pp > 1 else [])]
            cells = {f: (self.folders(fam, f), flags) for f in forms or [form]}
            self.done[fam, layout] = generate_cells(tp * pp, cells, self.root / f"{fam}-{layout}",
                                                    PROMPT, N)
        return self.done[fam, layout].get(form) or f"{fam} {form} {layout}: not run"


@pytest.fixture(scope="module")
def jobs(request, folders, tmp_path_factory):
    return Jobs(request.session.items, folders, tmp_path_factory.mktemp("jobs"))


def bridge_notes(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("note: --backend mlx")]


@pytest.mark.parametrize("fam, form, layout", list(_cells()))
def test_mlx_matrix_greedy_tokens_equal_numpy(fam, form, layout, folders, jobs):
    folder = folders(fam, form)
    ref = numpy_tokens(folder)
    if layout == "np1":
        got, host = one_rank(folder, "mlx")
        assert got == ref, f"{fam} {form} np1: mlx {got} != numpy {ref}"
        assert host == [{"rank": 0, "host_syncs_per_token": 1.0,
                         "host_bytes_per_token": 4.0}], host
        return
    tp, pp = SHAPES[layout]
    got = jobs(fam, form, layout)
    assert not isinstance(got, str), f"{fam} {form} {layout}: {got}"
    doc, stderr = got
    assert doc["tokens"] == ref, f"{fam} {form} {layout}: mlx {doc['tokens']} != numpy {ref}"
    host = doc["host"]
    assert [h["rank"] for h in host] == list(range(tp * pp)), host
    notes = bridge_notes(stderr)
    if pp == 1:  # the tensor group is MLX's ring: the sums in the graph, one sync a token
        assert notes == [], stderr[-2000:]
        assert all(h["host_syncs_per_token"] == 1.0 for h in host), host
        assert host[0]["host_bytes_per_token"] == 4.0  # the leader reads the ids alone
        assert all(h["host_bytes_per_token"] == 0.0 for h in host[1:]), host
    else:  # MPI sub-groups: the numpy bridge, said once (no target: not an MLX group)
        assert len(notes) == 1 and "mlx#3205" in notes[0], stderr[-2000:]
        assert all(h["host_syncs_per_token"] > 1.0 for h in host), host
