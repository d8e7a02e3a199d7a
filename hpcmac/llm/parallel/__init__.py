"""A model over several ranks: plan (stage split, byte counts, memory budgets),
pipeline (stages hand activations down a chain), link (the pipeline's messages and
its watchdog), results (what a run returns). Communication only through
:mod:`hpcmac.comm`.
"""
