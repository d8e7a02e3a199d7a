"""The MLX backend's host syncs per decode token, by layout: the rule its counters obey.

Every place the model leaves MLX goes through ``MLXBackend.host`` / ``MLXBackend.eval``,
and each call is one host sync (docs/llm.md, "The MLX path"). What a greedy decode
token costs, on each rank of a stage:

* the stage's output once: the token id (last stage) or the hidden state handed to
  the next stage: **1**, whatever the layout, when the tensor group's sums are in
  MLX's graph or there is no tensor group;
* a tensor group whose sums go through numpy (the bridge: MPI, or a tensor group of a
  pipeline, since MLX's groups cannot split, mlx#3205) adds **2 a layer** (each
  all-reduce brings its partial sum to the host) and, on the first stage, **1** for
  the embedding's all-reduce (hpcmac splits the embedding by vocabulary).

At one rank the scheduler builds step t+1 before it reads step t's ids
(``mx.async_eval``, as mlx-lm's ``generate_step``), so that one sync does not stall
the device; every other sync does. The counts are asserted against the backend's
own counters by ``tests/unit/test_llm_mlx_sync.py`` and ``test_llm_mlx_matrix.py``
(3 layers: 1 at one rank, 1 per stage at ``--pp 2``, 1 at ``--tp 2`` over ring, 8 at
``--tp 2`` over MPI; ``--tp 2 --pp 2`` with layers [2, 1]: 6 and 3). ``hpcmac.plan``
reads this module to cost them. Pure: no MLX, no MPI.
"""

from __future__ import annotations

#: transports that carry MLX arrays (one MLX group of the whole job: ring or JACCL)
GRAPH_TRANSPORTS = ("ring", "rdma")
#: host syncs per layer when a tensor group's sums go through numpy
BRIDGE_SYNCS_PER_LAYER = 2
#: where a tensor x pipeline hybrid's sums go under the MLX backend, and why (said by
#: ``hpcmac info`` and by the runtime's note)
HYBRID_RULE = ("tensor x pipeline hybrids keep their tensor groups on MPI sub-groups "
               "(MLX's ring and JACCL groups cannot split, mlx#3205): their sums go through "
               f"numpy, {BRIDGE_SYNCS_PER_LAYER} host syncs a layer; one tensor group of the "
               "whole job over ring or rdma sums inside MLX's graph")


def graph_sums(tp: int, pp: int, transport: str) -> bool:
    """Whether a tensor group's all-reduces run inside MLX's graph: a group over a
    transport that carries MLX arrays, and the whole job (``pp == 1``)."""
    return tp > 1 and pp == 1 and transport in GRAPH_TRANSPORTS


def stage_syncs(layers: int, first: bool, tp: int, graph: bool) -> int:
    """Host syncs per greedy decode token on each rank of one stage of ``layers``
    layers (``first``: it holds the embedding) with ``tp`` ranks; ``graph`` as
    :func:`graph_sums`."""
    if layers < 1 or tp < 1:
        raise ValueError(f"a stage needs >= 1 layer and >= 1 rank, got {layers}, {tp}")
    if tp > 1 and not graph:
        return BRIDGE_SYNCS_PER_LAYER * layers + (1 if first else 0) + 1
    return 1


def pipelined(tp: int, pp: int) -> bool:
    """Whether the step's one sync overlaps the device's work (the next step is built
    and queued before it): one rank, one stage."""
    return tp == 1 and pp == 1
