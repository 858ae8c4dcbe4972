"""Where one vLLM worker's bytes land, and vLLM's post-processing after they landed (the worker engine's
storage; vLLM reached through `compat`, its 0.32 defects repaired through `cpu_repairs`)."""
from __future__ import annotations

import re
import time

import torch

from reshard_cli import formats
from reshard_cli.engines.vllm import compat, cpu_repairs
from reshard_cli.errors import ConfigError
from reshard_cli.plan.groups import layer_groups
from reshard_cli.transfer.live import Stage
from reshard_cli.transfer.shards import FP8Landing


class EngineTarget(Stage):
    """One worker's model as the refit's destination, a `Stage`: the refit opens, commits or aborts one group of
    layers at a time (`stage_mb`), so at most one group is staged beside the kernels, and nothing the model
    computes with changes before every rank of the refit has that group, verified.

    `staged`: modules vLLM post-processes after loading; for a group they are materialized in checkpoint format
    through vLLM's layerwise-reload bookkeeping, written by the refit, processed into the kernels' format by
    vLLM's own code (`prepare`: the step its reload runs once a layer's weights are all loaded, where every
    allocation happens), and only at commit copied into the kernels' storage; an aborted group gets its
    previous kernel tensors back, and the kernel state vLLM keeps outside tensors (the CPU build's packed-GEMM
    closures) as it was. A module in a kernel format may look unchanged from outside (the CPU build keeps the
    experts' shapes but prepacks them), so every module with a quant method is staged. The others (norms) are
    written into copies, copied into place at commit.

    `peak_staged_bytes` is measured: on CUDA the allocator's peak over the update above what was allocated
    before it; on CPU the bytes of the tensors the open group held at once (staged, processed, copies)."""

    def __init__(self, model, layout, rank: int, model_config):
        self.model, self.layout, self.rank, self.model_config = model, layout, rank, model_config
        self.format = formats.get(layout.format)
        self.storage = self.format.storage(layout, rank)
        params = dict(model.named_parameters())
        self.staged: dict[str, torch.nn.Module] = {}
        for et in self.storage:
            mod_name = et.name.rpartition(".")[0]
            module = model.get_submodule(mod_name)
            if compat.post_processed(module):
                self.staged[mod_name] = module
        # layers vLLM derives from a staged module's weights (MLA's W_UK_T / W_UV from kv_b_proj): processed
        # again by vLLM's own code once the group holding their source is committed
        self.derived = compat.derived_layers(model, self.staged)
        derived = {f"{name}.{p}" for layers in self.derived.values() for name, layer in layers
                   for p, _ in layer.named_parameters(recurse=False)}
        extra = sorted(n for n in set(params) - {et.name for et in self.storage} - derived
                       if not _KV_SCALE.search(n))
        if extra:  # a parameter no checkpoint tensor fills would keep stale weights: refuse
            raise ConfigError(f"rank {rank}: engine parameter {extra[0]!r} is not filled by any checkpoint tensor "
                              f"of the layout ({len(extra)} such)", key="dst")
        # their kernels were built from a staged module's parameter: processed again once the new values are in
        shared = {id(p): name for name, m in self.staged.items() for p in m.parameters(recurse=False)}
        self.tied: dict[str, list] = {}
        for m in cpu_repairs.tied_modules(model, list(self.staged.values())):
            source = next(shared[id(p)] for p in m.parameters(recurse=False) if id(p) in shared)
            self.tied.setdefault(source, []).append(m)
        # tensors whose engine storage has rows no checkpoint byte fills (a padded vocab): zeroed when staged,
        # as vLLM's own loader zeroes them
        self.padded = {et.name for et in self.storage
                       if not et.scales and sum(v.box.numel for v in et.views) < _numel(et.shape)}
        self.open_group: tuple | None = None  # (staged modules, {name: (parameter, copy)}, their attributes)
        self.landing: list = []  # a block-FP8 engine's open group: the BF16 buffers the refit allocated for
        # blocks that arrive unquantized (it quantizes them into the FP8 views)
        self.peak_staged_bytes = 0  # measured: the most bytes the open group held at once, this update
        self.largest_layer_bytes = max((u.nbytes for u in layer_groups(layout, 1)), default=0)  # the least a
        # group can stage (whole layers), on the destination rank that stages the most
        self.largest_group_bytes = 0  # planned: the most checkpoint-format bytes of one group, this update
        self._base_allocated = 0  # CUDA: allocated when the update began
        self.processing_seconds = 0.0
        # every view checked now, against the live parameters and the staged ones' checkpoint-format metadata
        self.format.bind(self._model_format(params), layout, rank)

    def _model_format(self, params: dict) -> dict:
        """The parameters in checkpoint format: live ones, or the staged modules' recorded metadata."""
        out = dict(params)
        for mod_name, module in self.staged.items():
            meta = compat.checkpoint_meta(module)
            for pname, _ in module.named_parameters(recurse=False, remove_duplicate=False):
                if pname in meta:
                    out[f"{mod_name}.{pname}"] = meta[pname]
        return out

    @property
    def staged_bytes(self) -> int:
        """Checkpoint-format bytes of every staged module (what one group holding the whole model stages)."""
        return sum(et.nbytes for et in self.storage if et.name.rpartition(".")[0] in self.staged)

    @property
    def weight_bytes(self) -> int:
        """All of this worker's checkpoint-format bytes (staged modules and the others)."""
        return sum(et.nbytes for et in self.storage)

    def reset_stats(self) -> None:
        self.peak_staged_bytes, self.largest_group_bytes, self.processing_seconds = 0, 0, 0.0
        device = next((p.device for p in self.model.parameters()), None)
        if device is not None and device.type == "cuda":
            import torch.cuda

            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._base_allocated = torch.cuda.memory_allocated(device)

    def _measure(self) -> None:
        """The bytes the open group holds now (CPU), or the allocator's peak so far (CUDA)."""
        modules, copies, _attrs = self.open_group
        device = next((p.device for p in self.model.parameters()), None)
        if device is not None and device.type == "cuda":
            held = torch.cuda.max_memory_allocated(device) - self._base_allocated
        else:
            seen: dict = {}
            for module in modules.values():
                for t in (*module.parameters(recurse=False), *module.buffers(recurse=False),
                          *(v for v in vars(module).values() if isinstance(v, torch.Tensor))):
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
            for _param, copy in copies.values():
                seen[copy.untyped_storage().data_ptr()] = copy.untyped_storage().nbytes()
            for buf in self.landing:
                seen[buf.untyped_storage().data_ptr()] = buf.untyped_storage().nbytes()
            held = sum(seen.values())
        self.peak_staged_bytes = max(self.peak_staged_bytes, held)

    def open(self, group, layout) -> dict:
        """Materialize the group's staged modules in checkpoint format, copy its other parameters, and bind
        every view of the group (`layout` holds its tensors only)."""
        if self.open_group is not None:
            raise RuntimeError("reshard: a staging group is already open")
        tensors = self.format.storage(layout, self.rank)
        modules = {}
        for et in tensors:
            mod_name = et.name.rpartition(".")[0]
            if mod_name in self.staged:
                modules[mod_name] = self.staged[mod_name]
        begun: dict = {}
        copies: dict = {}
        attrs: dict = {}
        self.open_group = (begun, copies, attrs)  # what an abort must undo, should this fail half-way
        for mod_name, module in modules.items():
            attrs[mod_name] = _state(module)
            compat.begin_reload(module)
            begun[mod_name] = module
            compat.materialize(module)
        params = dict(self.model.named_parameters())
        for et in tensors:
            if et.name.rpartition(".")[0] not in modules:
                copies[et.name] = (params[et.name], params[et.name].data.clone())
                params[et.name] = copies[et.name][1]
            elif et.name in self.padded:
                params[et.name].data.zero_()
        self.largest_group_bytes = max(self.largest_group_bytes, sum(et.nbytes for et in tensors))
        buffers = self.format.bind(params, layout, self.rank)
        self._land_fp8(tensors, params, layout, buffers)
        self._measure()
        return buffers

    def _land_fp8(self, tensors: list, params: dict, layout, buffers: dict) -> None:
        """A block-FP8 engine: each quantized checkpoint box is handed to the refit as an `FP8Landing` of its FP8
        view and its scales' view (the box holds whole blocks: the layout is checked so), where the blocks a
        sender quantized land. Where the plan sends a box blocks unquantized, the refit allocates a BF16
        buffer for them (kept in `landing`, counted and dropped here) and quantizes them into the views once
        the group's transfer is done."""
        q = layout.quantization
        if q is None or not q.block:
            return
        specs = layout.manifest.tensors
        scales = {et.name: et for et in tensors if et.scales}
        for et in tensors:
            if et.dtype != "float8_e4m3fn":
                continue
            scale_et = scales[et.name.removesuffix("weight") + "weight_scale_inv"]
            data, scale = params[et.name].data, params[scale_et.name].data
            for v, sv in zip(et.views, scale_et.scales):
                buffers[specs[v.tensor].name] = FP8Landing(data[v.region], scale[sv.region], held=self.landing)

    def prepare(self, group) -> None:
        """vLLM's post-processing of the group's staged modules into the kernels' format (after the refit
        wrote and verified them): every allocation of the group happens here, before the last agreement;
        what the model computes with is untouched. A failure leaves the group open for the refit's abort."""
        t0 = time.perf_counter()
        modules, _copies, _attrs = self.open_group
        self._measure()  # with the BF16 landing buffers of an FP8 engine, dropped once processed
        self.landing.clear()
        for module in modules.values():
            compat.process_staged(module)
            cpu_repairs.repack_experts(module)
            why = compat.swap_mismatch(module)
            if why:
                raise RuntimeError(f"vLLM's processing changed a kernel tensor's shape ({why})")
        self._measure()
        self.processing_seconds += time.perf_counter() - t0

    def commit(self, group) -> None:
        """Every rank prepared the group: its processed values copied into the kernels' storage (checked to
        fit in `prepare`), vLLM's finalize, the other parameters copied into place. Only tied modules (a
        tied lm_head) are processed here, once the shared parameter holds the new values."""
        t0 = time.perf_counter()
        modules, copies, _attrs = self.open_group
        self.open_group = None
        for module in modules.values():
            compat.swap_in(module)
            compat.finish_reload(module, self.model_config)
        for param, copy in copies.values():
            param.data.copy_(copy)
        for name in modules:
            cpu_repairs.reprocess_tied(self.tied.get(name, ()))
        for name in modules:
            for _layer_name, layer in self.derived.get(name, ()):
                compat.process_derived(layer, self.model_config)
        self.processing_seconds += time.perf_counter() - t0

    def abort(self, group=None) -> None:
        """vLLM's finalize on the open group's staged modules: their previous kernel tensors back, and the
        kernel state their processing may have replaced (prepared but not committed) as it was; the copies
        of the other parameters dropped."""
        self.landing.clear()
        if self.open_group is None:
            return
        modules, _copies, attrs = self.open_group
        self.open_group = None
        for name, module in modules.items():
            compat.finish_reload(module, self.model_config)
            _restore(module, attrs[name])


_TABLES = ("_parameters", "_buffers", "_modules")
_KV_SCALE = re.compile(r"attn\._?(k|v|q|prob)_scale$")  # an FP8 engine's attention: the KV cache's scales,
# which no checkpoint weight fills (vLLM's loader leaves them too)


def _state(module) -> dict:
    """A module's own attributes besides its tensors and children (where vLLM's processing keeps kernel state
    outside tensors: the CPU build's packed-GEMM closure `cpu_linear`)."""
    return {k: v for k, v in vars(module).items() if k not in _TABLES}


def _restore(module, state: dict) -> None:
    for k in [k for k in vars(module) if k not in _TABLES and k not in state]:
        delattr(module, k)
    for k, v in state.items():
        module.__dict__[k] = v


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
