"""Run the documentation's tutorials as a user would and check their output, so the pages cannot drift.

    $ python tests/tutorial.py            # every tutorial of README.md and docs/, each in a fresh directory
    $ python tests/tutorial.py --keep DIR # leave the working directories (and loss.png) in DIR

A tutorial is the part of a page (README.md, or any docs/**/*.md) between `<!-- tutorial: NAME -->` and
`<!-- /tutorial -->`; a name is used once across the pages. In its
```text blocks, a line starting with `$ ` is a command; the lines after it, up to the next command, are
its expected output (`...` stands for lines left out). All commands of a tutorial run in one bash
session (variables carry over) in an empty directory, with the venv's python and mpirun first on PATH.
Checks:
- each command exits 0, unless the next command is `echo $?`, whose expected output is then the status;
- each expected line appears in the command's output (stdout and stderr together), compared with
  timings (`123 ms`, `45.678 ms`) and loss values masked; for `ls`, the same names in any columns.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGION = re.compile(r"<!-- tutorial: (?P<name>[\w-]+) -->(?P<body>.*?)<!-- /tutorial -->", re.S)
BLOCK = re.compile(r"```text\n(.*?)```", re.S)
MASKS = [(re.compile(r"\d+(\.\d+)? ms\b"), "<ms>"), (re.compile(r"loss is \d+\.\d+"), "loss is <loss>")]


@dataclass
class Command:
    line: str
    expected: list = field(default_factory=list)


def pages() -> list[Path]:
    """The pages whose tutorial regions run: README.md and every page of the documentation site."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def tutorials(paths=None) -> dict:
    """name -> the commands of each tutorial region of the pages (README.md and docs/ by default), in order."""
    out, where = {}, {}
    for page in (pages() if paths is None else [Path(p) for p in paths]):
        for name, commands in _regions(page.read_text()):
            if name in out:
                raise ValueError(f"tutorial {name} is in both {where[name]} and {page}: a name is used once")
            out[name], where[name] = commands, page
    return out


def _regions(text: str):
    for m in REGION.finditer(text):
        commands = []
        for block in BLOCK.findall(m["body"]):
            for line in block.splitlines():
                if line.startswith("$ "):
                    commands.append(Command(line[2:]))
                elif commands and line.strip() and line.strip() != "...":
                    commands[-1].expected.append(line)
        yield m["name"], commands


def script(commands, outdir: Path) -> str:
    """One bash session: each command's output and status to files; `$?` still works for the next."""
    lines = [f". {ROOT}/launch/env.sh", f"export PATH={Path(sys.executable).parent}:$PATH", "__rc=0",
             # mpirun as typed, through the watch the launch scripts use (an Open MPI launcher that failed to
             # start is started again, one that stalls is stopped): a launcher fault is not the tutorial's
             f"mpirun() {{ python {ROOT / 'dsim' / 'ft' / 'launcher.py'} {Path(sys.executable).parent / 'mpirun'} \"$@\"; }}"]
    for i, c in enumerate(commands):
        lines.append(f"(exit $__rc); {{ {c.line}\n}} > {outdir}/{i}.out 2>&1; __rc=$?; echo $__rc > {outdir}/{i}.rc")
    return "\n".join(lines) + "\n"


def normalize(text: str) -> str:
    for pattern, repl in MASKS:
        text = pattern.sub(repl, text)
    return " ".join(text.split())


def check(commands, outdir: Path) -> list[str]:
    """Mismatches between what each command printed and what the page shows."""
    problems = []
    for i, c in enumerate(commands):
        rc_file = outdir / f"{i}.rc"
        if not rc_file.exists():
            problems.append(f"$ {c.line}: did not run")
            continue
        out = (outdir / f"{i}.out").read_text()
        status = int(rc_file.read_text())
        shows_status = i + 1 < len(commands) and commands[i + 1].line.strip() == "echo $?"
        if status and not shows_status:
            problems.append(f"$ {c.line}: exit status {status}\n{out[-2000:]}")
        if c.line.split()[0] == "ls":
            if sorted(" ".join(c.expected).split()) != sorted(out.split()):
                problems.append(f"$ {c.line}: listing differs\n--- page\n" + "\n".join(c.expected) + f"\n--- actual\n{out}")
            continue
        got = {normalize(line) for line in out.splitlines()}
        missing = [e for e in c.expected if normalize(e) not in got]
        if missing:
            problems.append(f"$ {c.line}: lines the page shows are not in the output:\n  " + "\n  ".join(missing)
                            + f"\n--- actual\n{out[-3000:]}")
    return problems


def run(name: str, commands, workdir: Path, timeout: float = 600) -> list[str]:
    """Run one tutorial in workdir (empty); returns its problems (none when the page is true)."""
    outdir = workdir / ".tutorial"
    outdir.mkdir(parents=True)
    (outdir / "session.sh").write_text(script(commands, outdir))
    p = subprocess.Popen(["bash", str(outdir / "session.sh")], cwd=workdir, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from dsim.ft.launcher import kill_tree
        kill_tree(p.pid)  # the session, mpirun and every rank (each in a process group of its own)
        p.communicate()
        return [f"tutorial {name}: timed out after {timeout} s"] + check(commands, outdir)
    return check(commands, outdir)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", metavar="DIR", help="run in DIR/<name> and leave the files there")
    args = parser.parse_args(argv)
    failed = 0
    for name, commands in tutorials().items():
        if args.keep:
            workdir = Path(args.keep) / name
            workdir.mkdir(parents=True)
            problems = run(name, commands, workdir)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                problems = run(name, commands, Path(tmp))
        print(f"tutorial {name}: {len(commands)} commands, " + ("ok" if not problems else f"{len(problems)} problem(s)"))
        for p in problems:
            print(p)
        failed += bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
