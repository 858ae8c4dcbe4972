"""What vLLM's processing of one module may replace, saved before it runs, so that an aborted group leaves the
module computing exactly as before it was opened (the engine target's abort; needs no vLLM).

vLLM's post-load processing does more than fill tensors. A block-FP8 MoE layer's `Fp8MoEMethod` rebuilds
`quant_method.moe_quant_config` (the experts kernel reads its scales from there, not from the layer) and
`quant_method.moe_kernel`; the CPU build keeps a packed-GEMM closure on the module (`cpu_linear`); MLA's
attention writes `W_UK_T` / `W_UV` in place and keeps state on its backend `impl`. A `Saved` holds, for one
module: its own attributes besides its tensor tables, the attributes of the objects it computes through
(`compat.kernel_objects`: its quant method, an attention backend's impl), optionally its tensor tables, and
optionally the values of its own tensors (for a module whose processing writes them in place). `restore`
puts all of it back.
"""
from __future__ import annotations

from reshard_cli.engines.vllm import compat

TABLES = ("_parameters", "_buffers", "_modules")


class Saved:
    def __init__(self, module, *, tables: bool = False, values: bool = False):
        self.module = module
        self.attrs = own_attrs(module)
        self.objects = [(obj, dict(vars(obj))) for obj in compat.kernel_objects(module)]
        self.tables = {t: dict(getattr(module, t)) for t in TABLES[:2]} if tables else None
        # the tensors themselves and a copy of what they hold (processing may write into them)
        self.values = [(t, t.detach().clone()) for t in own_tensors(module)] if values else []

    @property
    def nbytes(self) -> int:
        """The copies it holds."""
        return sum(copy.numel() * copy.element_size() for _t, copy in self.values)

    def restore_tables(self) -> None:
        """The module's parameters and buffers back to the objects it held when saved."""
        if self.tables is None:
            return
        for name, saved in self.tables.items():
            table = getattr(self.module, name)
            table.clear()
            table.update(saved)

    def restore(self) -> None:
        """Everything saved back: attributes, the kernel objects' attributes, tables, values."""
        restore_attrs(self.module, self.attrs)
        for obj, state in self.objects:
            obj.__dict__.clear()
            obj.__dict__.update(state)
        self.restore_tables()
        for tensor, copy in self.values:
            tensor.data.copy_(copy)


def own_attrs(module) -> dict:
    """A module's own attributes besides its tensors and children (where vLLM's processing keeps kernel state
    outside tensors: the CPU build's packed-GEMM closure `cpu_linear`)."""
    return {k: v for k, v in vars(module).items() if k not in TABLES}


def restore_attrs(module, state: dict) -> None:
    for k in [k for k in vars(module) if k not in TABLES and k not in state]:
        delattr(module, k)
    for k, v in state.items():
        module.__dict__[k] = v


def own_tensors(module) -> list:
    """The module's own parameters and buffers (not its children's), each once."""
    seen, out = set(), []
    for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
        if id(t) not in seen and t.device.type != "meta":
            seen.add(id(t))
            out.append(t)
    return out
