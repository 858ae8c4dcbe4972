#!/usr/bin/env bash
# Wheel check: build reshard's wheel, install it (and only it) into a fresh venv, and plan bundled layout
# pairs from a directory outside the clone, so code and bundled data must come from the wheel.
#
#   .ci/wheel_check.sh            (PYTHON=... picks the interpreter; default: python)
#
# Needs no network: the wheel is built with --no-build-isolation (the interpreter's setuptools) and
# installed with --no-deps --no-index; torch, typer, pyyaml, ... come from the interpreter's site-packages.
#
# Isolation, and why it holds:
#  * The wheel is built from a copy of the files git knows (tracked or untracked, not ignored), never in
#    place: an in-place build reuses the clone's build/lib, and files left there by an earlier build (a
#    module since moved or deleted) would ship in the wheel and hide a broken package list.
#  * The venv is made WITHOUT --system-site-packages. With it, the venv would also run the .pth file of the
#    clone's editable install (`pip install -e .`, as .ci/run does). Its finder sits after the normal path
#    finder, so the wheel's reshard_cli is imported first, but it still serves any reshard_cli.* submodule
#    the wheel lacks from the clone (tried: a wheel without reshard_cli.hw passed every plan that way).
#    Instead, one .pth file in the venv puts the interpreter's own sys.path entries (its site-packages:
#    torch, typer, pyyaml, pip, setuptools, ...) after the venv's site-packages, leaving out any folder that
#    holds a reshard_cli/ (a path-style editable install). A folder named in a .pth file is added without
#    running the .pth files inside it, so no editable finder is installed. `--without-pip`: the
#    interpreter's pip, found through that .pth file, installs into the venv (its sys.prefix).
#  * Checked, not assumed: every module of the source's reshard_cli/ must import from the venv's
#    site-packages, and the bundled data folder must be the wheel's reshard_cli/_data.
#  * PYTHONPATH is cleared and the user site is off (PYTHONNOUSERSITE). The plans run in a temp directory
#    outside the clone, so neither `layouts/` nor `reshard_cli/` is on hand as a relative path.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python}"
unset PYTHONPATH
export PYTHONNOUSERSITE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

WORK="$(mktemp -d "${TMPDIR:-/tmp}/reshard-wheel-check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
fail() { echo "wheel check: FAILED: $*" >&2; exit 1; }

# 1. a clean copy of the source (what a fresh clone would hold, plus uncommitted edits)
mkdir "$WORK/src"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard) |
        "$PY" -c '
import os, shutil, sys
root, dest = sys.argv[1], sys.argv[2]
for rel in sys.stdin.buffer.read().decode().split("\0"):
    src = os.path.join(root, rel)
    if rel and os.path.isfile(src):  # tracked but deleted in the working tree: skip
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))
' "$ROOT" "$WORK/src"
else
    cp -R "$ROOT/." "$WORK/src/"
    rm -rf "$WORK/src/build" "$WORK/src/"*.egg-info
fi

# 2. the wheel, carrying every file of layouts/ under reshard_cli/_data
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WORK/dist" "$WORK/src" >"$WORK/build.log" 2>&1 ||
    { cat "$WORK/build.log" >&2; fail "building the wheel"; }
WHEEL="$(ls "$WORK"/dist/reshard-*.whl)"
NDATA="$("$PY" -c 'import sys, zipfile; print(sum(n.startswith("reshard_cli/_data/") and not n.endswith("/") for n in zipfile.ZipFile(sys.argv[1]).namelist()))' "$WHEEL")"
NLAYOUTS="$(cd "$WORK/src/layouts" && find . -type f \( -name '*.yaml' -o -name '*.json' \) | wc -l | tr -d ' ')"
[ "$NDATA" = "$NLAYOUTS" ] || fail "the wheel carries $NDATA files under reshard_cli/_data, layouts/ holds $NLAYOUTS"

# 3. a venv holding the wheel, the interpreter's site-packages behind it
"$PY" -m venv --without-pip "$WORK/venv"
VPY="$WORK/venv/bin/python"
VSITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
"$PY" -c '
import os, sys
for p in sys.path[1:]:  # sys.path[0]: the working directory of `-c`
    if p and os.path.isdir(p) and not os.path.isdir(os.path.join(p, "reshard_cli")):
        print(p)
' >"$VSITE/_wheel_check_base_site.pth"
"$VPY" -m pip install --quiet --no-deps --no-index --force-reinstall "$WHEEL" >"$WORK/install.log" 2>&1 ||
    { cat "$WORK/install.log" >&2; fail "installing the wheel into the venv"; }
[ -x "$WORK/venv/bin/reshard" ] || fail "the wheel installed no reshard script into the venv"

# 4. from outside the clone: every module and the bundled data come from the wheel; then the plans
mkdir "$WORK/run"
cd "$WORK/run"
"$VPY" - "$WORK/src" <<'PYEOF' || fail "the venv does not import all of reshard_cli from the wheel"
import importlib, os, sys, sysconfig
from pathlib import Path

site = os.path.realpath(sysconfig.get_path("purelib"))
src = Path(sys.argv[1])
bad = []
for f in sorted((src / "reshard_cli").rglob("*.py")):
    parts = f.relative_to(src).with_suffix("").parts
    if parts[-1] == "__main__":  # runs the CLI when imported
        continue
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    try:
        where = os.path.realpath(importlib.import_module(name).__file__)
    except Exception as e:
        bad.append(f"{name}: {type(e).__name__}: {e}")
        continue
    if not where.startswith(site + os.sep):
        bad.append(f"{name}: imported from {where}")
try:
    from reshard_cli.layouts.bundled import data_dir
    data = os.path.realpath(data_dir())
    if data != os.path.join(site, "reshard_cli", "_data"):
        bad.append(f"bundled data read from {data}")
except Exception as e:
    bad.append(f"bundled data: {type(e).__name__}: {e}")
if bad:
    sys.exit(f"not the wheel's (venv site-packages {site}):\n  " + "\n  ".join(bad))
print(f"  modules      {site}/reshard_cli\n  bundled data {data}")
PYEOF

plan() {
    local out
    if ! out="$("$WORK/venv/bin/reshard" plan "$@" 2>&1)"; then
        echo "$out" >&2
        fail "reshard plan $*"
    fi
    echo "  ok  reshard plan $*"
}
plan --src qwen3-30b-a3b/megatron-tp2-ep4-pp2 --dst qwen3-30b-a3b/vllm-tp4-dp4
plan --src layouts/deepseek-v3/megatron-pp16-ep16.yaml --dst layouts/deepseek-v3/vllm-tp32-dp8.yaml --topology dgx-h100
plan --src demo/train --dst demo/infer

echo "wheel check ok: $(basename "$WHEEL") ($NDATA bundled data files), all modules and data from the wheel, 3 plans outside the clone"
