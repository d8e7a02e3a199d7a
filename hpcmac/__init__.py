"""hpcmac: an MPI application suite for Apple-silicon Thunderbolt meshes and any MPI cluster.

Importing hpcmac (or any subpackage) never initialises MPI; that happens in
:func:`hpcmac.comm.init` or when a command runs.
"""

__version__ = "0.1.0"
