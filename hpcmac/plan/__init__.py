"""hpcmac.plan: a performance model of HPL and LLM decoding on a cluster of nodes.

Pure Python, no MPI at import: predict before buying or cabling. See
``docs/plan.md`` and ``python -m hpcmac.plan --help``.
"""

from hpcmac.plan.cluster import Cluster, Node, build
from hpcmac.plan.hpl import HplCase, HplPrediction, predict, suggest
from hpcmac.plan.machines import LINKS, MACHINES, Link, Machine, Rates

__all__ = ["Cluster", "HplCase", "HplPrediction", "LINKS", "Link", "MACHINES", "Machine",
           "Node", "Rates", "build", "predict", "suggest"]
