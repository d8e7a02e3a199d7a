"""Bytes a loaded stage really holds: every array it keeps, each object once."""

from __future__ import annotations


def held_nbytes(stage) -> int:
    """Sum of ``nbytes`` over the arrays and packed weights reachable from the stage's
    layers and extras (:meth:`~hpcmac.llm.model.stage.Stage.held`: each object counted
    once; a tied head that is the embedding's own object counts once, a second copy
    twice)."""
    return sum(int(v.nbytes) for v in stage.held() if hasattr(v, "nbytes"))
