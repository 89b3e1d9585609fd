#!/usr/bin/env bash
# The last-gasp page's msrun.sh: mindio_ttp_case.py on RANK_SIZE ranks (default 8) with the last-gasp checkpoint on
# (MS_ENABLE_TFT='{TTP:1}') and MPI fault tolerance (mpirun --with-ft ulfm, launch/ft.sh), in the current directory.
#
#   bash examples/last_gasp/msrun.sh [options of mindio_ttp_case.py]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DSIM_ROOT=$(cd "$HERE/../.." && pwd)
. "$DSIM_ROOT/launch/env.sh"
. "$DSIM_ROOT/launch/ft.sh"
. "$DSIM_ROOT/launch/watch.sh"
dsim_venv
export MS_ENABLE_TFT='{TTP:1}'
echo "+ mpirun $DSIM_FT_MPIRUN_ARGS -n ${RANK_SIZE:-8} python $HERE/mindio_ttp_case.py $*" >&2
# shellcheck disable=SC2086
dsim_watched mpirun $DSIM_FT_MPIRUN_ARGS -n "${RANK_SIZE:-8}" python "$HERE/mindio_ttp_case.py" "$@"
