import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

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
