"""The transport shim: one Group interface, one module per transport.

>>> from hpcmac import comm
>>> world = comm.init()          # collective; "auto": rdma if every rank has it, else mpi
>>> world.rank, world.size
"""

from hpcmac.comm.base import Group, Request
from hpcmac.comm.select import (
    TRANSPORTS,
    add_transport_argument,
    announce,
    check_transport,
    init,
    job_group,
)

__all__ = ["Group", "Request", "TRANSPORTS", "add_transport_argument", "announce",
           "check_transport", "init", "job_group"]
