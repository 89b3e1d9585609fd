"""The documentation: the site builds with --strict, the configuration reference is the code's, README.md stays
a short introduction, and no page carries a dated run history (that goes to CHANGELOG.md and bench/results/)."""
import ast
import configparser
import dataclasses
import os
import re
import subprocess
import sys
import typing
from dataclasses import dataclass

import pytest

import tutorial
from conftest import ROOT
from dsim import config, config_reference

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_site_builds_strict(tmp_path):
    """No broken link or anchor, no page left out of the navigation (mkdocs.yml's validation: warn, strict)."""
    try:
        import mkdocs  # noqa: F401  (the docs extra; the Makefile's venv installs it)
        import material  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs and mkdocs-material are not installed: pip install -e '.[docs]' (make venv does)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def _dotted_keys(cls, prefix=""):
    """Every key of a config dataclass, walked here independently of dsim.config_reference."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _dotted_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _page_keys(text: str) -> list[str]:
    return re.findall(r"^\| `([\w.]+)` \|", text, re.M)


def test_the_config_reference_is_the_generators_output():
    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert page == config_reference.page(), \
        "docs/reference/config.md is stale: python -m dsim.config_reference -o docs/reference/config.md"


def test_the_config_reference_names_every_key_and_no_other():
    keys = set(_dotted_keys(config.Config))
    listed = _page_keys((ROOT / "docs" / "reference" / "config.md").read_text())
    assert len(listed) == len(set(listed)), "a key is listed twice"
    assert not keys - set(listed), f"keys missing from the reference: {sorted(keys - set(listed))}"
    assert not set(listed) - keys, f"the reference names keys that do not exist: {sorted(set(listed) - keys)}"
    assert {"parallel.model_parallel", "model.transformer.vocab_size", "optimizer.schedule.name", "tft.spares",
            "checkpoint.on_save_error", "seed"} <= keys  # the walk reaches every depth


def test_every_key_has_its_line_and_a_key_without_one_is_refused():
    for name, _, typ, default, allowed, meaning in ((r[1], *r[1:]) for r in config_reference.rows()):
        assert meaning and typ, name
        if typ == "bool":
            assert allowed.startswith("true \\| false"), name

    @dataclass
    class Section:
        documented: int = config.key(1, "a key with its line")
        bare: int = 2  # added without key(...): the generator must refuse it

    with pytest.raises(ValueError, match=r"config key x\.bare \(Section\.bare\) has no line of meaning"):
        list(config_reference.rows(Section, "x."))


def test_allowed_names_come_from_the_registries():
    from dsim.nn.models import MODELS
    from dsim.optim import OPTIMIZERS
    rows = {r[1]: r for r in config_reference.rows()}
    assert rows["model.name"][4] == " \\| ".join(MODELS)
    assert rows["optimizer.name"][4] == " \\| ".join(OPTIMIZERS)


def test_readme_is_short_and_is_the_long_description():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["long_description"].strip() == "file: README.md"


def test_readme_gives_the_commands_ci_runs():
    """README is the source of the two set-up commands; .ci/run runs the test one, and every `make X` it shows is a
    target of the Makefile."""
    readme = (ROOT / "README.md").read_text()
    two = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split()[:2] for line in two.splitlines()] == [["make", "train"], ["make", "test"]]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    shown = set(re.findall(r"^make ([\w-]+)", readme, re.M))
    assert shown and shown <= targets, shown - targets


def test_readme_script_uses_the_public_api():
    import dsim
    readme = (ROOT / "README.md").read_text()
    (script,) = re.findall(r"```python\n(.*?)```", readme, re.S)
    tree = ast.parse(script)
    used = {(n.value.id, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in ("dsim", "nn")}
    for module, attr in used:
        assert hasattr(dsim if module == "dsim" else dsim.nn, attr), f"{module}.{attr}"
    assert len(script.splitlines()) <= 12


HISTORY = ["the round before", "rounds before", "seen in ci", "seen once in ci", "this vm", "before this change",
           "until 2026", "the day before", "the round of", "in the round"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_history_in_the_pages(page):
    """What changed when goes to CHANGELOG.md, dated runs to bench/results/; the pages say what is true today."""
    text = page.read_text().lower()
    found = [phrase for phrase in HISTORY if phrase in text]
    assert not found, f"{page.name}: {found}"


def test_the_tutorials_are_found_on_the_pages():
    regions = tutorial.tutorials()
    assert {"seed-pages", "fault-tolerance"} <= set(regions)
    assert all(regions.values()), "a tutorial region without commands"
