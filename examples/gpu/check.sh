#!/usr/bin/env bash
# One prepared GPU check (a single-GPU machine is enough; multi-rank NCCL needs one GPU per rank):
# NVML discovery, bandwidths, the topology YAML, a plan with it, and a one-GPU CUDA copy sanity run.
# Usage: bash examples/gpu/check.sh [OUT_DIR]
set -euo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
reshard topo | tee "$out/topo.txt"
reshard topo --json "$out/topo.json" --yaml "$out/topology.yaml" > /dev/null
cat "$out/topology.yaml"
reshard topo --bandwidth --bandwidth-mb 1024 | tee "$out/bandwidth.txt"
reshard plan --src layouts/qwen3-30b-a3b/megatron-tp2-ep4-pp2.yaml --dst layouts/qwen3-30b-a3b/vllm-tp4-dp4.yaml \
  --topology "$out/topology.yaml" | tee "$out/plan.txt"
# the transport's CUDA path on one GPU: checksums of device tensors equal those of their CPU copies
python - <<'PY' | tee "$out/cuda.txt"
import torch
from reshard_cli.base.geometry import Box
from reshard_cli.transfer.verify import checksum
x = torch.randn(4096, 4096, device="cuda").to(torch.bfloat16)
print("cuda checksum equal to cpu:", checksum(x, Box.full(x.shape), tuple(x.shape)) == checksum(x.cpu(), Box.full(x.shape), tuple(x.shape)))
PY
# the watchdog on CUDA: a guarded wait polls events (a long kernel is named, not waited on blindly), and a
# fault aborts an NCCL communicator from the guard, returning control (examples/gpu/guard_check.py)
python examples/gpu/guard_check.py | tee "$out/guard.txt"
# the transport's set-up under the watchdog on NCCL: communicators made up front on the helper thread, polled;
# a set-up whose peer never comes (silent, or alive but never starting) named at 3 s (examples/gpu/connect_check.py)
python examples/gpu/connect_check.py | tee "$out/connect.txt"
# FP8 quantize-on-send on CUDA: bytes against the CPU's, GB/s against a device copy (examples/gpu/fp8_check.py)
python examples/gpu/fp8_check.py | tee "$out/fp8.txt"
