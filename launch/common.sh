# Shared by the launch scripts: the project's environment, and `dsim_mpirun ARGS...`.
#   CONFIG     first argument (default configs/default.yaml)
#   CKPT_DIR   second argument (default: the config's checkpoint.directory, else output.dir/checkpoints)
#   RANK_SIZE  number of training ranks (default 8), as in MindSpore's launch scripts; warm spares
#              (tft.spares) are started on top of them
#   HOSTFILE   an Open MPI hostfile (`node1 slots=4`, a host a line): the ranks run on those hosts, the first
#              host's slots filled first (--map-by slot); MAP_BY another mapping (e.g. node: round robin)
#   MPIRUN_ARGS more of Open MPI's own options, passed to mpirun as they are (e.g. "--mca btl_tcp_if_include eth1")
# Arguments after those (e.g. --set KEY=VALUE, --repair) go to `python -m dsim.train`.
# Jobs run with MPI fault tolerance (ULFM), so the survivors of a dead rank can act (tft.ttp: the last-gasp
# checkpoint); MS_ENABLE_TFT='{TTP:1}' turns it on as in MindSpore.
DSIM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$DSIM_ROOT/launch/env.sh"
. "$DSIM_ROOT/launch/ft.sh"
. "$DSIM_ROOT/launch/watch.sh"
dsim_venv

CONFIG=$DSIM_ROOT/configs/default.yaml
CKPT_DIR=
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then CONFIG=$1; shift; fi
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then CKPT_DIR=$1; shift; fi
if [ ! -f "$CONFIG" ]; then
    echo "dsim: error: config file not found: $CONFIG" >&2
    exit 2
fi
DSIM_ARGS=(--config "$CONFIG" --set checkpoint.integrated_save=false)
[ -z "$CKPT_DIR" ] || DSIM_ARGS+=(--set "checkpoint.directory=$CKPT_DIR")

dsim_mpirun() {
    # RANK_SIZE training ranks, plus the warm spares the config asks for (tft.spares), started with the job
    local n=$(( ${RANK_SIZE:-8} + $(python -m dsim.ft.spare_count "${DSIM_ARGS[@]}" "$@") ))
    local hosts=()
    [ -z "${HOSTFILE:-}" ] || hosts=(--hostfile "$HOSTFILE")
    [ -z "${HOSTFILE:-}${MAP_BY:-}" ] || hosts+=(--map-by "${MAP_BY:-slot}")
    # shellcheck disable=SC2206
    local opts=($DSIM_FT_MPIRUN_ARGS "${hosts[@]}" ${MPIRUN_ARGS:-})
    echo "+ mpirun ${opts[*]} -n $n python -m dsim.train ${DSIM_ARGS[*]} $*" >&2
    dsim_watched mpirun "${opts[@]}" -n "$n" python -m dsim.train "${DSIM_ARGS[@]}" "$@"
}
