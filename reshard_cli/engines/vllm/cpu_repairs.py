"""Repairs on top of vLLM 0.32's weight-update path, each a defect reported upstream with a standalone
reproduction (docs/upstream/):

- `repack_experts` / `pack_on_reload`: on CPU, MoE experts are not repacked after a weight update, even by
  vLLM's own `reload_weights` (docs/upstream/cpu-moe-experts-not-repacked.md), and where the CPU kernel pads
  the per-rank intermediate size (not a multiple of 32), vLLM's reload fails copying the unpadded result into
  the padded kernel tensor (docs/upstream/cpu-moe-padded-reload-fails.md);
- `tied_modules` / `reprocess_tied`: a module tied to a reloaded one (a tied lm_head shares the embedding's
  parameter) is not processed again (docs/upstream/tied-module-not-reprocessed.md);
- `view_buffers` / `resync_views`: a buffer vLLM registers at construction as a view of a parameter (Mamba-2's
  `conv_weights`, its `conv1d.weight` as [C, K], which its kernels compute with) keeps the first load's values
  once the parameter is replaced by processing, so an update of the parameter never reaches it, on vLLM's
  own reload path too (docs/upstream/mamba-conv-weights-stale-after-reload.md).
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


def pack_on_reload(model) -> list:
    """For vLLM's own layerwise reload (the full path): each CPU MoE layer's processing also runs the experts
    kernel's packing step (padding, prepacking), as the first load does, before vLLM copies the result into
    the kernel tensors it set aside. Returns the patched quant methods, for `unpatch`. Call before the reload
    starts (the experts are still on CPU then)."""
    patched = []
    for module in model.modules():
        fused = compat.experts_packer(module)
        quant = getattr(module, "quant_method", None)
        if fused is None or "process_weights_after_loading" in vars(quant):
            continue
        process = quant.process_weights_after_loading

        def packed(layer, _process=process, _fused=fused):
            _process(layer)
            _fused.process_weights_after_loading(layer)

        quant.process_weights_after_loading = packed
        patched.append(quant)
    return patched


def unpatch(patched: list) -> None:
    """The quant methods `pack_on_reload` patched, as they were."""
    for quant in patched:
        vars(quant).pop("process_weights_after_loading", None)


def tied_modules(model, staged) -> list:
    """Modules vLLM post-processes that share a parameter with a staged module without being staged
    themselves (a tied lm_head shares the embedding's): their kernels were built from the old values."""
    shared = {id(p) for m in staged for p in m.parameters(recurse=False)}
    ids = {id(m) for m in staged}
    return [m for m in model.modules() if id(m) not in ids and compat.post_processed(m)
            and any(id(p) in shared for p in m.parameters(recurse=False))]


def tied_later_owners(model) -> list:
    """Post-processed modules that share a parameter with a module before them (a tied lm_head shares the
    embedding's): vLLM's loaders load a tied parameter once, through its first owner, so its reload processes
    that owner only."""
    seen, out = set(), []
    for m in model.modules():
        own = {id(p) for p in m.parameters(recurse=False)}
        if own & seen and compat.post_processed(m):
            out.append(m)
        seen |= own
    return out


def reprocess_tied(modules) -> None:
    """vLLM's post-processing again on each tied module, once the new values are in."""
    for module in modules:
        compat.process_after_loading(module)


def view_buffers(model) -> list[tuple]:
    """(owner module, buffer name, module, parameter name) for each buffer registered as a view of a
    parameter of a module below its owner (the view's `_base`), once that parameter has been replaced (vLLM's
    processing gave the module a new tensor): the one parameter below the owner of the base's dtype and size.
    A buffer that still shares its parameter's storage, or matches none or several, is left alone."""
    out = []
    for owner_name, owner in model.named_modules():
        for bname, buf in owner._buffers.items():
            base = getattr(buf, "_base", None)
            if buf is None or base is None or not buf.is_floating_point() or buf.device.type == "meta":
                continue
            held = [(m, n, p) for mname, m in owner.named_modules() for n, p in m.named_parameters(recurse=False)
                    if p.dtype == buf.dtype and p.numel() == buf.numel()]
            if any(p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr() for _m, _n, p in held):
                continue  # still a view of the live parameter
            if len(held) == 1:
                out.append((owner, bname, held[0][0], held[0][1]))
    return out


def resync_views(views: list, modules=None) -> None:
    """Each of `views` (`view_buffers`) whose parameter's module is in `modules` (all when None) given the
    parameter's new values in checkpoint layout, in the buffer's shape: where the CPU build prepacked a
    causal-conv weight, the unpacked copy its processing stashes beside it (`_cpu_unpacked_conv_weight`, what
    its own fallbacks compute with), else the parameter itself."""
    ids = None if modules is None else {id(m) for m in modules}
    for owner, bname, module, pname in views:
        if ids is None or id(module) in ids:
            buf = owner._buffers[bname]
            values = getattr(module, "_cpu_unpacked_conv_weight", None)
            values = getattr(module, pname).data if values is None else values
            buf.copy_(values.reshape(buf.shape))
