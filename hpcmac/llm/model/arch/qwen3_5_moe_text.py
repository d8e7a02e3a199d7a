"""Qwen3.5-MoE's text model alone (``qwen3_5_moe_text``: a folder as transformers'
``Qwen3_5MoeForCausalLM`` saves it, tensors under ``model.``): the :mod:`.qwen3_5_moe`
family."""

from __future__ import annotations

from dataclasses import replace

from hpcmac.llm.model.arch import qwen3_5_moe

FAMILY = replace(qwen3_5_moe.FAMILY, model_type="qwen3_5_moe_text",
                 summary="Qwen3.5-MoE's text model saved alone: the `qwen3_5_moe` family")
