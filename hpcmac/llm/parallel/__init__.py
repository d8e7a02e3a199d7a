"""A model over several ranks: plan (stage split, byte counts, memory budgets),
layout (tp x pp choice, each rank's shard and fit), pipeline (stages hand
activations down a chain), tensor (tensor groups: the all-reduce the model calls,
leaders and followers), link (messages and the waiting policy), results (what a
run returns). Communication only through :mod:`hpcmac.comm`.
"""
