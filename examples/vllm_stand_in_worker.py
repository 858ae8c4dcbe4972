"""vLLM's worker extension that builds a block-FP8 model with the stand-in kernels of examples/vllm_fp8.py where
vLLM's CPU build has no FP8 kernel (no AMX), in an engine's own worker processes:

    LLM(model=FP8_DIR, ..., worker_extension_cls="vllm_stand_in_worker.StandInKernels")   # examples/ importable

vLLM imports the extension's module in every worker before it builds the model (`worker_extension_cls`, a
public engine argument), and importing this module makes vLLM's kernel selection fall back to the stand-ins
for the rest of the worker's life (`vllm_fp8.stand_in_kernels`, entered and never left: the kernels are chosen
while the model is built and kept by it). The extension adds no methods. Used by `python examples/vllm_refit.py
--faults` (a TP2 block-FP8 engine and its reference engines).
"""
import vllm_fp8

_STAND_INS = vllm_fp8.stand_in_kernels()
_STAND_INS.__enter__()


class StandInKernels:
    """The worker extension: its module's import is what it does."""
