#!/usr/bin/env bash
# The distributed page's launch script: parallel_recover_train.py on RANK_SIZE ranks (default 8): each rank
# loads its slices of --ckpt_file (a replica's when its own is lost) and training goes on.
#
#   bash examples/distributed_fault_recover/run_parallel_recover_ckpt.sh [DATASET_PATH] --ckpt_file 'ckpt/rank_{rank}/test-1_77.h5' [options]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DSIM_ROOT=$(cd "$HERE/../.." && pwd)
. "$DSIM_ROOT/launch/env.sh"
. "$DSIM_ROOT/launch/watch.sh"
dsim_venv
DATA=()
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then DATA=(--dataset_path "$1"); shift; fi
DEFAULT_GROUP_INFO='./ckpt_dir{rank}/group_info.json'
export GROUP_INFO_FILE=${GROUP_INFO_FILE:-$DEFAULT_GROUP_INFO}
echo "+ mpirun -n ${RANK_SIZE:-8} python $HERE/parallel_recover_train.py ${DATA[*]} $*" >&2
dsim_watched mpirun -n "${RANK_SIZE:-8}" python "$HERE/parallel_recover_train.py" "${DATA[@]}" "$@"
