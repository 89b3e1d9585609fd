#!/usr/bin/env bash
# The distributed page's launch script: parallel_save_ckpt_train.py on RANK_SIZE ranks (default 8), each rank
# saving only its own slices and its group info (GROUP_INFO_FILE, {rank} being the rank).
#
#   bash examples/distributed_fault_recover/run_parallel_save_ckpt.sh [DATASET_PATH] [options]
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
for ((i = 0; i < ${RANK_SIZE:-8}; i++)); do mkdir -p "$(dirname "${GROUP_INFO_FILE//\{rank\}/$i}")"; done
echo "+ mpirun -n ${RANK_SIZE:-8} python $HERE/parallel_save_ckpt_train.py ${DATA[*]} $*" >&2
dsim_watched mpirun -n "${RANK_SIZE:-8}" python "$HERE/parallel_save_ckpt_train.py" "${DATA[@]}" "$@"
