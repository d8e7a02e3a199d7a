#!/bin/sh
# Generation over the hosts of a hostfile:
#   HOSTFILE=hostfiles/mesh-4-mixed.json MODEL=PATH PROMPT="..." jobs/llm-generate.sh
set -eu
. "$(cd "$(dirname "$0")" && pwd)/env.sh"
hpcmac_mpirun "$HPCMAC_PYTHON" -m hpcmac.llm generate --model "${MODEL:-smollm2}" \
  --prompt "${PROMPT:-Explain LU factorisation in one sentence.}" \
  --max-tokens "${MAX_TOKENS:-64}" --json "${JSON_OUT:-llm-local.json}"
