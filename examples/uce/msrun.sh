#!/usr/bin/env bash
# The UCE page's launch: uce_case.py on RANK_SIZE ranks (default 8) with UCE repair and the last gasp on
# (MS_ENABLE_TFT='{UCE:1 TTP:1}') and MPI fault tolerance (mpirun --with-ft ulfm, launch/ft.sh), in the current directory.
#
#   bash examples/uce/msrun.sh [options of uce_case.py]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DSIM_ROOT=$(cd "$HERE/../.." && pwd)
. "$DSIM_ROOT/launch/env.sh"
. "$DSIM_ROOT/launch/ft.sh"
. "$DSIM_ROOT/launch/watch.sh"
dsim_venv
export MS_ENABLE_TFT='{UCE:1 TTP:1}'
echo "+ mpirun $DSIM_FT_MPIRUN_ARGS -n ${RANK_SIZE:-8} python $HERE/uce_case.py $*" >&2
# shellcheck disable=SC2086
dsim_watched mpirun $DSIM_FT_MPIRUN_ARGS -n "${RANK_SIZE:-8}" python "$HERE/uce_case.py" "$@"
