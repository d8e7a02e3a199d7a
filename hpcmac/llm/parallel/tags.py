"""Every point-to-point message tag of the LLM runtime, in one place.

The pipeline's, the tensor group's and the busy reports' messages can travel on
the same communicator (a pipeline of the whole world, a tensor group of the
whole world, both with rank 0), where a receive posted for one kind matches a
message of another kind with the same source and tag: two modules that each
picked 73 made a 32-byte busy receive take a logprob row (MPI_ERR_TRUNCATE, the
server down). So a tag is taken here and nowhere else; a test checks that they
differ and that no other module under ``hpcmac/llm`` or ``hpcmac/plan`` defines one.
"""

from __future__ import annotations

#: pipeline: activations and control forward, token ids back to rank 0, logprob rows
TAG_FWD, TAG_RET, TAG_LOGP = 71, 72, 73
#: busy reports to world rank 0 (:mod:`.busy`)
TAG_BUSY = 74
#: tensor group: partial sums, the leader's step, the head's max-loc / gather
TAG_SUM, TAG_STEP, TAG_HEAD = 81, 82, 83
#: plan calibration's tensor-cost job: the leader wakes its followers
TAG_WAKE = 95

ALL = {name: value for name, value in dict(globals()).items() if name.startswith("TAG_")}
