# `dsim_watched mpirun ARGS...`: run mpirun and stop it if it stays after every rank has ended (sourced by
# common.sh and the examples' launch scripts). Open MPI's launcher now and then stays after every rank of a
# job with a dead rank has ended (dsim/ft/launcher.py): no rank left for 15 s and mpirun still there, it is stopped.

# Whether mpirun ($1) has a living child (a rank); zombies it did not reap do not count.
dsim_ranks_alive() {
    local c
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        case "$(cut -d')' -f2 /proc/"$c"/stat 2>/dev/null | cut -d' ' -f2)" in Z|X|"") ;; *) return 0 ;; esac
    done
    return 1
}

dsim_watched() {
    "$@" &
    local pid=$! idle=0
    trap 'kill -TERM $pid 2>/dev/null' INT TERM
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if dsim_ranks_alive "$pid"; then idle=0; else idle=$((idle + 1)); fi
        if [ "$idle" -gt 15 ]; then
            echo "dsim: note: every rank has ended but mpirun has not (an Open MPI launcher stall); stopped it" >&2
            kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null || true  # under set -e a killed mpirun (137) would end the script first
            return 1
        fi
    done
    wait "$pid"
}

# Outside an activated environment: the project's own .venv, created on first use.
dsim_venv() {
    if [ -z "${VIRTUAL_ENV:-}" ]; then
        [ -f "$DSIM_ROOT/.venv/.installed" ] || make -s -C "$DSIM_ROOT" venv >&2
        export PATH="$DSIM_ROOT/.venv/bin:$PATH"
    fi
}
