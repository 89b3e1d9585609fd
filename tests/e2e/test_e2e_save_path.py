"""One save path (dsim/checkpoint/save.py): a last gasp writes what a periodic save of the same state writes.

The job of the fault-tolerance tests (tests/ftjob.py) saves step 12 periodically (checkpoint.save_checkpoint_steps:
12); rank 3 is killed in the forward of step 13 and the survivors save step 12 again as the last gasp, rank 3's
file written by its replica, rank 7. Both commit records are built by save.Commit (plan.commit_record) and written
by commit.write_commit, so they are the same bytes but for the fields that say which checkpoint they are:
- name, prefix and files.template: the last gasp's own names (ttp-2_2, rank_{rank}/ttp_rank_{rank}-2_2.h5);
- digests: the digest file is <name>.digests and names its checkpoint, so its SHA-256 differs too;
- bytes: each last-gasp file says so in its attributes (`last_gasp`, prefix `ttp`), a few bytes more;
- last_gasp: only in the last gasp's, who failed and which survivor wrote whose file;
- time: when each was committed.
The files hold the same tensors (every slice, bit for bit), append_info and attributes but those two.
"""
import json

import numpy as np
import pytest

from conftest import mpirun
from dsim.checkpoint import record as rec
from dsim.checkpoint.format import read_file
from ftjob import OPTS, error_lines, fault

pytestmark = pytest.mark.e2e
LOCATION = ("name", "prefix", "digests", "bytes", "time")


def test_the_last_gasps_commit_record_is_a_periodic_saves_of_the_same_state(tmp_path):
    crash = mpirun(8, ["-m", "dsim.train", *OPTS, "--set", "tft.ttp=true", "--set", "checkpoint.save_checkpoint_steps=12",
                       *fault("kill", 3, "forward", 13)], cwd=tmp_path, timeout=120, ft=True)
    assert crash.returncode == 1 and len(error_lines(crash)) == 1, crash.stderr
    ckpt = tmp_path / "run" / "checkpoints"
    gasp_dir = ckpt / "ttp_checkpoints" / "tft_saved_checkpoints-step_12"
    periodic_text = (ckpt / "network-2_2.commit").read_text()
    gasp_text = (gasp_dir / "ttp-2_2.commit").read_text()
    periodic, gasp = json.loads(periodic_text), json.loads(gasp_text)
    assert rec.dumps(periodic) == periodic_text and rec.dumps(gasp) == gasp_text  # the bytes are these, in order

    assert gasp.pop("last_gasp") == {"failed": [3], "writers": {"3": 7}}
    assert (gasp["name"], gasp["prefix"], gasp["files"]["template"], gasp["digests"]["file"]) == (
        "ttp-2_2", "ttp", "rank_{rank}/ttp_rank_{rank}-2_2.h5", "ttp-2_2.digests")
    assert (periodic["name"], periodic["prefix"], periodic["files"]["template"], periodic["digests"]["file"]) == (
        "network-2_2", "network", "rank_{rank}/network-2_2.h5", "network-2_2.digests")
    for record, directory in ((periodic, ckpt), (gasp, gasp_dir)):  # bytes: each checkpoint's own files
        assert record["bytes"] == sum((directory / rec.file_of(record, r)).stat().st_size for r in range(8))
    located = {**periodic, **{k: gasp[k] for k in LOCATION}, "files": {**periodic["files"], "template":
                                                                      gasp["files"]["template"]}}
    assert rec.dumps(located) == rec.dumps(gasp)  # every other field, byte for byte, in the same order
    assert periodic["global_step"] == 12 and periodic["sequence"] == 1 and periodic["replica_sets"]

    for r in range(8):  # rank 3's file too, written by rank 7 from its replica of the state
        a = read_file(ckpt / f"rank_{r}" / "network-2_2.h5")
        b = read_file(gasp_dir / f"rank_{r}" / f"ttp_rank_{r}-2_2.h5")
        assert sorted(a.tensors) == sorted(b.tensors) and len(a.tensors) == 27
        for name, t in a.tensors.items():
            u = b.tensors[name]
            assert (t.kind, t.global_shape, t.where, t.split, t.opt_sharded) == (
                u.kind, u.global_shape, u.where, u.split, u.opt_sharded), (r, name)
            assert t.data.dtype == u.data.dtype and np.array_equal(t.data, u.data), (r, name)
        assert a.append_info == b.append_info
        assert b.meta.pop("last_gasp") is True and b.meta.pop("prefix") == "ttp" and a.meta.pop("prefix") == "network"
        assert a.meta == b.meta and a.meta["rank"] == r
