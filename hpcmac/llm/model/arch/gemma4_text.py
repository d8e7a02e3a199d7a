"""Gemma 4's text model alone (``gemma4_text``: a folder as transformers'
``Gemma4ForCausalLM`` saves it, tensors under ``model.``): the :mod:`.gemma4` family."""

from __future__ import annotations

from dataclasses import replace

from hpcmac.llm.model.arch import gemma4

FAMILY = replace(gemma4.FAMILY, model_type="gemma4_text",
                 summary="Gemma 4's text model saved alone: the `gemma4` family")
