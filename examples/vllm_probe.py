"""What a vLLM model computes, module by module: the ground truth for "an aborted refit leaves the engine as it
was" (tests/test_vllm_abort.py, `python examples/vllm_refit.py --faults`).

`probe(model)` runs each weight-bearing module of a vLLM model through the code vLLM's own forward runs for it,
on fixed seeded inputs, and returns its output: linear layers and routers through `quant_method.apply` (the
kernel vLLM chose: the CPU build's packed GEMM closure, an FP8 kernel), embeddings through
`quant_method.embedding`, the lm_head (tied or not) through `quant_method.apply`, routed experts through
`quant_method.apply` with fixed routing (the experts kernel, reading its scales where vLLM's kernels read them:
`moe_quant_config`), and MLA attention's absorbed weights as its forward uses them (`bmm` with `W_UK_T` and
`W_UV`). A whole-model forward composes exactly these, but needs an engine's attention metadata and KV cache;
this needs nothing but the model, so it runs in any process that holds one (a test building the model
in-process, or a vLLM worker through `collective_rpc`).

`digest(model)` is the same as one small dict (module name -> a hash of the output's bytes), for replies that
cross processes; `changed(before, after, modules)` compares two of them.
"""
from __future__ import annotations

import hashlib

import torch

ROWS = 5  # tokens per probe


def _inputs(width: int, seed: int, dtype) -> torch.Tensor:
    return torch.randn(ROWS, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def probe(model, vllm_config=None) -> dict[str, torch.Tensor]:
    """Every weight-bearing module's output on fixed inputs (see the module docstring), by module name."""
    import contextlib

    from vllm.config import set_current_vllm_config

    ctx = set_current_vllm_config(vllm_config) if vllm_config is not None else contextlib.nullcontext()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() == 2)
    out = {}
    with ctx, torch.no_grad():
        for name, module in model.named_modules():
            y = _one(module, dtype)
            if y is not None:
                out[name] = y
    return out


def _one(module, dtype):
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    qm = getattr(module, "quant_method", None)
    if isinstance(module, ParallelLMHead):
        return qm.apply(module, _inputs(module.embedding_dim, 1, dtype))
    if isinstance(module, VocabParallelEmbedding):
        return qm.embedding(module, torch.arange(min(7, module.num_embeddings_per_partition)))
    if isinstance(module, LinearBase):
        width = getattr(module, "input_size_per_partition", module.input_size)
        return qm.apply(module, _inputs(width, 1, dtype))
    if isinstance(module, RoutedExperts):
        ids = torch.randint(0, module.local_num_experts, (ROWS, min(2, module.local_num_experts)),
                            generator=torch.Generator().manual_seed(2)).to(torch.int32)
        weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3))
        return qm.apply(module, _inputs(module.hidden_size, 1, dtype), weights, ids, None, None)
    if isinstance(module, MLAAttention) and getattr(module, "W_UK_T", None) is not None:
        q = torch.randn(module.W_UK_T.shape[0], ROWS, module.W_UK_T.shape[1],
                        generator=torch.Generator().manual_seed(4)).to(module.W_UK_T.dtype)
        latent = torch.bmm(q, module.W_UK_T)
        return torch.cat([latent.flatten(), torch.bmm(latent.to(module.W_UV.dtype), module.W_UV).flatten()])
    return None


def digest(model, vllm_config=None) -> dict[str, str]:
    """`probe` as module name -> sha256 of the output's bytes (shape and dtype included)."""
    out = {}
    for name, y in probe(model, vllm_config).items():
        y = y.detach().contiguous().cpu()
        h = hashlib.sha256(f"{tuple(y.shape)} {y.dtype}".encode())
        h.update(y.view(torch.uint8).numpy().tobytes() if y.numel() else b"")
        out[name] = h.hexdigest()
    return out


def changed(before: dict, after: dict, modules=None) -> list[str]:
    """The modules (all, or those whose names start with one of `modules`) whose outputs differ."""
    names = sorted(set(before) | set(after))
    if modules is not None:
        names = [n for n in names if any(n == m or n.startswith(m + ".") for m in modules)]
    return [n for n in names if before.get(n) is None or after.get(n) is None or
            (not torch.equal(before[n], after[n]) if isinstance(before[n], torch.Tensor) else before[n] != after[n])]
