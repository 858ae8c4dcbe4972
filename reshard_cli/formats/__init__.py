"""Engine and trainer storage formats: how a framework keeps a checkpoint's tensors.

A layout's `format:` (default `hf`: the checkpoint's own names and shapes) names one of these. A format maps
the framework's real storage to views of checkpoint tensors, so plans stay in checkpoint space while the
bytes land straight in the framework's own tensors.
"""
from __future__ import annotations

FORMATS = ("hf", "vllm", "megatron")


def engine_summary(layout) -> dict:
    """A framework's storage on one rank of `layout` (see the format's `summary`)."""
    from reshard_cli.formats import megatron, vllm

    return {"vllm": vllm.summary, "megatron": megatron.summary}[layout.format](layout)
