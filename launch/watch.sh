# `dsim_watched mpirun ARGS...`: run mpirun through dsim/ft/launcher.py (sourced by common.sh and the examples'
# launch scripts). Open MPI's launcher now and then stays after every rank of a job with a dead rank has ended:
# no rank left for 15 s and mpirun still there, it is stopped (exit 1). Now and then it fails to start (a PMIx
# fault, no rank ran): it is started again.
DSIM_LAUNCHER=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/dsim/ft/launcher.py  # standard library only
dsim_watched() {
    python "$DSIM_LAUNCHER" "$@" &
    local pid=$! status
    # Signals to this script passed on as they came; its status kept. SIGINT (Ctrl-C): the launcher stops mpirun
    # and its ranks; SIGTERM (a scheduler's notice): it passes it to the ranks (checkpoint.save_on_signal: stop
    # after a step and save it), a second one stops mpirun; SIGUSR1 (every rank's stacks) and SIGUSR2 (as SIGTERM,
    # through mpirun): the launcher passes them to mpirun and mpirun to every rank
    trap 'kill -INT $pid 2>/dev/null' INT
    trap 'kill -TERM $pid 2>/dev/null' TERM
    trap 'kill -USR1 $pid 2>/dev/null' USR1
    trap 'kill -USR2 $pid 2>/dev/null' USR2
    while :; do
        wait "$pid" && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null || break  # a trapped signal ends `wait` early: wait again
    done
    trap - INT TERM USR1 USR2
    return "$status"
}

# Outside an activated environment: the project's own .venv, created on first use.
dsim_venv() {
    if [ -z "${VIRTUAL_ENV:-}" ]; then
        [ -f "$DSIM_ROOT/.venv/.installed" ] || make -s -C "$DSIM_ROOT" venv >&2
        export PATH="$DSIM_ROOT/.venv/bin:$PATH"
    fi
}
