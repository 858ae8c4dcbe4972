"""The full-tensor path (`path: full` in the init info): the baseline vLLM's own backends implement, kept to be
measured against. The trainer's rank holding a whole tensor (or rank 0 after gathering a DTensor) sends it to
every worker, which loads it with vLLM's `load_weights` under layerwise reload."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from reshard_cli.engines.vllm import compat
from reshard_cli.errors import ConfigError


FULL_UPDATE = SimpleNamespace(label="the full-tensor update (loaded in place, layer by layer)")


def tear(failure, dst) -> None:
    """A failed full-path update, as what it may have left: one group that every worker may hold part of
    (vLLM's layerwise reload writes each layer in place as it arrives), so each engine's label says it may
    hold a mix of both steps, never the old step alone."""
    failure.groups, failure.committed, failure.torn = [FULL_UPDATE], [], set(dst.ranks)
    failure.held = {r: 0 for r in dst.ranks}


def full_senders(src, manifest) -> list[int]:
    """Per tensor of `manifest`, the refit rank that sends it whole on the full path: the first trainer rank
    holding the whole tensor, else rank 0 after gathering it (then every trainer rank holds a DTensor)."""
    if src is None:
        return [0] * len(manifest.tensors)
    whole: dict[str, int] = {}
    for r in src.ranks:
        for t, box in src.held(r):
            spec = src.manifest.tensors[t]
            if tuple(box.sizes) == tuple(spec.shape):
                whole.setdefault(spec.name, r)
    return [whole.get(t.name, 0) for t in manifest.tensors]


def send_full(comm, tensors: Mapping[str, torch.Tensor], src, dst, rank: int) -> int:
    """The trainer side: every full tensor, from its sender to every worker, in the engine's manifest order
    (DTensors are gathered over the trainer's own group first). Returns the bytes this rank sent. A failure
    (the refit group gave up, a tensor this rank should send is missing) stops this rank's sends, not its part
    of the gathers: every trainer rank gathers every DTensor, so their own group stays in step; it is raised
    once the last gather is done."""
    from torch.distributed.tensor import DTensor

    sent, failure = 0, None
    for spec, sender in zip(dst.manifest.tensors, full_senders(src, dst.manifest)):
        x = tensors.get(spec.name)
        if isinstance(x, DTensor):
            x = x.full_tensor()  # collective over the trainer's group, on every trainer rank
        if rank != sender or failure is not None:
            continue
        try:
            if x is None or tuple(x.shape) != tuple(spec.shape):
                raise ConfigError(f"the full path needs {spec.name} whole on trainer rank {rank} or as a DTensor",
                                  key=spec.name)
            x = x.detach().contiguous()
            for w in dst.ranks:
                comm.isend(x, w).wait()
                sent += x.numel() * x.element_size()
        except Exception as e:  # noqa: BLE001 - raised after the gathers (above)
            failure = e
    if failure is not None:
        raise failure
    return sent


def receive_full(comm, src, dst, model, device) -> int:
    """The worker side: receive every full tensor and hand it to vLLM's `load_weights`."""
    got = 0
    for spec, sender in zip(dst.manifest.tensors, full_senders(src, dst.manifest)):
        buf = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
        comm.irecv(buf, sender).wait()
        got += buf.numel() * buf.element_size()
        compat.load_weights(model, spec.name, buf)
    return got
