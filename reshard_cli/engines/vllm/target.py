"""Where one vLLM worker's bytes land, and vLLM's post-processing after they landed (the worker engine's
storage; vLLM reached through `compat`, its 0.32 defects repaired through `cpu_repairs`)."""
from __future__ import annotations

import time

import torch

from reshard_cli import formats
from reshard_cli.engines.vllm import compat, cpu_repairs
from reshard_cli.errors import ConfigError


class EngineTarget:
    """One worker's model as the refit's destination.

    `direct`: modules without a quant method (norms): the refit writes into their parameters.
    `staged`: modules vLLM post-processes after loading; per update they are materialized in checkpoint format
    through vLLM's layerwise-reload bookkeeping, written by the refit, then processed and copied into the
    kernels' storage by vLLM's own code (the step its reload runs once a layer's weights are all loaded). A
    module in a kernel format may look unchanged from outside (the CPU build keeps the experts' shapes but
    prepacks them), so every module with a quant method is staged."""

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
        self.tied = cpu_repairs.tied_modules(model, list(self.staged.values()))
        # tensors whose engine storage has rows no checkpoint byte fills (a padded vocab): zeroed when staged,
        # as vLLM's own loader zeroes them
        self.padded = {et.name for et in self.storage
                       if sum(v.box.numel for v in et.views) < _numel(et.shape)}
        self.views: dict | None = None
        self.active = False  # staged modules are materialized (between start and update/finish)
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
        return sum(et.nbytes for et in self.storage if et.name.rpartition(".")[0] in self.staged)

    def begin(self) -> None:
        """Materialize the staged modules in checkpoint format and bind every view (start of an update)."""
        if self.active:
            raise RuntimeError("reshard: start_weight_update twice without an update in between")
        for module in self.staged.values():
            compat.begin_reload(module)
            compat.materialize(module)
        self.active = True
        params = dict(self.model.named_parameters())
        for name in self.padded:
            if name.rpartition(".")[0] in self.staged:
                params[name].data.zero_()
        self.views = self.format.bind(params, self.layout, self.rank)

    def commit(self) -> float:
        """vLLM's post-processing of every staged module (after the refit wrote it); its seconds."""
        t0 = time.perf_counter()
        for module in self.staged.values():
            compat.process_reloaded(module)
            cpu_repairs.repack_experts(module)
        cpu_repairs.reprocess_tied(self.tied)
        self.active, self.views = False, None
        return time.perf_counter() - t0

    def end(self) -> None:
        """vLLM's finalize on the staged modules: a module not committed gets its previous kernel tensors back."""
        for module in self.staged.values():
            compat.finish_reload(module, self.model_config)
        self.active, self.views = False, None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
