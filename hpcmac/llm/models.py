"""``python -m hpcmac.llm models``: the families and checkpoint formats this build reads.

Everything printed is read from the family modules (:mod:`hpcmac.llm.model.arch`) and
the format modules (:mod:`~hpcmac.llm.model.quant`, :mod:`~hpcmac.llm.model.gguf_quant`,
:mod:`~hpcmac.llm.model.gguf_loader`); nothing is kept here. The table in
``docs/llm.md`` is this module's ``--markdown`` output, checked by a test.
"""

from __future__ import annotations

import json

from hpcmac.llm.model.arch import families


def _checkpoints(fam) -> list[str]:
    out = ["safetensors F32/F16/BF16"]
    out += [f"`{m}` ({how})" for m, how in fam.quant_methods.items()]
    if fam.mlx_quant_read:
        out.append("MLX affine" + (" (tested)" if fam.mlx_quant_tested else " (read, untested)"))
    if fam.gguf_arch:
        out.append(f"GGUF `{fam.gguf_arch}`")
    return out


def rows() -> list[dict]:
    """One dict per family: model_type, summary, checkpoints, layouts."""
    return [dict(model_type=n, summary=f.summary, checkpoints=_checkpoints(f),
                 layouts=list(f.layouts)) for n, f in families().items()]


def formats() -> dict:
    """The checkpoint formats, with what is kept quantized."""
    from hpcmac.llm.model.gguf_loader import SUPPORTED_QUANTS
    from hpcmac.llm.model.gguf_quant import EXACT
    from hpcmac.llm.model.quant import BITS, GROUPS, MODES

    return {
        "safetensors": "F32, F16, BF16 tensors, held as float32; FP8 e4m3 weights with "
                       "block weight_scale_inv (quant_method fp8) kept 8-bit; gpt-oss's MXFP4 "
                       "*_blocks/*_scales kept 4-bit",
        "mlx": f"MLX-quantized folders: mode {', '.join(MODES)}, bits "
               f"{', '.join(map(str, BITS))}, group_size {', '.join(map(str, GROUPS))}; "
               "kept quantized",
        "gguf": f"GGUF types {', '.join(SUPPORTED_QUANTS)}; {', '.join(EXACT)} kept "
                "quantized (exactly), the others as float32",
    }


def markdown() -> str:
    """The families as a Markdown table (``docs/llm.md`` holds this text)."""
    lines = ["| family (`model_type`) | what its layers have | checkpoints | layouts |",
             "|---|---|---|---|"]
    for r in rows():
        lines.append(f"| `{r['model_type']}` | {r['summary']} | "
                     f"{'; '.join(r['checkpoints'])} | {', '.join(r['layouts']) or 'one rank'} |")
    return "\n".join(lines) + "\n"


def text() -> str:
    """The plain listing for a terminal."""
    out = []
    for r in rows():
        out.append(f"{r['model_type']}: {r['summary'].replace('`', '')}")
        out.append(f"    checkpoints: {'; '.join(r['checkpoints']).replace('`', '')}")
        out.append(f"    layouts: {', '.join(r['layouts']) or 'one rank'}")
    out.append("formats:")
    out += [f"    {k}: {v}" for k, v in formats().items()]
    return "\n".join(out) + "\n"


def add_models_args(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json", action="store_true", help="one JSON object on stdout")
    g.add_argument("--markdown", action="store_true", help="the docs' Markdown table")


def run_models(args) -> int:
    if args.json:
        print(json.dumps({"families": rows(), "formats": formats()}, indent=1))
    else:
        print(markdown() if args.markdown else text(), end="")
    return 0
