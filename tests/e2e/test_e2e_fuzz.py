"""Fuzzing the real CLI with bad input (issue 22, item 4): strategies generated from the config schema.

Every example runs `python -m dsim.train` (a few under mpirun -n 2) and must end either as a normal run
(exit 0) or with exit != 0, 1-3 lines on stderr and no traceback; the committed checkpoint made first in
the output directory is byte-identical afterwards. Seeded (derandomized) and bounded:
DSIM_FUZZ_EXAMPLES=N multiplies the example counts by N (default 1: about a minute in all).
"""
import dataclasses
import hashlib
import os
import re
import sys
import typing

import pytest
import yaml

from conftest import mpirun, run_command
from dsim.config import Config

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

pytestmark = pytest.mark.e2e
SCALE = int(os.environ.get("DSIM_FUZZ_EXAMPLES", "1"))
BASE = {"parallel": {"model_parallel": 1}, "model": {"hidden": [8]},
        "data": {"num_samples": 64, "batch_size": 16},
        "train": {"epochs": 1, "steps_per_epoch": 1}, "output": {"dir": "out", "progress_bar": False}}
PATH_KEYS = {"output.dir", "checkpoint.directory", "data.path", "checkpoint.group_info_file", "tft.ckpt_save_path"}


def leaves(cls=Config, prefix=""):
    """(dotted key, type hint) of every leaf of the config schema."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            yield from leaves(hint, key + ".")
        else:
            yield key, hint


LEAVES = dict(leaves())
SCALARS = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True), st.text(max_size=12), st.booleans(),
                    st.none())
ANY = st.recursive(SCALARS, lambda c: st.one_of(st.lists(c, max_size=3),
                                                 st.dictionaries(st.text(max_size=5), c, max_size=3)), max_leaves=6)


def base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return base_type(args[0]) if typing.get_origin(hint) is typing.Union else (typing.get_origin(hint) or hint)


def wrong_type(hint):
    """Values of any type but hint's (an int where a list goes, text where a number goes, ...)."""
    t = base_type(hint)
    if t is typing.Any:
        return ANY
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool), float: lambda v: isinstance(v, (int, float))
          and not isinstance(v, bool), str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
          list: lambda v: isinstance(v, list)}[t]
    return ANY.filter(lambda v: v is not None and not ok(v))


def out_of_range(hint, key):
    """Numbers at or below zero, NaN and infinities; names nobody registered; widths of 0."""
    t = base_type(hint)
    if t is int:
        return st.integers(-10**6, 0)
    if t is float:
        return st.one_of(st.floats(max_value=0), st.just(float("nan")), st.just(float("inf")))
    if t is str and key not in PATH_KEYS:
        return st.text(max_size=12)
    if t is list:
        return st.lists(st.integers(-3, 0), max_size=3)
    return st.nothing()


def bad_value(key):
    hint = LEAVES[key]
    strategies = [wrong_type(hint)] + ([out_of_range(hint, key)] if base_type(hint) is not bool else [])
    return st.one_of(strategies)


def set_key(tree, key, value):
    *sections, last = key.split(".")
    for s in sections:
        tree = tree.setdefault(s, {})
    tree[last] = value


KEY_VALUES = st.sampled_from(sorted(LEAVES)).flatmap(lambda k: st.tuples(st.just(k), bad_value(k)))
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in LEAVES if "." in k})
UNKNOWN_KEYS = st.tuples(
    st.tuples(st.sampled_from(["", *(s + "." for s in SECTIONS)]), st.from_regex(r"[a-z_]{1,10}", fullmatch=True))
    .map("".join).filter(lambda k: k not in LEAVES and k not in SECTIONS), ANY)
CONFIGS = st.one_of(KEY_VALUES, UNKNOWN_KEYS)
YAML_DOCS = ANY.map(lambda v: yaml.safe_dump(v).encode())
FILES = st.one_of(st.binary(max_size=200), YAML_DOCS, st.text(max_size=200).map(str.encode))
COUNTS = {}


def digest(directory):
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory whose out/ holds a committed checkpoint (made by a normal run of the base config)."""
    d = tmp_path_factory.mktemp("fuzz")
    (d / "base.yaml").write_text(yaml.safe_dump(BASE))
    run_command([sys.executable, "-m", "dsim.train", "--config", "base.yaml"], d, 120, 0)
    ckpt = d / "out" / "checkpoints"
    assert list(ckpt.glob("*.commit"))
    yield d, ckpt, digest(ckpt)
    print(f"\nfuzz examples run: {COUNTS}")


def ours(stderr):
    """stderr without mpirun's own box (`prterun detected that one or more processes exited ...`)."""
    return re.sub(r"-{20,}\n.*?-{20,}\n", "", stderr, flags=re.S)


def check(proc, ckpt, before, what):
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, f"{what}\n{out[-3000:]}"
    if proc.returncode != 0:
        lines = [line for line in ours(proc.stderr).splitlines() if line.strip()]
        assert 1 <= len(lines) <= 3, f"{what}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    after = digest(ckpt)
    assert {k: after.get(k) for k in before} == before, f"{what}: the committed checkpoint changed"


def run_config(workdir, data, launcher=None):
    d, ckpt, before = workdir
    (d / "fuzz.yaml").write_bytes(data if isinstance(data, bytes) else yaml.safe_dump(data).encode())
    args = ["-m", "dsim.train", "--config", "fuzz.yaml"]
    proc = mpirun(2, args, d, timeout=120) if launcher else run_command([sys.executable, *args], d, 120, None)
    check(proc, ckpt, before, data)
    return proc


def fuzz_settings(n):
    return settings(max_examples=n * SCALE, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])


def with_value(key_value):
    key, value = key_value
    data = yaml.safe_load(yaml.safe_dump(BASE))
    set_key(data, key, value)
    return data


@fuzz_settings(24)
@given(CONFIGS)
def test_bad_config_values_single_process(workdir, key_value):
    COUNTS["values"] = COUNTS.get("values", 0) + 1
    run_config(workdir, with_value(key_value))


@fuzz_settings(8)
@given(FILES)
def test_random_config_files(workdir, data):
    COUNTS["files"] = COUNTS.get("files", 0) + 1
    run_config(workdir, data)


@fuzz_settings(3)
@given(KEY_VALUES)
def test_bad_config_values_under_mpirun(workdir, key_value):
    COUNTS["mpirun"] = COUNTS.get("mpirun", 0) + 1
    data = with_value(key_value)
    data.setdefault("parallel", {})["data_parallel"] = data["parallel"].get("data_parallel", 2)
    run_config(workdir, data, launcher=True)
