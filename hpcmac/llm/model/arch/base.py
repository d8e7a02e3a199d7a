"""What a model family is: its config mappings and the blocks each of its layers is made of.

A family module (``arch/<model_type>.py``) defines one :class:`Family`; the
registry (``arch/__init__.py``) finds it by ``model_type`` or by GGUF
``general.architecture``. Everything else (the loader, the planners' byte
counts, tensor-parallel slicing, the test fixtures) asks the family. Pure: no
file is read here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcmac.llm.model.arch.fields import GGUFMeta, ModelConfig


@dataclass
class Step:
    """What every layer of one forward step shares (local to the stage).

    seqs : (slot, row offset, n_new, start position) per sequence (``Batch.seqs``)
    cos, sin : (T_total, 1, rope_dim/2) rotary angles of the packed tokens
    scale : attention logit scale
    sum : the tensor group's sum of a partial result (the identity on one rank)
    tokens : (T_total,) the packed token ids, where this stage embedded them (DeepSeek-V4's
        hash-routed experts read them), else None
    """

    seqs: list
    cos: Any
    sin: Any
    scale: float
    sum: Callable
    tokens: Any = None


def _default_gguf_meta(w, cfg: ModelConfig) -> None:
    """Per-head key/value lengths (every family without latent attention)."""
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)


#: the ``quant_methods`` entry of the families with FP8 releases (DeepSeek V3.x and V3.2,
#: Kimi K2, GLM-4.x-FP8, MiniMax M2, Qwen3-FP8, Qwen3-Next-FP8, Qwen3.5-FP8): e4m3 weights
#: with block scales, read by
#: :mod:`hpcmac.llm.model.fp8`
FP8 = {"fp8": "e4m3 with 128 x 128 block scales, kept 8-bit"}
#: the ``quant_methods`` entry of the families with compressed-tensors INT4 releases (Kimi
#: K2 Thinking, K2.5): symmetric pack-quantized integers, read as MLX affine exactly
INT4 = {"compressed-tensors": "pack-quantized INT4 with group scales, kept 4-bit"}


@dataclass(frozen=True)
class Family:
    """One architecture (global: every rank reads the same).

    model_type : Hugging Face ``config.json`` ``model_type``
    gguf_arch : GGUF ``general.architecture`` (None: no GGUF form)
    from_hf : ``(raw config.json dict, where) -> ModelConfig`` (unchecked; the caller checks)
    from_gguf : ``(GGUFMeta) -> ModelConfig``
    layer : ``(cfg, global layer index) -> Layer``: the blocks of that layer
    hf_class : transformers' config class (test fixtures build random checkpoints with it)
    tiny : the fixtures' small shapes (``config.json`` fields)
    gguf_pre : the ``tokenizer.ggml.pre`` values of its GGUF releases: what tells it from the
        other families llama.cpp stores under the same ``gguf_arch`` (``deepseek2``); the
        fixtures write the first
    gguf_qk_permuted : llama.cpp's converter permutes the Q/K rows for its rotary layout
    write_gguf_meta : ``(gguf.GGUFWriter, cfg)``: the family's own GGUF metadata (fixtures)
    summary : one line for ``python -m hpcmac.llm models`` and the docs' table: what is
        particular to the family's layers
    quant_methods : ``config.json`` ``quantization_config.quant_method`` values its loader
        reads, with how (e.g. ``{"mxfp4": "experts decoded to float32"}``); any other is
        refused before weights load
    layouts : the parallel layouts it runs under (``tp``, ``pp``, ``tp+pp``; none: whole on
        one rank only, the others refused in one line by ``load_stage``)
    mlx_quant_tested : an MLX-quantized folder of it is checked by the tests (the reader is
        generic; ``models`` says which are checked)
    mlx_quant_read : the generic reader reads its MLX-quantized folders (False: mlx-lm
        renames its tensors in a form no reader here follows; ``models`` does not list it)
    fp8_float : the linear projections its FP8 releases keep in floats (their
        ``quantization_config.modules_to_not_convert``), by the module name's tail (e.g.
        ``linear_attn.in_proj_ba``); the embedding, the head, the norms and the routers
        are float in every release. The loader keeps 8-bit whatever carries a
        ``weight_scale_inv``; the fixtures' FP8 copy follows this
    """

    model_type: str
    gguf_arch: str | None
    from_hf: Callable[[dict, str], ModelConfig]
    from_gguf: Callable[[GGUFMeta], ModelConfig] | None
    layer: Callable[[ModelConfig, int], Any]
    hf_class: str
    tiny: dict = field(default_factory=dict)
    gguf_qk_permuted: bool = False
    gguf_pre: tuple = ()
    write_gguf_meta: Callable = _default_gguf_meta
    summary: str = ""
    quant_methods: dict = field(default_factory=dict)
    layouts: tuple = ("tp", "pp", "tp+pp")
    mlx_quant_tested: bool = False
    mlx_quant_read: bool = True
    fp8_float: tuple = ()
