#!/bin/sh
# Comm benchmark over the hosts of a hostfile: HOSTFILE=hostfiles/mesh-2.json jobs/comm-bench.sh
set -eu
. "$(cd "$(dirname "$0")" && pwd)/env.sh"
hpcmac_mpirun "$HPCMAC_PYTHON" -m hpcmac.bench.comm --json "${JSON_OUT:-comm-local.json}"
