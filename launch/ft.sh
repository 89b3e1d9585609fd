# MPI fault tolerance (ULFM in Open MPI 5) for dsim's jobs; sourced by launch/common.sh after env.sh.
# A dead rank then makes MPI calls fail on the survivors instead of tearing the job down, and they can
# revoke, shrink and save (the last-gasp checkpoint). Failure detection needs the TCP transport: with
# shared memory, survivors of a kill -9 hang or the job is torn down.
export OMPI_MCA_btl=tcp,self
export OMPI_MCA_btl_base_warn_peer_error=0
# Collectives without Open MPI's hierarchical component (coll han), which it picks for a communicator that spans
# hosts: han runs a collective as steps on sub-communicators of its own, which a failure elsewhere or a revoke does
# not interrupt, so ranks of a host whose peers died stayed blocked in it for ever (the kill matrix on the test
# cluster: 3 in 12 jobs whose host lost its ranks hung). tuned's algorithms are fault tolerant; on one host han is
# never picked, and dsim's sums move data only (no reduction by MPI), so the bits do not change.
export OMPI_MCA_coll=^han
# No warning from the child of a fork (dsim.ft.rescue forks each survivor's writer at a failure): Open MPI's
# handler says it through its runtime, which on a host's crash is gone, and the child then died before it wrote
# (1 of node1's 4 writers in each of 3 runs on the test cluster). The warning is for RDMA memory, not TCP.
export OMPI_MCA_mpi_warn_on_fork=0
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
