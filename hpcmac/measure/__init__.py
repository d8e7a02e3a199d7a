"""Measuring kernels that both ``hpcmac.bench`` and ``hpcmac.plan`` use.

``bench`` prints a measure against a reference run beside it; ``plan`` feeds
measures into its performance model. Neither imports the other: what both need
lives here.
"""
