"""mlx-lm's own generation as the reference for the MLX backend, every family mlx-lm
implements (issue #30).

Each family's random folder (the matrix's tiny shapes, :data:`FAMILIES`, vocabulary 128)
is converted **by mlx-lm** (``mlx_lm_quantize``: its ``sanitize`` and, quantized, its
``quantize_model``), so the folder is in mlx-lm's own layout: MLA's ``kv_b_proj`` split
into ``embed_q``/``unembed_out``, experts stacked in ``switch_mlp`` (gpt-oss's
``experts.{gate,up,down}_proj``), Gated DeltaNet norms stored ``1 + w``. Forms: ``float``
(converted, not quantized), ``q4`` (affine, groups of 32) and ``mxfp4`` (``--q-mode
mxfp4``). Exceptions, each mlx-lm's:

* gpt-oss: mlx-lm reads only the MXFP4 release (``*_blocks``/``*_scales``): a float
  folder in transformers' layout (``experts.gate_up_proj`` (E, D, 2I)) is refused, its
  sanitize slicing the input axis and naming the parameter ``experts.gate_proj`` with no
  ``.weight`` (``mlx_lm/models/gpt_oss.py``, ``Model.sanitize``, 0.32.2). Its forms here are
  the release converted (``mxfp4``: experts MXFP4, the rest float) and that quantized
  (``q4``: the rest 4-bit affine).
* Qwen3.5: mlx-lm has no text-only model type; the folder is laid out as released
  (``text_config``, ``model.language_model.``, fused experts: ``qwen3_5_released``).
* Kimi K2 / K2.5: mlx-lm reads them as DeepSeek-V3 (``kimi_k2``) and K2.5's vision wrapper;
  hpcmac's ``kimi_k2`` is DeepSeek-V3's layers (that cell) and K2.5 has no random fixture.

Cells:

* one rank (in this process): hpcmac ``--backend mlx`` and ``--backend numpy`` give
  mlx-lm's greedy tokens (``mlx_lm_greedy``, its ``generate_step`` with an argmax);
* ``--tp 2 --transport ring`` (``tools/mpirun``, ``generate``) gives the tokens of
  mlx-lm's model sharded over MLX's ring (``model.shard`` under ``mlx.launch --backend
  ring``, as ``mlx_lm.utils.sharded_load`` does once loaded; the script is
  :data:`hpcmac.bench.llm_mlx.MLX_LM`), for every family whose mlx-lm model has
  ``shard``; every sharded cell of the session in two jobs, one of mlx-lm's and one of
  hpcmac's ``generate`` cells (:mod:`generate_cells`), each cell checking its own result.
  mlx-lm's shard's constraints, met by the shapes: query and KV heads (MLA: heads; Gated
  DeltaNet: key and value heads) divisible by 2; quantized, each sharded-to-all input
  (``o_proj``'s heads x head_dim, ``down_proj``'s intermediate, the experts') divisible
  by 2 x 32. Qwen3-Next's mlx-lm model has no ``shard``.

Two cells run always (a dense family at one rank, an MoE one over the ring); the rest
are ``slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")

from generate_cells import generate_cells, session_cells  # noqa: E402
from ports import free_base_port  # noqa: E402
from test_llm_mlx_matrix import FAMILIES, PROMPT, N, bridge_notes, one_rank  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

#: the families mlx-lm implements -> whether its model has ``shard``
MLX_LM_SHARDS = {"llama": True, "qwen2": True, "qwen3": True, "qwen3_moe": True,
                 "deepseek_v3": True, "glm4_moe": True, "gpt_oss": True, "minimax_m2": True,
                 "glm4_moe_lite": True, "deepseek_v32": True, "qwen3_next": False,
                 "qwen3_5": True, "qwen3_5_moe": True}
#: what mlx-lm calls Qwen3.5's released folders
_RELEASED = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}
#: the cells that run without ``-m slow``
CHEAP_ONE = {("deepseek_v3", "q4")}  # mlx-lm's split kv_b_proj, quantized
CHEAP_TP = {("qwen3_moe", "float")}
#: each family's unquantized form (gpt-oss: its MXFP4 release, see above)
BASE = {f: "mxfp4" if f == "gpt_oss" else "float" for f in MLX_LM_SHARDS}
#: one-rank forms: unquantized and q4 for every family; mlx-lm's mxfp4 for a dense and
#: an MLA one
ONE_RANK = [(f, form) for f in MLX_LM_SHARDS for form in (BASE[f], "q4")] + \
    [("llama", "mxfp4"), ("deepseek_v3", "mxfp4")]
#: sharded: unquantized for every family with shard; q4 for a dense, an MoE, an MLA one
#: and gpt-oss (Qwen3.5-MoE's experts of 32 inputs cannot shard 4-bit in groups of 32)
SHARDED = [(f, BASE[f]) for f, s in MLX_LM_SHARDS.items() if s] + \
    [("llama", "q4"), ("qwen3_moe", "q4"), ("deepseek_v3", "q4"), ("gpt_oss", "q4")]


class Folders:
    """mlx-lm's conversions of each family's random folder, made the first time asked."""

    def __init__(self, root: Path):
        self.root, self.made = root, {}

    def __call__(self, fam: str, form: str) -> Path:
        if (fam, form) in self.made:
            return self.made[fam, form]
        from hpcmac.llm.model.fixtures import (
            mlx_lm_quantize,
            mxfp4_checkpoint,
            qwen3_5_released,
            random_checkpoint,
        )

        base = self.root / fam
        if not (base / "src").exists():
            arch = fam + "_text" if fam in _RELEASED else fam
            src = random_checkpoint(arch, base / "hf", seed=5, initializer_range=0.3,
                                    eos_token_id=None, vocab_size=128, **FAMILIES[fam])
            if fam in _RELEASED:
                src = qwen3_5_released(src, base / "released", _RELEASED[fam])
            elif fam == "gpt_oss":  # the only gpt-oss mlx-lm reads: the MXFP4 release
                src = mxfp4_checkpoint(src, base / "release", seed=5)
            (base / "src").write_text(str(src))
        src = Path((base / "src").read_text())
        bits, mode = {"float": (None, "affine"), "q4": (4, "affine"),
                      "mxfp4": (4, "mxfp4")}[form]
        if fam == "gpt_oss":  # the release's experts stay MXFP4; q4: the rest 4-bit
            bits, mode = {"mxfp4": (None, "affine"), "q4": (4, "affine")}[form]
        out = mlx_lm_quantize(src, base / form, bits, 32, mode=mode)
        self.made[fam, form] = out
        return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("mlxlm"))


_THEIRS: dict = {}


def mlx_lm_tokens(folder) -> list[int]:
    """mlx-lm's one-process greedy tokens (checked not degenerate), once per folder."""
    from hpcmac.llm.model.fixtures import mlx_lm_greedy

    key = str(folder)
    if key not in _THEIRS:
        toks = mlx_lm_greedy(folder, PROMPT, N)
        assert len(toks) == N and len(set(toks)) > 2, \
            f"{folder}: degenerate greedy sequence {toks} (choose another seed)"
        _THEIRS[key] = toks
    return _THEIRS[key]


def _param(fam, form, cheap):
    return pytest.param(fam, form, id=f"{fam}-{form}",
                        marks=() if (fam, form) in cheap else (pytest.mark.slow,))


@pytest.mark.parametrize("fam, form", [_param(f, m, CHEAP_ONE) for f, m in ONE_RANK])
def test_one_rank_tokens_equal_mlx_lm(fam, form, folders):
    folder = folders(fam, form)
    theirs = mlx_lm_tokens(folder)
    got, host = one_rank(folder, "mlx")
    assert got == theirs, f"{fam} {form}: hpcmac mlx {got} != mlx-lm {theirs}"
    assert host[0]["host_syncs_per_token"] == 1.0, host
    ref = one_rank(folder, "numpy")[0]
    assert ref == theirs, f"{fam} {form}: hpcmac numpy {ref} != mlx-lm {theirs}"


SHARDED_TEST = "test_tp2_ring_tokens_equal_mlx_lm_sharded"


def mlx_lm_sharded(folders: dict, tp: int, tmp: Path) -> dict[str, list[int] | str]:
    """mlx-lm's greedy tokens with each model sharded over ``tp`` ranks of MLX's ring, all
    in one ``mlx.launch`` job (the script's folders in turn): name -> tokens, or a line
    saying why there are none (every folder's when the job failed after the last: a job of
    one folder had to exit 0)."""
    from hpcmac.bench.llm_mlx import MLX_LM

    tmp.mkdir(parents=True, exist_ok=True)
    script = tmp / "mlx_lm_sharded.py"
    script.write_text(MLX_LM)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = Path(sys.executable).with_name("mlx.launch")
    cap = 150 + 30 * len(folders)  # start-up once, then each folder's load and decode
    cmd = ["timeout", "-k", "5", str(cap), str(launcher), "-n", str(tp), "--backend", "ring",
           "--starting-port", str(free_base_port(tp)), "--", sys.executable, str(script),
           str(N), str(tp), ",".join(map(str, PROMPT)), *map(str, folders.values())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=cap + 30,
                          cwd=ROOT, start_new_session=True)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    by_path = {d["model"]: d["tokens"] for d in lines}
    if proc.returncode != 0 and len(by_path) == len(folders):  # it failed in its end
        by_path = {}
    why = f"mlx.launch exit {proc.returncode}: {(proc.stdout + proc.stderr)[-3000:]}"
    return {name: by_path.get(str(folder), f"{name}: no tokens, or the job failed after "
                                            f"them; {why}")
            for name, folder in folders.items()}


class Sharded:
    """Both sides of every sharded cell this session runs, in two jobs (mlx-lm's under
    ``mlx.launch``, hpcmac's ``generate`` cells under ``tools/mpirun``), run the first
    time a cell asks: name -> (mlx-lm's tokens, hpcmac's (JSON, stderr)), either a line
    saying why it is missing."""

    def __init__(self, items, folders: Folders, root: Path):
        self.items, self.folders, self.root, self.done = items, folders, root, None

    def __call__(self, fam: str, form: str) -> tuple:
        if self.done is None:
            cells = [(c["fam"], c["form"]) for c in session_cells(self.items, SHARDED_TEST)]
            paths = {f"{f}-{m}": self.folders(f, m) for f, m in cells or [(fam, form)]}
            theirs = mlx_lm_sharded(paths, 2, self.root / "mlx_lm")
            ours = generate_cells(2, {k: (p, ["--tp", "2"]) for k, p in paths.items()},
                                  self.root / "hpcmac", PROMPT, N)
            self.done = {k: (theirs[k], ours[k]) for k in paths}
        return self.done.get(f"{fam}-{form}", (f"{fam} {form}: not run",) * 2)


@pytest.fixture(scope="module")
def sharded(request, folders, tmp_path_factory):
    return Sharded(request.session.items, folders, tmp_path_factory.mktemp("sharded"))


@pytest.mark.timeout(300 + 120 * len(SHARDED))  # the first cell runs every cell's jobs
@pytest.mark.parametrize("fam, form", [_param(f, m, CHEAP_TP) for f, m in SHARDED])
def test_tp2_ring_tokens_equal_mlx_lm_sharded(fam, form, folders, sharded):
    folder = folders(fam, form)
    theirs, ours = sharded(fam, form)
    assert not isinstance(theirs, str), theirs
    assert len(theirs) == N and len(set(theirs)) > 2, theirs
    assert not isinstance(ours, str), ours
    doc, stderr = ours
    assert doc["tokens"] == theirs, f"{fam} {form}: hpcmac {doc['tokens']} != mlx-lm " \
                                    f"sharded {theirs}"
    # and mlx-lm's own sharding changes nothing: its one-process tokens are the same
    assert mlx_lm_tokens(folder) == theirs
    assert bridge_notes(stderr) == [] and doc["host_syncs_per_token"] == 1.0, doc["host"]
