"""``serve --survive``: lose a host, keep serving (docs/faults.md, "Serving through a lost host").

The boundary: a **front** process outside the MPI job (:mod:`.supervisor`) owns
the HTTP port (the same app as ``serve``, :func:`hpcmac.llm.server.build_app`,
over :class:`.front.FrontSource`), the request queue and each request's
tokens so far; the **job** (mpirun over the hosts in use, launched through
:mod:`hpcmac.launch`) opens no HTTP port: rank 0 feeds its scheduler from
the front over one loopback channel (:mod:`.channel`, :mod:`.worker`). When
the job is lost the front names the host, re-places the model on the
survivors (:mod:`.replace`, the one pure ``place()``), relaunches, and
resubmits every open request with the tokens it has streamed.
"""
