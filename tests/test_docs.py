"""The documents stay true: the shell commands they show run, and their relative links point at files.

Commands are read from fenced code blocks of README.md, ARCHITECTURE.md and docs/*.md: a line starting with
`reshard ` or `$ reshard ` (continued over lines ending in a backslash). `plan` and `topo` commands run in
seconds on CPU and always run; `run` commands start a torchrun job and are marked slow; the rest are skipped
with the reason in `SKIP`. Output files a command names (`--json`, `--pieces`, `--yaml`, `--out`, `--plot`) are
written to a temporary directory instead.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]

FAST = {"plan", "topo"}  # run in seconds on CPU, no processes of their own
SLOW = {"run"}  # starts torchrun with one process per rank

# A command matching one of these patterns is not run; the reason says why and what covers it instead.
SKIP: list[tuple[str, str]] = [
    (r"^reshard bench\b", "minutes: every mode on one torchrun job (tests/test_bench.py runs the demo pair)"),
    (r"^reshard check\b", "needs the output directory of a `reshard run --out` (tests/test_check.py)"),
    (r"--scale 105\b", "writes a 1.08 GB output"),
    (r"--refit-host\b", "pushes into a running vLLM server (tests/test_vllm_serve.py)"),
    (r"--bandwidth\b", "measures bandwidth for seconds with spawned processes (tests/test_topo_cli.py)"),
    (r"qwen3-next-80b", "derives vLLM's storage of an 80 B model first (about 90 s on 2 cores); "
                        "tests/test_vllm_derived_layout.py derives and plans the tiny hybrids"),
]
USER_FILES = "names the reader's own files (train.yaml, a checkpoint), not bundled ones"
OUTPUT_OPTIONS = {"--json", "--pieces", "--yaml", "--out", "--plot"}
PATH_OPTIONS = {"--src", "--dst", "--topology"}


def fenced_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced code block."""
    blocks, current, start = [], None, 0
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current, start = [], n + 1
            else:
                blocks.append((start, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of every `reshard ...` command shown in a code block of `path`."""
    found = []
    for start, lines in fenced_blocks(path.read_text()):
        i = 0
        while i < len(lines):
            line = lines[i].strip()
            if line.startswith("$ "):
                line = line[2:].strip()
            if re.match(r"reshard [a-z]+(\s|$)", line):
                n, parts = start + i, [line]
                while parts[-1].endswith("\\") and i + 1 < len(lines):
                    parts[-1] = parts[-1][:-1].rstrip()
                    i += 1
                    parts.append(lines[i].strip())
                found.append((n, " ".join(parts)))
            i += 1
    return found


def _exists(value: str, option: str) -> bool:
    """A path in the repository, or a bundled name (`demo/train`, `dgx-h100`)."""
    if option == "--topology" and value == "auto":
        return True
    if (ROOT / value).exists():
        return True
    folder = ROOT / "layouts" / ("topologies" if option == "--topology" else "")
    return (folder / f"{value}.yaml").exists()


def skip_reason(cmd: str) -> str | None:
    for pattern, reason in SKIP:
        if re.search(pattern, cmd):
            return reason
    args = shlex.split(cmd)
    if args[1] not in FAST | SLOW:
        return f"`reshard {args[1]}` is not run by this test"
    for opt, value in zip(args, args[1:]):
        if opt in PATH_OPTIONS and not _exists(value, opt):
            return USER_FILES
        if opt == "--source" and value not in ("synthetic",) and not value.startswith("synthetic:"):
            return USER_FILES
    return None


def _all_commands() -> list[tuple[str, str]]:
    """(where, command) for every command, each distinct command once (at its first place)."""
    out: dict[str, str] = {}
    for path in DOCS:
        for line, cmd in commands(path):
            out.setdefault(cmd, f"{path.relative_to(ROOT)}:{line}")
    return [(where, cmd) for cmd, where in out.items()]


def _params():
    params = []
    for where, cmd in _all_commands():
        reason = skip_reason(cmd)
        marks = []
        if reason:
            marks.append(pytest.mark.skip(reason=reason))
        elif shlex.split(cmd)[1] in SLOW:
            marks += [pytest.mark.slow, pytest.mark.multiprocess]
        params.append(pytest.param(cmd, id=where, marks=marks))
    return params


def _argv(cmd: str, tmp_path: Path) -> list[str]:
    args = shlex.split(cmd)[1:]
    for i in range(len(args) - 1):
        if args[i] in OUTPUT_OPTIONS:
            args[i + 1] = str(tmp_path / Path(args[i + 1]).name)
    return [sys.executable, "-m", "reshard_cli", *args]


@pytest.mark.parametrize("cmd", _params())
def test_documented_command_runs(cmd, tmp_path):
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=str(ROOT))
    p = subprocess.run(_argv(cmd, tmp_path), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (cmd, p.stdout[-2000:], p.stderr[-2000:])
    assert p.stdout.strip(), cmd


def test_commands_are_found():
    cmds = [c for _, c in _all_commands()]
    assert sum(c.startswith("reshard plan") for c in cmds) >= 4, cmds
    assert any(c.startswith("reshard topo") for c in cmds), cmds


def test_every_readme_plan_example_runs():
    """No `reshard plan` example of the README may be skipped: each one is run above."""
    plans = [c for _, c in commands(ROOT / "README.md") if c.startswith("reshard plan")]
    assert plans
    assert [c for c in plans if skip_reason(c)] == []


def test_command_parser(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("reshard plan --src outside\n```\n$ reshard plan --src a \\\n      --dst b\n"
                   "reshard plan: output, not a command\n```\n```bash\nreshard topo\n```\n")
    assert commands(doc) == [(3, "reshard plan --src a --dst b"), (8, "reshard topo")]


# ------------------------------------------------------------------------------------------------ links

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def test_slug():
    assert slug("`reshard plan`: the cost before the run") == "reshard-plan-the-cost-before-the-run"
    assert slug("Megatron-core: reading the trainer in place") == "megatron-core-reading-the-trainer-in-place"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(doc):
    bad = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert bad == []
