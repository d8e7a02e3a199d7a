"""A deliberately deadlocking MPI test: run only by tests/unit/test_harness.py."""

from mpi4py import MPI


def test_deliberate_deadlock():
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        comm.Barrier()  # rank 0 waits for a barrier the other ranks never enter
    else:
        comm.recv(source=0, tag=99)  # and they wait for a message rank 0 never sends
