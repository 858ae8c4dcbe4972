import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# reshard's cache (storage maps, tensor lists) is this session's own: tests neither read nor fill the user's
os.environ["RESHARD_CACHE"] = tempfile.mkdtemp(prefix="reshard-test-cache-")
atexit.register(shutil.rmtree, os.environ["RESHARD_CACHE"], True)

SMALL_MODEL = """
name: small
dtype: float32
tensors:
  - {name: embed_tokens.weight, shape: [13, 6]}
  - {name: layers.0.attn.q_proj.weight, shape: [9, 6]}
  - {name: layers.0.attn.o_proj.weight, shape: [6, 9]}
  - {name: layers.0.norm.weight, shape: [6]}
  - {name: layers.0.mlp.experts.0.up_proj.weight, shape: [10, 6]}
  - {name: layers.0.mlp.experts.1.up_proj.weight, shape: [10, 6]}
  - {name: layers.0.mlp.experts.0.down_proj.weight, shape: [6, 10]}
  - {name: layers.0.mlp.experts.1.down_proj.weight, shape: [6, 10]}
  - {name: layers.1.attn.q_proj.weight, shape: [9, 6]}
  - {name: layers.1.attn.o_proj.weight, shape: [6, 9]}
  - {name: layers.1.norm.weight, shape: [6], dtype: bfloat16}
  - {name: layers.1.mlp.experts.0.up_proj.weight, shape: [10, 6]}
  - {name: layers.1.mlp.experts.1.up_proj.weight, shape: [10, 6]}
  - {name: layers.1.mlp.experts.0.down_proj.weight, shape: [6, 10]}
  - {name: layers.1.mlp.experts.1.down_proj.weight, shape: [6, 10]}
  - {name: layers.1.empty.weight, shape: [0, 4]}
  - {name: layers.1.scale, shape: []}
  - {name: layers.1.count, shape: [3], dtype: int64}
  - {name: norm.weight, shape: [6]}
  - {name: lm_head.weight, shape: [13, 6]}
"""

# Pairs of small layouts (src, dst) covering: uneven and nested shards, PP, EP, replicas on both sides.
PAIRS = {
    "tp2_to_tp3": ("""
        mesh: {tp: 2}
        placements:
          - {match: 'q_proj|up_proj|embed|lm_head', shard: {tp: 0}}
          - {match: 'o_proj|down_proj', shard: {tp: 1}}
        """, """
        mesh: {tp: 3}
        placements:
          - {match: 'q_proj|up_proj|embed|lm_head', shard: {tp: 0}}
          - {match: 'o_proj|down_proj', shard: {tp: 1}}
        """),
    "pp2_ep2_to_dp2_tp2": ("""
        meshes:
          dense: {pp: 2, dp: 1, tp: 2}
          expert: {pp: 2, ep: 2}
        pipeline: pp
        experts: ep
        placements:
          - {match: 'experts', mesh: expert}
          - {match: 'q_proj|embed|lm_head', mesh: dense, shard: {tp: 0}}
          - {match: 'o_proj', mesh: dense, shard: {tp: 1}}
          - {match: '.', mesh: dense}
        """, """
        mesh: {dp: 2, tp: 2}
        placements:
          - {match: 'q_proj|up_proj|embed|lm_head', shard: {tp: 0}}
          - {match: 'o_proj|down_proj', shard: {tp: 1}}
        """),
    "nested_dp_to_ep": ("""
        mesh: {dp: 2, a: 2}
        placements:
          - {match: 'q_proj|up_proj|embed|lm_head', shard: {dp: 0, a: 0}}
          - {match: 'o_proj|down_proj', shard: {a: 1}}
        """, """
        mesh: {dp: 2, tp: 2}
        experts: tp
        placements:
          - {match: 'experts'}
          - {match: 'q_proj|embed|lm_head', shard: {tp: 0, dp: 1}}
        """),
}


def write_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    (tmp_path / "model.yaml").write_text(SMALL_MODEL)
    src, dst = PAIRS[name]
    paths = []
    for role, body in (("src", src), ("dst", dst)):
        p = tmp_path / f"{name}-{role}.yaml"
        p.write_text("model: model.yaml\n" + textwrap.dedent(body))
        paths.append(p)
    return paths[0], paths[1]


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test leaves this process's environment as it found it: a variable one sets here (a `reshard` command
    run in-process sets OMP_NUM_THREADS; a helper run in-process sets MASTER_PORT) would reach every process
    the tests after it start, in an order that depends on how the suite is split over workers."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture
def small_model(tmp_path):
    (tmp_path / "model.yaml").write_text(SMALL_MODEL)
    return tmp_path / "model.yaml"


def call_main(monkeypatch, capsys, *args) -> subprocess.CompletedProcess:
    """The console script's function itself (`reshard = reshard_cli.cli:main`) in this process, with a patched
    argv; returns what a subprocess run would (exit code, stdout, stderr)."""
    from reshard_cli.cli import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["reshard", *map(str, args)])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr()
    code = info.value.code if isinstance(info.value.code, int) else (0 if info.value.code is None else 1)
    return subprocess.CompletedProcess(args, code, out.out, out.err)


# ------------------------------------------------------------------------------------------------ test tiers
# Markers (registered in pyproject.toml) assigned here, by test module and, where a module is mixed, by test
# name, so the test files stay as they are. `python -m pytest -q -m "not slow"` is the quick tier.
#   slow          seconds to minutes each: processes, engines, a wheel build, the largest plans
#   vllm          uses vLLM's CPU build: real engines (all slow), or only its symbols (test_vllm_contract)
#   megatron      needs megatron-core and mbridge (real Megatron trainers)
#   multiprocess  starts cooperating processes: gloo process groups, torchrun jobs, vLLM engines
# A test marked in its own file (tests/test_docs.py) keeps those marks too. Renaming a test listed below means
# renaming it here, or it silently joins the quick tier.
import re  # noqa: E402

_VLLM = ("slow", "vllm", "multiprocess")
_PROCS = ("slow", "multiprocess")

TIER_MODULES: dict[str, tuple[str, ...]] = {
    "test_vllm_engine": _VLLM,
    "test_vllm_format": _VLLM,
    "test_vllm_refit": _VLLM,
    "test_vllm_staging": _VLLM,
    "test_vllm_fleet": _VLLM,
    "test_vllm_serve_fleet": _VLLM,
    "test_vllm_serve_dp": _VLLM,
    "test_vllm_serve": _VLLM,
    "test_vllm_contract": ("vllm",),  # vLLM's symbols, no engine: seconds
    "test_fp8": ("vllm",),  # vLLM's quantizer as the reference: seconds
    "test_vllm_fp8_storage": ("vllm",),  # vLLM's FP8 layers in this process, a world of one: seconds
    "test_vllm_fp8_format": ("vllm",),  # and one run of the FP8 example: three processes, a minute
    "test_vllm_abort": ("slow", "vllm"),  # three vLLM models in this process, each built a few times: a minute
    "test_vllm_fp8_online": ("slow", "vllm"),  # vLLM's FP8 models in this process, two per scheme: minutes
    "test_vllm_fp8_tp2": _VLLM,  # TP2 vLLM engines and a trainer, four processes: minutes
    "test_transport": _PROCS,  # every mode on gloo process groups
    "test_run": _PROCS,  # `reshard run` under torchrun
}

# module -> [(regex matched at the start of the test's name, parameters included, markers)]; first match wins
TIER_TESTS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "test_api": [(r"test_yaml_layouts_plain_tensors|test_live_refit_example|test_refit_over_its_own_group",
                  _PROCS)],
    "test_auto": [(r"test_auto_refit_is_exact", _PROCS)],
    "test_fp8_wire": [(r"test_(sender_quantized|staged_refit)", _VLLM)],  # gloo processes, vLLM's quantizer
    "test_bench": [(r"test_bench_demo_pair_end_to_end", _PROCS)],
    # the generator's blocks for every dtype: bf16, fp32, fp16 and fp8 stay in the quick tier
    "test_check": [(r"test_fast_synthetic_values_are_the_generator_s\[torch\.(float64|int8|int32|int64|uint8|bool)\]",
                    ("slow",))],
    # the cost model on the large bundled pairs (seconds each); demo and Qwen3 stay in the quick tier
    "test_cost": [(r"test_(lower_bound_below_every_mode|auto_never_slower_than_a_fixed_mode)"
                   r"\[(deepseek-v3|kimi-k2|moe-2\.4t)-", ("slow",))],
    "test_launchers": [(r"test_local_script_runs_the_demo", _PROCS)],
    "test_packaging": [(r"test_wheel_installs_and_plans_bundled_layouts_outside_the_clone", ("slow",))],
    "test_sources": [(r"test_dcp_dtensor_checkpoint", _PROCS)],  # also needs RESHARD_SLOW_TESTS=1
    "test_topo_cli": [(r"test_run_topology_auto_then_check|test_topo_under_torchrun", _PROCS)],
    "test_megatron": [
        (r"test_megatron_into_a_running_vllm_engine", ("slow", "megatron", "vllm", "multiprocess")),
        (r"test_live_megatron_refit|test_torch_dist_checkpoint|test_a_running_model_that_differs",
         ("slow", "megatron", "multiprocess")),
    ],
}


def tier_markers(module: str, test: str) -> tuple[str, ...]:
    """The markers of test `test` (its name, parameters included) in module `module` (its file name's stem)."""
    marks = list(TIER_MODULES.get(module, ()))
    for pattern, extra in TIER_TESTS.get(module, ()):
        if re.match(pattern, test):
            marks += extra
            break
    return tuple(dict.fromkeys(marks))


# The modules that take longest (minutes each on 2 cores), longest first: they run first, so that the suite's
# workers (pytest-xdist, one module each at a time: `--dist loadfile`) end together instead of one of them
# starting a long module when the other is nearly done.
LONGEST_FIRST = ("test_vllm_engine", "test_megatron", "test_vllm_refit", "test_vllm_serve_fleet", "test_vllm_staging",
                 "test_run", "test_vllm_serve", "test_transport", "test_api", "test_vllm_serve_dp")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = Path(str(item.fspath)).stem
        for name in tier_markers(module, item.name):
            item.add_marker(getattr(pytest.mark, name))
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).stem, len(rank)))  # stable: file order otherwise
