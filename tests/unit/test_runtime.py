"""A process's state (dsim.runtime.Runtime) and its one wrapper of a watched collective, Runtime.collective."""
import ast
from pathlib import Path

import pytest

from dsim.runtime import PROCESS, Runtime
from dsim.parallel import progress

PACKAGE = Path(__file__).resolve().parents[2] / "dsim"
# the `global` statements left in dsim/, each with why a module-level name is needed there: none (the fault
# hooks, the last one, are the runtime's: Runtime.fault)
JUSTIFIED = set()


def test_no_module_keeps_its_state_in_a_global_statement_but_the_justified():
    found = {(str(path.relative_to(PACKAGE)), name) for path in PACKAGE.rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global) for name in node.names}
    assert found <= JUSTIFIED


def test_every_watched_wait_goes_through_the_one_wrapper():
    """No collective is wrapped by hand in `with progress.waiting():` any more: Runtime.collective marks the wait."""
    by_hand = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in PACKAGE.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.With)
               for item in node.items if isinstance(item.context_expr, ast.Call)
               and getattr(item.context_expr.func, "attr", None) == "waiting"]
    assert by_hand == []


def test_the_process_runtime_carries_the_marks_every_layer_writes():
    assert PROCESS.progress is progress.MARKS and progress.tick.__self__ is progress.MARKS
    assert Runtime().progress is not progress.MARKS  # a fresh one: a test's, or another process's


class Comm:
    """A communicator's stand-in: Allreduce blocks, Iallreduce completes at the third Test."""

    def __init__(self):
        self.calls, self.tests, self.revoked = [], 0, False

    def Allreduce(self, *args, **kwargs):
        self.calls.append(("Allreduce", args, kwargs))
        return "blocking"

    def allgather(self, obj):
        self.calls.append(("allgather", obj))
        return [obj]

    def Iallreduce(self, *args, **kwargs):
        self.calls.append(("Iallreduce", args, kwargs))
        comm = self

        class Request:
            def Test(self):
                comm.tests += 1
                return comm.tests >= 3
        return Request()

    def Is_revoked(self):
        return self.revoked


def test_the_wrapper_marks_the_wait_and_passes_everything_on():
    runtime, comm = Runtime(), Comm()
    seen = []

    def call(a, op=None):  # (an MPI keyword, op=, reaches the call)
        seen.append((runtime.progress.waits, a, op))
        return "done"
    assert runtime.collective(call, 1, op="max") == "done" and seen == [(1, 1, "max")]
    assert runtime.progress.waits == 0 and runtime.progress.waited > 0
    assert runtime.collective(comm.Allreduce, "x", op="sum") == "blocking"
    assert comm.calls == [("Allreduce", ("x",), {"op": "sum"})] and progress.MARKS.waits == 0
    with pytest.raises(ValueError):
        runtime.collective(lambda: (_ for _ in ()).throw(ValueError("in the wait")))
    assert runtime.progress.waits == 0  # left, though the call raised


def test_the_steps_first_sum_on_the_serving_group_polls_answering_and_checking_for_a_revoke():
    from mpi4py import MPI
    runtime, world, dp, other = Runtime(), Comm(), Comm(), Comm()
    served = []
    runtime.watch(world, lambda: served.append(runtime.progress.waits), dp)
    runtime.collective(other.Allreduce, 1)  # another communicator: blocking
    runtime.collective(dp.allgather, 2)     # an object collective: blocking
    assert [c[0] for c in other.calls + dp.calls] == ["Allreduce", "allgather"] and served == []
    runtime.collective(dp.Allreduce, 3, op="sum")
    assert dp.calls[-1] == ("Iallreduce", (3,), {"op": "sum"}) and served == [1, 1]  # answered while it waited
    dp.tests, world.revoked = 0, True
    with pytest.raises(MPI.Exception) as e:
        runtime.collective(dp.Allreduce, 4)
    assert e.value.Get_error_class() == MPI.ERR_REVOKED and runtime.progress.waits == 0
    runtime.watch(None, lambda: None, dp)   # not watched (no in-job repair): nothing is served, the sum blocks
    runtime.collective(dp.Allreduce, 5)
    assert dp.calls[-1][0] == "Allreduce"


def test_collectives_inside_before_forward_leave_the_serving_group_to_the_sum_after():
    from dsim.parallel import groups
    runtime, dp = Runtime(), Comm()
    runtime.watch(Comm(), lambda: None, dp)
    with runtime.before_forward():
        runtime.serving = None  # (a sum inside: groups' sums clear it once done)
    assert runtime.serving is dp
    assert groups.check_revoked == PROCESS.check_revoked  # what every layer calls: the process's check


def test_a_model_parallel_sum_leaves_the_serving_group_to_the_first_data_parallel_sum():
    """Only the polled sum (the step's first on dp) ends the serving: a model-parallel sum in the forward before it
    must not, or the replica would block in its gradient sum while the damaged rank waits for its answer."""
    from dsim.parallel.groups import _sum_phase
    world, dp, mp = Comm(), Comm(), Comm()
    try:
        PROCESS.watch(world, lambda: None, dp)
        _sum_phase(mp.Allreduce, 1)
        assert PROCESS.serving is dp and mp.calls[-1][0] == "Allreduce"
        _sum_phase(dp.Allreduce, 2)
        assert dp.calls[-1][0] == "Iallreduce" and PROCESS.serving is None
        _sum_phase(dp.Allreduce, 3)
        assert dp.calls[-1][0] == "Allreduce"
    finally:
        PROCESS.watch(None)


def test_over_several_hosts_every_buffer_collective_is_polled_and_a_revoke_ends_it():
    """Runtime.poll (dsim.ft.cut.arm): a blocking collective may never return after a network cut, so it is made as
    its nonblocking variant and tested; a revoke of its communicator ends it with ERR_REVOKED. Pickled collectives
    (allgather) stay as they are."""
    from mpi4py import MPI
    runtime, comm = Runtime(), Comm()
    runtime.poll = True
    assert runtime.collective(comm.Allreduce, "x", op="sum") is None
    assert [c[0] for c in comm.calls] == ["Iallreduce"] and comm.tests == 3
    assert runtime.collective(comm.allgather, 5) == [5]
    comm.tests, comm.revoked = -100, True  # never completes, revoked: ended at its first look
    with pytest.raises(MPI.Exception) as e:
        runtime.collective(comm.Allreduce, "y")
    assert e.value.Get_error_class() == MPI.ERR_REVOKED and comm.tests == -99 and runtime.progress.waits == 0
