"""The public API as a script uses it: a network of one's own from dsim.nn's layers, on dp2 x mp4, trains to the
parameters of its single-process run (run under mpirun -n 8)."""
import numpy as np
import pytest
from mpi4py import MPI

import dsim
from dsim import nn
from dsim.engine.state import owned_pieces
from dsim.parallel.groups import gather_full


class MLP(nn.SequentialCell):
    """Three Dense layers and a LayerNorm: column, then row (one all-reduce each way), LayerNorm and the head
    replicated over the model-parallel ranks."""

    def __init__(self):
        super().__init__()
        self.layers = [nn.Flatten(), nn.Dense("fc1", 784, 64, "column"), nn.ReLU(),
                       nn.Dense("fc2", 64, 48, "row"), nn.LayerNorm("norm", 48), nn.ReLU(),
                       nn.Dense("fc3", 48, 10)]


def train(comm, dp, mp, epochs=2):
    """What a user's script does, on comm; returns (whole parameters and Adam moments, held-out accuracy)."""
    dsim.init(comm)
    dsim.set_auto_parallel_context(data_parallel=dp, model_parallel=mp)
    dsim.set_context(dtype="float64")
    dsim.set_seed(3)
    net = MLP()
    optim = nn.Adam(net.trainable_params(), learning_rate=0.002)
    model = dsim.Model(net, loss_fn=nn.SoftmaxCrossEntropyWithLogits(), optimizer=optim)
    train_set, held_out = dsim.dataset.SyntheticMnist(384).split([320, 64])
    model.train(epochs, train_set.batch(32), callbacks=[])
    accuracy = model.eval(held_out.batch(32))["accuracy"]
    full = gather_full(comm, owned_pieces(net, optim))
    model.groups.free()
    return full, accuracy


def agree(comm, ok, detail=""):
    results = comm.allgather((bool(ok), detail))
    bad = [(r, d) for r, (o, d) in enumerate(results) if not o]
    assert not bad, bad[:3]


@pytest.mark.mpi(min_size=8)
def test_user_network_matches_single_process():
    comm = MPI.COMM_WORLD.Dup()
    got, acc = train(comm, 2, 4)
    ref, ref_acc = train(MPI.COMM_SELF, 1, 1)
    init, _ = train(MPI.COMM_SELF, 1, 1, epochs=0)
    worst, detail = 0.0, ""
    for name, want in ref.items():
        rel = np.max(np.abs(got[name] - want)) / max(np.max(np.abs(want)), 1e-300)
        if rel > worst:
            worst, detail = rel, name
    unmoved = [n for n in ("fc1.weight", "fc2.weight", "norm.gamma", "fc3.weight") if np.array_equal(init[n], ref[n])]
    ok = (set(got) == set(ref) and len(ref) == 8 * 3 and worst <= 1e-10 and not unmoved and got["fc1.weight"].dtype == np.float64
          and acc == ref_acc and 0 <= acc <= 1)
    agree(comm, ok, f"{detail}: {worst:.3g}; unmoved {unmoved}; accuracy {acc} vs {ref_acc}")
    comm.Free()
