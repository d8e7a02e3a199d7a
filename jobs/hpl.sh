#!/bin/sh
# HPL sweep without a batch system: over the hosts of a hostfile.
#   HOSTFILE=hostfiles/mesh-4.json jobs/hpl.sh [HPL.dat]
set -eu
. "$(cd "$(dirname "$0")" && pwd)/env.sh"
hpcmac_mpirun "$HPCMAC_PYTHON" -m hpcmac.hpl --dat "${1:-${HPL_DAT:-jobs/hpl/HPL-sweep.dat}}"
