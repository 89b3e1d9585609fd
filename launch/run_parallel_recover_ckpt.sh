#!/usr/bin/env bash
# Continue a job from its newest usable committed checkpoint: same config, same checkpoint directory.
# A lost or damaged shard is taken from a replica rank; add --repair to mend the directory in place.
#
#   bash launch/run_parallel_recover_ckpt.sh [CONFIG [CKPT_DIR]] [--repair] [dsim.train options...]
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dsim_mpirun --resume auto "$@"
