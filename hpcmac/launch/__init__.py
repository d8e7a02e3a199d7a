"""hpcmac.launch: one JSON hostfile for a Thunderbolt mesh, launched through mpirun or mlx.launch.

Modules, each with one job:

* :mod:`~hpcmac.launch.hostfile` -- the schema, loading, pure validation;
* :mod:`~hpcmac.launch.topology` -- mesh/ring shape, per-peer routes, rank placement;
* :mod:`~hpcmac.launch.convert` -- Open MPI / MPICH / mlx.launch hostfiles, MCA
  settings, the RDMA device matrix, route-table checks;
* :mod:`~hpcmac.launch.runner` -- the launcher's argument list, and running it;
* :mod:`~hpcmac.launch.discover` -- reading a mesh's cabling over ssh;
* :mod:`~hpcmac.launch.selftest` -- an end-to-end check of a launched job;
* ``python -m hpcmac.launch`` -- the command line (see docs/mesh.md).

Importing this package starts nothing (no MPI, no subprocess).
"""
