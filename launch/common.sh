# Shared by the launch scripts: the project's environment, and `dsim_mpirun ARGS...`.
#   CONFIG     first argument (default configs/default.yaml)
#   CKPT_DIR   second argument (default: the config's checkpoint.directory, else output.dir/checkpoints)
#   RANK_SIZE  number of training ranks (default 8), as in MindSpore's launch scripts; warm spares
#              (tft.spares) are started on top of them
# Arguments after those (e.g. --set KEY=VALUE, --repair) go to `python -m dsim.train`.
# Jobs run with MPI fault tolerance (ULFM), so the survivors of a dead rank can act (tft.ttp: the last-gasp
# checkpoint); MS_ENABLE_TFT='{TTP:1}' turns it on as in MindSpore.
DSIM_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$DSIM_ROOT/launch/env.sh"
. "$DSIM_ROOT/launch/ft.sh"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    # outside an activated environment: the project's own .venv, created on first use
    [ -f "$DSIM_ROOT/.venv/.installed" ] || make -s -C "$DSIM_ROOT" venv >&2
    export PATH="$DSIM_ROOT/.venv/bin:$PATH"
fi

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

# Whether mpirun ($1) has a living child (a rank); zombies it did not reap do not count.
dsim_ranks_alive() {
    local c
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        case "$(cut -d')' -f2 /proc/"$c"/stat 2>/dev/null | cut -d' ' -f2)" in Z|X|"") ;; *) return 0 ;; esac
    done
    return 1
}

dsim_mpirun() {
    # RANK_SIZE training ranks, plus the warm spares the config asks for (tft.spares), started with the job
    local n=$(( ${RANK_SIZE:-8} + $(python -m dsim.ft.spare_count "${DSIM_ARGS[@]}" "$@") ))
    echo "+ mpirun $DSIM_FT_MPIRUN_ARGS -n $n python -m dsim.train ${DSIM_ARGS[*]} $*" >&2
    # shellcheck disable=SC2086
    mpirun $DSIM_FT_MPIRUN_ARGS -n "$n" python -m dsim.train "${DSIM_ARGS[@]}" "$@" &
    local pid=$! idle=0
    trap 'kill -TERM $pid 2>/dev/null' INT TERM
    # Open MPI's launcher now and then stays after every rank of a job with a dead rank has ended
    # (dsim/ft/launcher.py): no rank left for 15 s and mpirun still there, it is stopped.
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if dsim_ranks_alive "$pid"; then idle=0; else idle=$((idle + 1)); fi
        if [ "$idle" -gt 15 ]; then
            echo "dsim: note: every rank has ended but mpirun has not (an Open MPI launcher stall); stopped it" >&2
            kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null || true  # under set -e a killed mpirun (137) would end the script first
            exit 1
        fi
    done
    wait "$pid"
}
