#!/usr/bin/env bash
# Train on RANK_SIZE ranks (default 8), every rank saving only its own shards (integrated_save=false).
#
#   bash launch/run_parallel_save_ckpt.sh [CONFIG [CKPT_DIR]] [dsim.train options...]
#   bash launch/run_parallel_save_ckpt.sh configs/default.yaml runs/ckpt --set fault.kind=kill --set fault.rank=3
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dsim_mpirun "$@"
