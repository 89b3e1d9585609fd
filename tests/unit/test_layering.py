"""The layers of dsim/, read from its imports (every import, those inside functions too):

- no import cycle between the modules of dsim/;
- the training loop (dsim/engine/) imports nothing of fault tolerance (dsim.ft, dsim.faults, dsim.campaign), of
  checkpoints, or of what builds a run (dsim.build): those register on the loop's hooks instead;
- `say` and `event` come from the bottom layer, dsim.log, which imports nothing of dsim.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dsim"


def modules() -> dict:
    """module name -> path, for every module of dsim/."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict) -> list:
    """[(imported module of dsim, imported names, line)] of one module: the deepest module of dsim each names."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
    return [(m, what, line) for m, what, line in found if m in known and m != name]


def graph() -> dict:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycle_in_dsim():
    edges = {name: sorted({m for m, _, _ in found}) for name, found in graph().items()}
    assert cycles(edges) == []


def test_the_training_loop_imports_nothing_above_it():
    above = ("dsim.ft", "dsim.faults", "dsim.campaign", "dsim.checkpoint", "dsim.build", "dsim.train")
    wrong = [f"{name} imports {m} (line {line})" for name, found in graph().items() if name.startswith("dsim.engine")
             for m, _, line in found if m == "dsim" or m.startswith(above)]
    assert wrong == []


def test_say_and_event_come_from_the_bottom_layer():
    g = graph()
    assert g["dsim.log"] == []  # it imports nothing of dsim
    wrong = [f"{name} imports {what} from {m} (line {line})" for name, found in g.items()
             for m, what, line in found if what in ("say", "event") and m != "dsim.log"]
    assert wrong == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert cycles({"a": ["b"], "b": []}) == []


def test_each_config_section_imports_only_the_bottom_and_its_own_package():
    """A component's config section (dsim/<package>/config.py) is read before anything runs (dsim.config composes
    them): it imports of dsim only dsim.section and its own package (a registry's names, at call time), never the
    composer or another component."""
    g = graph()
    sections = [name for name in g if name.startswith("dsim.") and name.endswith(".config") and name != "dsim.config"]
    assert {"dsim.parallel.config", "dsim.nn.config", "dsim.optim.config", "dsim.data.config", "dsim.engine.config",
            "dsim.checkpoint.config", "dsim.faults.config", "dsim.ft.config"} <= set(sections)
    wrong = [f"{name} imports {m} (line {line})" for name in sections for m, _, line in g[name]
             if m != "dsim.section" and not m.startswith(name.rsplit(".", 1)[0] + ".")]
    assert wrong == []
    assert g["dsim.section"] == []  # the bottom: it imports nothing of dsim
