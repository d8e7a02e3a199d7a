"""Starting MPI quickly: the Open MPI settings a host without RDMA hardware wants, and a
timed ``from mpi4py import MPI`` (which runs ``MPI_Init``).

Measured here (Open MPI 5.0 wheel, Linux, no InfiniBand/EFA/Omni-Path device):
``MPI_Init`` took 1.1 s, of which 1.0 s is a ``sleep(1)`` in the closing of the
``btl/ofi`` component after libfabric finds no device, and ~40 ms the ``mtl/ofi``
probe; with ``OMPI_MCA_btl=^ofi OMPI_MCA_mtl=^ofi OMPI_MCA_pml=ob1`` it takes
0.05-0.1 s. On such a host those components can never be used (libfabric's
providers in the wheel are verbs, EFA and PSM2: all need a device under
``/sys/class/infiniband``), so :func:`open_mpi_defaults` proposes turning them
off; the user's own ``OMPI_MCA_btl``/``mtl``/``pml`` (any of them set) or
``HPCMAC_OMPI_DEFAULTS=0`` leave Open MPI untouched. The settings only act when
hpcmac imports mpi4py first (``python -m hpcmac ...``); ``hpcmac-mpirun`` and
``tools/mpirun`` export them for every entry point (``python -m mpi4py`` too).
"""

from __future__ import annotations

import os
import sys
import time

#: what :func:`load` measured: seconds of ``from mpi4py import MPI`` (with MPI_Init),
#: and the Open MPI variables it set (empty when it set none)
STARTUP: dict = {}


def open_mpi_defaults(environ: dict | None = None, platform: str | None = None,
                      rdma: bool | None = None) -> dict[str, str]:
    """The Open MPI variables to set before ``MPI_Init``: see
    :func:`hpcmac.mpirun.open_mpi_defaults` (one rule for the launcher and the ranks)."""
    from hpcmac.mpirun import open_mpi_defaults as rule

    return rule(os.environ if environ is None else environ,
                sys.platform if platform is None else platform, rdma)


def load():
    """``from mpi4py import MPI`` with :func:`open_mpi_defaults` applied; records the time
    in :data:`STARTUP` (only the first call, which is the one that initialises MPI)."""
    if "mpi4py.MPI" in sys.modules:
        return sys.modules["mpi4py.MPI"]
    extra = open_mpi_defaults()
    os.environ.update(extra)
    t0 = time.perf_counter()
    from mpi4py import MPI

    STARTUP.update(mpi_import_s=time.perf_counter() - t0, ompi_defaults=extra)
    return MPI
