"""Kimi K2 (``kimi_k2``: K2-Instruct, K2-Thinking, K2.6's text model): DeepSeek-V3's
architecture and tensors under Moonshot's own ``model_type``, which its ``config.json``
sets so that engines can tell it from DeepSeek-V3. Everything is DeepSeek-V3's
(:mod:`.deepseek_v3`); a K2 GGUF is a ``deepseek2`` file, told from DeepSeek-V3's by its
vocabulary (``tokenizer.ggml.pre`` ``kimi-k2``; a K2.5 file's text part reads as K2).
The released weights are FP8 (K2-Instruct: e4m3 with block scales) or INT4 (K2-Thinking:
compressed-tensors pack-quantized experts), both kept in their precision.
"""

from __future__ import annotations

from dataclasses import replace

from hpcmac.llm.model.arch import deepseek_v3
from hpcmac.llm.model.arch.base import FP8, INT4

FAMILY = replace(deepseek_v3.FAMILY, model_type="kimi_k2", gguf_pre=("kimi-k2",),
                 from_gguf=lambda meta: deepseek_v3.mla_from_gguf(meta, "kimi_k2"),
                 quant_methods={**FP8, **INT4},
                 summary="Kimi K2 (K2-Instruct, K2-Thinking, K2.6 text): DeepSeek-V3's "
                         "layers under Moonshot's own model_type")
