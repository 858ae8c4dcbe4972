"""Where one vLLM worker's bytes land, and vLLM's post-processing after they landed (the worker engine's
storage; vLLM reached through `compat`, its 0.32 defects repaired through `cpu_repairs`)."""
from __future__ import annotations

import re
import time

import torch

from reshard_cli import formats
from reshard_cli.engines.vllm import compat, cpu_repairs
from reshard_cli.engines.vllm.saved import Saved
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
        self.open_group: tuple | None = None  # (staged modules, {name: (parameter, copy)}, {module: [Saved]})
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
        modules, copies, saved = self.open_group
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
            held = sum(seen.values()) + sum(x.nbytes for entries in saved.values() for x in entries)
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
        saved: dict = {}  # per staged module: what vLLM's processing may replace (the module's, then its tied
        self.open_group = (begun, copies, saved)  # and derived modules'): what an abort undoes
        for mod_name, module in modules.items():
            saved[mod_name] = [Saved(module)]
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
        """vLLM's post-processing of the group (after the refit wrote and verified it), everything that can
        allocate or fail, before the last agreement: the staged modules into the kernels' format, then the
        modules whose kernels are built from them (a tied lm_head, from the embedding's new values) and the
        layers vLLM derives from them (MLA's W_UK_T / W_UV, from the new kv_b_proj). What each of them computes
        through is saved first (`saved.Saved`), so an abort puts it all back; the worker runs nothing else
        between this and the commit. A failure leaves the group open for the refit's abort."""
        t0 = time.perf_counter()
        modules, _copies, saved = self.open_group
        self._measure()  # with the BF16 landing buffers of an FP8 engine, dropped once processed
        self.landing.clear()
        for module in modules.values():
            compat.process_staged(module)
            cpu_repairs.repack_experts(module)
            why = compat.swap_mismatch(module)
            if why:
                raise RuntimeError(f"vLLM's processing changed a kernel tensor's shape ({why})")
        for name, module in modules.items():
            for tied in self.tied.get(name, ()):
                saved[name].append(Saved(tied, tables=True))
                self._process_tied(tied, module)
            for _layer_name, layer in self.derived.get(name, ()):
                saved[name].append(Saved(layer, tables=True, values=True))
                compat.process_derived(layer, self.model_config)
        self._measure()
        self.processing_seconds += time.perf_counter() - t0

    def _process_tied(self, tied, source) -> None:
        """vLLM's processing of a module tied to a staged one (a tied lm_head shares the embedding's weight),
        from the source's new values: its shared tensors point at the source's staged ones while it runs, and
        back at the shared kernel tensors after (which the commit fills with the same values)."""
        staged = {id(kernel): getattr(source, name) for name, kernel in compat.kernel_tensors(source).items()}
        saved = {n: p for n, p in tied.named_parameters(recurse=False)}
        for n, p in saved.items():
            if id(p) in staged:
                tied._parameters[n] = staged[id(p)]
        try:
            cpu_repairs.reprocess_tied([tied])
        finally:
            for n, p in saved.items():
                tied._parameters[n] = p

    def commit(self, group) -> None:
        """Every rank prepared the group: a swap and nothing else. The processed values are copied into the
        kernels' storage (checked to fit in `prepare`) and vLLM's own tensors put back, the other parameters
        copied into place; tied and derived modules were processed in `prepare`."""
        t0 = time.perf_counter()
        modules, copies, saved = self.open_group
        done: list = []
        try:
            for name, module in modules.items():
                compat.swap_in(module)
                compat.finish_reload(module, self.model_config)
                done.append(name)
            for param, copy in copies.values():
                param.data.copy_(copy)
        finally:  # a defect: the modules not swapped in stay open, for the abort that follows to put back
            rest = {n: m for n, m in modules.items() if n not in done}
            self.open_group = (rest, {}, {n: saved[n] for n in rest}) if rest else None
        self.processing_seconds += time.perf_counter() - t0

    def abort(self, group=None) -> None:
        """The open group undone: vLLM's finalize gives its staged modules their previous kernel tensors back,
        and whatever their processing replaced (the module's kernel state, its quant method's kernel and
        scales) and the tied and derived modules processed with them are restored as saved; the copies of the
        other parameters dropped."""
        self.landing.clear()
        if self.open_group is None:
            return
        modules, _copies, saved = self.open_group
        self.open_group = None
        for name, module in modules.items():
            compat.finish_reload(module, self.model_config)
            for s in reversed(saved[name]):
                s.restore()


_KV_SCALE = re.compile(r"attn\._?(k|v|q|prob)_scale$")  # an FP8 engine's attention: the KV cache's scales,
# which no checkpoint weight fills (vLLM's loader leaves them too)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
