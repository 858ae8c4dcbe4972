"""Where one vLLM worker's bytes land, and vLLM's post-processing after they landed (the worker engine's
storage; vLLM reached through `compat`, its 0.32 defects repaired through `cpu_repairs`)."""
from __future__ import annotations

import re
import time

import torch

from reshard_cli import formats
from reshard_cli.base.fp8 import quantize_tensor
from reshard_cli.engines.vllm import compat, cpu_repairs
from reshard_cli.engines.vllm.saved import Saved
from reshard_cli.errors import ConfigError
from reshard_cli.plan.groups import layer_groups
from reshard_cli.transfer.live import Stage
from reshard_cli.codecs.fp8 import FP8Landing


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
        self.views = cpu_repairs.view_buffers(model)  # buffers over a replaced parameter: given its new values
        self._check_filled(params)
        engine_q, layout_q = getattr(model_config, "quantization", None), layout.quantization
        if engine_q in ("fp8", "fp8_per_tensor", "fp8_per_block") and engine_q != getattr(layout_q, "method", None):
            raise ConfigError(f"rank {rank}: the engine runs vLLM's {engine_q} quantization, the layout says "
                              f"{getattr(layout_q, 'method', 'none')}: set engine: {{quantization: {engine_q}}}",
                              key="dst")
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
        self.landing: list = []  # an FP8 engine's open group: the BF16 buffers allocated for what arrives
        # unquantized (block FP8: by the refit, which quantizes them into the FP8 views; per-tensor FP8: below)
        self.quant = layout.quantization
        self.handed: dict = {}  # the open group's buffers by checkpoint name (what `local_max` reads)
        self.pending: list = []  # a per-tensor FP8 checkpoint's open group: (name, BF16 buffer, FP8 view, scale
        # view), quantized in `prepare` with the max |x| the refit agreed (`reduced`)
        self.maxima: dict = {}  # checkpoint name -> max |x| over every shard, agreed for the open group
        self._by_module: dict[str, list] = {}
        for et in self.storage:
            self._by_module.setdefault(et.name.rpartition(".")[0], []).append(et)
        self.peak_staged_bytes = 0  # measured: the most bytes the open group held at once, this update
        self.largest_layer_bytes = max((u.nbytes for u in layer_groups(layout, 1)), default=0)  # the least a
        # group can stage (whole layers), on the destination rank that stages the most
        self.largest_group_bytes = 0  # planned: the most checkpoint-format bytes of one group, this update
        self._base_allocated = 0  # CUDA: allocated when the update began
        self.processing_seconds = 0.0
        # every view checked now, against the live parameters and the staged ones' checkpoint-format metadata
        self.format.bind(self._model_format(params), layout, rank, staged=[])
        self.through_bytes = 0  # this update's bytes that landed in such buffers (not in place)
        self.through: list = []  # the open group's staged checkpoint boxes (`formats.derived.Staged`): landed in
        # buffers of their own, written into the engine's tensors as vLLM's loader writes them (`prepare`)

    def _check_filled(self, params: dict) -> None:
        """Every engine parameter is filled by a checkpoint tensor of the layout, derived by vLLM from one
        (MLA's), produced by vLLM's processing of a staged module (not in its checkpoint format: `fp8_per_tensor`'s
        `weight_scale`), or a KV cache scale; else one ConfigError (it would keep stale weights)."""
        derived = {f"{name}.{p}" for layers in self.derived.values() for name, layer in layers
                   for p, _ in layer.named_parameters(recurse=False)}
        for mod_name, module in self.staged.items():
            meta = compat.checkpoint_meta(module)
            derived |= {f"{mod_name}.{p}" for p, _ in module.named_parameters(recurse=False) if meta and p not in meta}
        extra = sorted(n for n in set(params) - {et.name for et in self.storage} - derived
                       if not _KV_SCALE.search(n))
        if extra:
            raise ConfigError(f"rank {self.rank}: engine parameter {extra[0]!r} is not filled by any checkpoint "
                              f"tensor of the layout ({len(extra)} such)", key="dst")

    def _model_format(self, params: dict) -> dict:
        """The parameters in checkpoint format: live ones, or the staged modules' recorded metadata (for
        `fp8_per_block`, the FP8 blocks and scales the refit stages instead of vLLM's BF16 format)."""
        out = dict(params)
        for mod_name, module in self.staged.items():
            meta = compat.checkpoint_meta(module)
            for pname, _ in module.named_parameters(recurse=False, remove_duplicate=False):
                if pname in meta:
                    out[f"{mod_name}.{pname}"] = meta[pname]
            for et in self._fp8_staged(mod_name, module):
                out[et.name] = torch.empty(et.shape, dtype=getattr(torch, et.dtype), device="meta")
        return out

    def _fp8_staged(self, mod_name: str, module) -> list:
        """`fp8_per_block`: the module's engine tensors the refit stages as FP8 blocks and their scales (vLLM's
        own reload would stage BF16 and quantize it), [] otherwise."""
        if self.quant is None or not (self.quant.online and self.quant.block) or not compat.per_block_online(module):
            return []
        return [et for et in self._by_module.get(mod_name, ()) if et.scales or et.dtype == "float8_e4m3fn"]

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
        self.through_bytes = 0
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
            for et in self._fp8_staged(mod_name, module):  # on meta, materialized with the rest
                module.register_parameter(et.name.rpartition(".")[2], torch.nn.Parameter(
                    torch.empty(et.shape, dtype=getattr(torch, et.dtype), device="meta"), requires_grad=False))
            compat.materialize(module)
        params = dict(self.model.named_parameters())
        for et in tensors:
            if et.name.rpartition(".")[0] not in modules:
                copies[et.name] = (params[et.name], params[et.name].data.clone())
                params[et.name] = copies[et.name][1]
            elif et.name in self.padded:
                params[et.name].data.zero_()
        self.largest_group_bytes = max(self.largest_group_bytes, sum(et.nbytes for et in tensors))
        buffers = self.format.bind(params, layout, self.rank, staged=self.through)
        self.landing += [st.buffer for st in self.through]
        self.through_bytes += sum(st.buffer.nbytes for st in self.through)
        self._land_fp8(tensors, params, layout, buffers)
        self.handed, self.maxima = buffers, {}
        self._measure()
        return buffers

    def _land_fp8(self, tensors: list, params: dict, layout, buffers: dict) -> None:
        """An engine whose storage is FP8 (`Quantization.stored_fp8`). Block scales: each quantized checkpoint
        box is handed to the refit as an `FP8Landing` of its FP8 view and its scales' view (the box holds whole
        blocks: the layout is checked so), where the blocks a sender quantized land; where the plan sends a
        box blocks unquantized, the refit allocates a BF16 buffer for them (kept in `landing`, counted and
        dropped here) and quantizes them into the views once the group's transfer is done. Per-tensor
        scales: no sender can quantize a shard alone, so each box lands in a BF16 buffer of its own (in
        `landing` and `pending`), quantized in `prepare` with its tensor's max |x| agreed over the refit."""
        q = layout.quantization
        if q is None or not q.stored_fp8:
            return
        specs = layout.manifest.tensors
        scales = {et.name: et for et in tensors if et.scales}
        for et in tensors:
            if et.dtype != "float8_e4m3fn":
                continue
            scale_et = scales[q.scale_name(et.name)]
            data, scale = params[et.name].data, params[scale_et.name].data
            for v, sv in zip(et.views, scale_et.scales):
                name = specs[v.tensor].name
                if q.block:
                    buffers[name] = FP8Landing(data[v.region], scale[sv.region], held=self.landing)
                    continue
                buf = torch.empty(v.box.sizes, dtype=getattr(torch, specs[v.tensor].dtype), device=data.device)
                self.landing.append(buf)
                self.pending.append((name, buf, data[v.region], scale[sv.region]))
                buffers[name] = buf

    def local_max(self, group, names: list[str]) -> dict:
        """Each of `names`' max |x| over what arrived here (a per-tensor FP8 engine: the BF16 that vLLM or
        `prepare` quantizes with the max over every shard)."""
        out = {}
        for name in names:
            x = self.handed.get(name)
            if isinstance(x, torch.Tensor) and x.numel():
                lo, hi = x.aminmax()
                out[name] = float(torch.maximum(lo.abs(), hi.abs()))
        return out

    def reduced(self, group, maxima) -> None:
        self.maxima = dict(maxima)

    def _agreed(self, name: str) -> float:
        if name not in self.maxima:
            raise RuntimeError(f"no max |x| was agreed for {name}")
        return self.maxima[name]

    def _quantize_pending(self) -> None:
        """A per-tensor FP8 checkpoint: each box that arrived in BF16 quantized into its FP8 view with its
        tensor's agreed max |x| (`base.fp8.quantize_tensor`, the conversion of vLLM's per-tensor kernel: a
        shard quantized alone with the whole tensor's scale is the whole tensor's bytes there), its scale into
        its slot."""
        for name, buf, fp8, scale in self.pending:
            q, s = quantize_tensor(buf, self._agreed(name))
            fp8.copy_(q)
            scale.copy_(s.reshape(scale.shape))
        self.pending.clear()

    def _module_amax(self, mod_name: str) -> list:
        """`fp8_per_tensor`: the max |x| vLLM's processing of a module takes (`compat.agreed_amax`), in its order:
        a linear layer's over its fused members; stacked experts' per local expert, w13 (gate and up) then w2."""
        specs, out = self.layout.manifest.tensors, []
        for et in sorted(self._by_module.get(mod_name, ()), key=lambda et: et.name):
            if not et.name.endswith("weight") or not any(
                    self.quant.quantizes(specs[v.tensor].name, specs[v.tensor].shape) for v in et.views):
                continue
            if len(et.shape) == 3:  # experts: one value per local expert (region[0])
                per = [0.0] * et.shape[0]
                for v in et.views:
                    per[v.region[0]] = max(per[v.region[0]], self._agreed(specs[v.tensor].name))
                out.append(torch.tensor(per, dtype=torch.float32))
            else:
                out.append(torch.tensor([max(self._agreed(specs[v.tensor].name) for v in et.views)]))
        return out

    def _process(self, mod_name: str, module) -> None:
        """vLLM's processing of a staged module: as vLLM's reload runs it; `fp8_per_tensor` with the max |x| the
        refit agreed in place of its TP all-reduce; `fp8_per_block` without its quantization, which the
        senders did."""
        if self._fp8_staged(mod_name, module):
            compat.process_prequantized(module)
        elif self.quant is not None and compat.per_tensor_online(module):
            with compat.agreed_amax(self._module_amax(mod_name)):
                compat.process_staged(module)
        else:
            compat.process_staged(module)

    def prepare(self, group) -> None:
        """vLLM's post-processing of the group (after the refit wrote and verified it), everything that can
        allocate or fail, before the last agreement: the staged modules into the kernels' format, then the
        modules whose kernels are built from them (a tied lm_head, from the embedding's new values) and the
        layers vLLM derives from them (MLA's W_UK_T / W_UV, from the new kv_b_proj). What each of them computes
        through is saved first (`saved.Saved`), so an abort puts it all back; the worker runs nothing else
        between this and the commit. A failure leaves the group open for the refit's abort."""
        t0 = time.perf_counter()
        modules, _copies, saved = self.open_group
        self._measure()  # with the landing buffers (FP8's BF16, staged boxes), dropped once written
        for st in self.through:  # as vLLM's loader writes them: several regions, -exp(A_log), a cast
            st.apply()
        self.through.clear()
        self.landing.clear()
        self._quantize_pending()
        self.handed = {}  # (views of the staging: not kept past the group)
        for mod_name, module in modules.items():
            self._process(mod_name, module)
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
            cpu_repairs.resync_views(self.views, modules.values())
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
        self.pending.clear()
        self.through.clear()
        self.handed, self.maxima = {}, {}
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
