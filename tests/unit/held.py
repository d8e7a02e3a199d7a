"""Bytes a loaded stage really holds: every array it keeps, each object once."""

from __future__ import annotations


def held_nbytes(stage) -> int:
    """Sum of ``nbytes`` over the arrays and packed weights reachable from the stage's
    layers and extras, each object counted once (a tied head that is the embedding's
    own object counts once; a second copy counts twice)."""
    seen, total = set(), 0

    def walk(v):
        nonlocal total
        if id(v) in seen or isinstance(v, (bool, int, float, str)) or v is None:
            return
        seen.add(id(v))
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif hasattr(v, "nbytes"):
            total += int(v.nbytes)

    walk(stage.layers)
    walk(stage.extra)
    return total
