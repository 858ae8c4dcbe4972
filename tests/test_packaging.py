"""Packaging: a built wheel carries the code and the bundled data (layouts/ as reshard_cli/_data), and
bundled names resolve from any directory, in a source checkout as in an installed wheel."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

WHEEL_CHECK = ROOT / ".ci" / "wheel_check.sh"


def _env(**extra):
    env = dict(os.environ, CI="true", COLUMNS="120", **extra)
    if "PYTHONPATH" not in extra:
        env.pop("PYTHONPATH", None)
    return env


def _pyproject():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_in_the_wheel_package_list():
    """pyproject.toml lists packages by hand (a `find` cannot also name the mapped reshard_cli._data)."""
    config = _pyproject()["tool"]["setuptools"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "reshard_cli").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    listed = set(config["packages"])
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - on_disk == {"reshard_cli._data"}
    assert config["package-dir"] == {"reshard_cli._data": "layouts"}


@pytest.mark.parametrize("extra", [[], ["--topology", "dgx-h100"]], ids=["no-topology", "dgx-h100"])
def test_bundled_names_resolve_outside_the_repository(tmp_path, extra):
    """Source tree: reshard_cli/../layouts, whatever the working directory (as an editable install runs)."""
    p = subprocess.run([sys.executable, "-m", "reshard_cli", "plan", "--src", "demo/train", "--dst", "demo/infer",
                        *extra], cwd=tmp_path, env=_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert "demo-train" in p.stdout and "demo-infer" in p.stdout
    if extra:
        assert "dgx-h100" in p.stdout


def test_editable_install_reads_the_repository_layouts(tmp_path):
    """`pip install -e .` (as .ci/run does): the installed package is this checkout's and reads its layouts/."""
    p = subprocess.run([sys.executable, "-c", "import reshard_cli, reshard_cli.layouts.bundled as b; "
                        "print(reshard_cli.__file__); print(b.data_dir())"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "No module named 'reshard_cli'" in p.stderr:
        pytest.skip("reshard is not installed (pip install -e .)")
    assert p.returncode == 0, p.stderr
    module, data = p.stdout.split("\n")[:2]
    if not os.path.realpath(module).startswith(str(ROOT.resolve()) + os.sep):
        pytest.skip(f"the installed reshard_cli is not this checkout's: {module}")
    assert os.path.realpath(data) == str((ROOT / "layouts").resolve())


_PROBE = """
import importlib.util, sys
try:
    import setuptools  # first: looking up pip beforehand makes setuptools' distutils shim step aside
except ImportError:
    sys.exit("this Python has no setuptools (needed to build the wheel)")
if int(setuptools.__version__.split(".")[0]) < 64:
    sys.exit(f"setuptools {setuptools.__version__} < 64 (pyproject.toml's build requirement)")
if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
    sys.exit("setuptools has no bdist_wheel and the `wheel` package is missing")
for module in ("venv", "pip"):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"this Python has no {module} module (needed to build and install the wheel)")
"""


def _wheel_check_impossible(tmp_path) -> str | None:
    """Why .ci/wheel_check.sh cannot run on this machine, or None. Only missing tools count: bash, venv,
    pip, setuptools>=64 with bdist_wheel (built in from setuptools 70.1, else the `wheel` package). Probed in
    subprocesses: importing setuptools into the test process would meddle with its distutils."""
    if shutil.which("bash") is None:
        return "no bash"
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=_env(), capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return probe.stderr.strip()[-300:]
    probe = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "probe-venv")],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"python -m venv fails here: {probe.stderr.strip()[-300:]}"
    return None


def test_wheel_installs_and_plans_bundled_layouts_outside_the_clone(tmp_path):
    """.ci/wheel_check.sh: build the wheel, install it alone into a fresh venv, plan bundled pairs from a
    temp directory (about 10 s)."""
    reason = _wheel_check_impossible(tmp_path)
    if reason:
        pytest.skip(f"cannot build or install a wheel on this machine: {reason}")
    p = subprocess.run(["bash", str(WHEEL_CHECK)], cwd=tmp_path, env=_env(PYTHON=sys.executable, TMPDIR=str(tmp_path)),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert "wheel check ok" in p.stdout
