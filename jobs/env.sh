# Sourced by every job in jobs/ (Slurm or plain shell): where hpcmac is and how to start it.
#   HPCMAC_ROOT    the hpcmac checkout (default: the Slurm submit dir, else the jobs/ parent)
#   HPCMAC_PYTHON  the Python with hpcmac installed (default: $HPCMAC_ROOT/.venv/bin/python)
#   MPIRUN         the mpirun to use (default: the one next to that Python, else PATH)
HPCMAC_ROOT=${HPCMAC_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
if [ -z "${HPCMAC_PYTHON:-}" ]; then
  if [ -x "$HPCMAC_ROOT/.venv/bin/python" ]; then HPCMAC_PYTHON=$HPCMAC_ROOT/.venv/bin/python
  else HPCMAC_PYTHON=python3; fi
fi
pybin=$(dirname "$(command -v "$HPCMAC_PYTHON")")
if [ -z "${MPIRUN:-}" ]; then
  if [ -x "$pybin/mpirun" ]; then MPIRUN=$pybin/mpirun; else MPIRUN=mpirun; fi
fi
export PATH="$pybin:$PATH"
export PYTHONPATH="$HPCMAC_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Open MPI refuses root unless told; batch systems in containers often run as root
if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# one BLAS thread per core a rank owns (Slurm: --cpus-per-task), unless set
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$OMP_NUM_THREADS}
cd "$HPCMAC_ROOT"

# hpcmac_mpirun ARGS...: mpirun for the current allocation. Inside Slurm the
# allocation gives hosts and slots; --bind-to none because Slurm (or macOS)
# already placed us, and ranks may outnumber cores under --overcommit.
hpcmac_mpirun() {
  if [ -n "${SLURM_JOB_ID:-}" ]; then
    "$MPIRUN" --bind-to none -np "${SLURM_NTASKS:-1}" \
      -x PATH -x PYTHONPATH -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "$@"
  else
    "$HPCMAC_PYTHON" -m hpcmac.launch --hostfile "${HOSTFILE:-hostfiles/localhost.json}" \
      ${NP:+--np "$NP"} --oversubscribe -- "$@"
  fi
}
