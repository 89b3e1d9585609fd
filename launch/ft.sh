# MPI fault tolerance (ULFM in Open MPI 5) for dsim's jobs; sourced by launch/common.sh after env.sh.
# A dead rank then makes MPI calls fail on the survivors instead of tearing the job down, and they can
# revoke, shrink and save (the last-gasp checkpoint). Failure detection needs the TCP transport: with
# shared memory, survivors of a kill -9 hang or the job is torn down.
export OMPI_MCA_btl=tcp,self
export OMPI_MCA_btl_base_warn_peer_error=0
# mpirun options: ULFM on; stdin to no rank (a killed rank 0 must not hold the launcher).
DSIM_FT_MPIRUN_ARGS="--with-ft ulfm --stdin none"
# MPI_Finalize without its closing fence over every process of the job: the survivors of a dead rank
# would wait there for it forever.
export OMPI_MCA_async_mpi_finalize=1
# A job that spawned replacements (tft.arf) ends without MPI_Finalize, which waits there for processes that
# died after a spawn (dsim.ft.spares.finish): a process ending with status 0 without it is then no error
# (a non-zero status still is).
export PRTE_MCA_prte_allowed_exit_without_sync=1
# Every job of the run recoverable, the replacements a repair spawns (tft.arf) too: `--with-ft ulfm` makes
# only the launched job so, and Open MPI's runtime then tore down a spawned job whole when one of its processes
# died (several ranks replaced at once, e.g. a lost node, then one of them failing), and the survivors hung.
export PRTE_MCA_state_base_recoverable=1
