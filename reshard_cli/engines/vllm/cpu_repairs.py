"""Repairs on top of vLLM 0.32's weight-update path, each a defect reported upstream with a standalone
reproduction (docs/upstream/):

- `repack_experts`: on CPU, MoE experts are not repacked after a weight update, even by vLLM's own
  `reload_weights` (docs/upstream/cpu-moe-experts-not-repacked.md);
- `tied_modules` / `reprocess_tied`: a module tied to a reloaded one (a tied lm_head shares the embedding's
  parameter) is not processed again (docs/upstream/tied-module-not-reprocessed.md).
"""
from __future__ import annotations

from reshard_cli.engines.vllm import compat


def repack_experts(module) -> None:
    """vLLM 0.32 prepacks the CPU build's MoE weights (same shape, the grouped GEMM's layout) when a model is
    first loaded, but its update path (`_setup_kernel` once a kernel exists, which its own `reload_weights`
    takes too) leaves them in checkpoint layout, so an updated MoE computes with wrongly laid-out experts.
    After vLLM's processing, run the experts kernel's own packing step again, as the first load does."""
    fused = compat.experts_packer(module)
    if fused is not None:
        fused.process_weights_after_loading(module)


def tied_modules(model, staged) -> list:
    """Modules vLLM post-processes that share a parameter with a staged module without being staged
    themselves (a tied lm_head shares the embedding's): their kernels were built from the old values."""
    shared = {id(p) for m in staged for p in m.parameters(recurse=False)}
    ids = {id(m) for m in staged}
    return [m for m in model.modules() if id(m) not in ids and compat.post_processed(m)
            and any(id(p) in shared for p in m.parameters(recurse=False))]


def reprocess_tied(modules) -> None:
    """vLLM's post-processing again on each tied module, once the new values are in."""
    for module in modules:
        compat.process_after_loading(module)
