#!/bin/sh
# The allocation check without a batch system: HOSTFILE=hostfiles/mesh-4.json jobs/selftest.sh
set -eu
. "$(cd "$(dirname "$0")" && pwd)/env.sh"
hpcmac_mpirun "$HPCMAC_PYTHON" -m hpcmac.launch.selftest --mib "${SELFTEST_MIB:-4}"
