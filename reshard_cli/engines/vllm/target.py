"""Where one vLLM worker's bytes land, and vLLM's post-processing after they landed (the worker engine's
storage; vLLM reached through `compat`, its 0.32 defects repaired through `cpu_repairs`)."""
from __future__ import annotations

import time

import torch

from reshard_cli import formats
from reshard_cli.engines.vllm import compat, cpu_repairs
from reshard_cli.errors import ConfigError
from reshard_cli.transfer.live import Stage


class EngineTarget(Stage):
    """One worker's model as the refit's destination, a `Stage`: the refit opens, commits or aborts one group of
    layers at a time (`stage_mb`), so at most one group is staged beside the kernels, and nothing the model
    computes with changes before every rank of the refit has that group, verified.

    `staged`: modules vLLM post-processes after loading; for a group they are materialized in checkpoint format
    through vLLM's layerwise-reload bookkeeping, written by the refit, then (at commit) processed and copied
    into the kernels' storage by vLLM's own code (the step its reload runs once a layer's weights are all
    loaded); an aborted group gets its previous kernel tensors back. A module in a kernel format may look
    unchanged from outside (the CPU build keeps the experts' shapes but prepacks them), so every module with a
    quant method is staged. The others (norms) are written into copies, copied into place at commit."""

    def __init__(self, model, layout, rank: int, model_config):
        self.model, self.layout, self.rank, self.model_config = model, layout, rank, model_config
        self.format = formats.get(layout.format)
        self.storage = self.format.storage(layout, rank)
        params = dict(model.named_parameters())
        extra = sorted(set(params) - {et.name for et in self.storage})
        if extra:  # a parameter no checkpoint tensor fills would keep stale weights: refuse
            raise ConfigError(f"rank {rank}: engine parameter {extra[0]!r} is not filled by any checkpoint tensor "
                              f"of the layout ({len(extra)} such)", key="dst")
        self.staged: dict[str, torch.nn.Module] = {}
        for et in self.storage:
            mod_name = et.name.rpartition(".")[0]
            module = model.get_submodule(mod_name)
            if compat.post_processed(module):
                self.staged[mod_name] = module
        # their kernels were built from a staged module's parameter: processed again once the new values are in
        shared = {id(p): name for name, m in self.staged.items() for p in m.parameters(recurse=False)}
        self.tied: dict[str, list] = {}
        for m in cpu_repairs.tied_modules(model, list(self.staged.values())):
            source = next(shared[id(p)] for p in m.parameters(recurse=False) if id(p) in shared)
            self.tied.setdefault(source, []).append(m)
        # tensors whose engine storage has rows no checkpoint byte fills (a padded vocab): zeroed when staged,
        # as vLLM's own loader zeroes them
        self.padded = {et.name for et in self.storage
                       if sum(v.box.numel for v in et.views) < _numel(et.shape)}
        self.open_group: tuple | None = None  # (staged modules, {name: (parameter, copy)}) of the open group
        self.peak_staged_bytes = 0  # the most checkpoint-format bytes staged at once, this update
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

    def reset_stats(self) -> None:
        self.peak_staged_bytes, self.processing_seconds = 0, 0.0

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
        self.open_group = (begun, copies)  # what an abort must undo, should this fail half-way
        for mod_name, module in modules.items():
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
        staged = sum(et.nbytes for et in tensors)
        self.peak_staged_bytes = max(self.peak_staged_bytes, staged)
        return self.format.bind(params, layout, self.rank)

    def commit(self, group) -> None:
        """vLLM's post-processing of the group's staged modules (after the refit wrote them), its finalize, and
        the other parameters copied into place."""
        t0 = time.perf_counter()
        modules, copies = self.open_group
        try:
            for module in modules.values():
                compat.process_reloaded(module)
                cpu_repairs.repack_experts(module)
            for name in modules:
                cpu_repairs.reprocess_tied(self.tied.get(name, ()))
        except BaseException:
            self.abort()  # vLLM's finalize on the group: nothing is left open for the next update
            raise
        for module in modules.values():
            compat.finish_reload(module, self.model_config)
        for param, copy in copies.values():
            param.data.copy_(copy)
        self.open_group = None
        self.processing_seconds += time.perf_counter() - t0

    def abort(self, group=None) -> None:
        """vLLM's finalize on the open group's staged modules: their previous kernel tensors back; the copies
        of the other parameters dropped."""
        if self.open_group is None:
            return
        modules, _copies = self.open_group
        self.open_group = None
        for module in modules.values():
            compat.finish_reload(module, self.model_config)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
