"""Qwen3.5's text model alone (``qwen3_5_text``: a folder as transformers'
``Qwen3_5ForCausalLM`` saves it, tensors under ``model.``): the :mod:`.qwen3_5` family."""

from __future__ import annotations

from dataclasses import replace

from hpcmac.llm.model.arch import qwen3_5

FAMILY = replace(qwen3_5.FAMILY, model_type="qwen3_5_text",
                 summary="Qwen3.5's text model saved alone: the `qwen3_5` family")
