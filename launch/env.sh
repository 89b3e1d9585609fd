# Open MPI settings dsim runs with; sourced by the Makefile and the venv's activate script,
# so that `mpirun -n 8 python -m dsim.train` works as typed on a small machine, as root or not.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# More ranks than cores is the normal case here: oversubscribe, and yield when idle.
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export OMPI_MCA_mpi_yield_when_idle=1
# Shared-memory windows (dsim.parallel.shared) through the sm component: without a UCX device, the ucx
# component prints an error line on every rank when a window is made.
export OMPI_MCA_osc=^ucx
# Not the libfabric (ofi) transport: on a machine without a fabric, probing it sleeps a whole second in
# every process's MPI_Init (a single-process `python -m dsim.inspect` 1.1 s -> 0.13 s; a small 8-rank job
# 3.9 s -> 2.4 s). Shared memory and TCP remain; a cluster with a fabric sets OMPI_MCA_btl itself.
export OMPI_MCA_btl=${OMPI_MCA_btl:-^ofi}
# One BLAS thread per rank: ranks are the parallelism.
export OMP_NUM_THREADS=1
export OPENBLAS_NUM_THREADS=1
export MKL_NUM_THREADS=1
