"""Live refit: trainer processes train a tiny tensor-parallel MLP and, after every optimizer step, refit
its weights into inference processes that hold them in another layout. Both sides then run the same input
and the outputs must be equal, bit for bit.

    python examples/live_refit.py            # starts 4 CPU processes (torchrun) itself
    torchrun --nproc-per-node 4 examples/live_refit.py

Ranks 0-1: trainer, TP2 DTensors (w1 column-parallel = Shard(0), w2 row-parallel = Shard(1)).
Ranks 2-3: inference, two data-parallel replicas holding plain full tensors; their layout is given as DTensors
with Replicate placements, so no YAML is needed on either side.
"""
import os
import subprocess
import sys

import torch
import torch.distributed as dist

HIDDEN, FFN, STEPS = 64, 256, 5


def main() -> int:
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reshard_cli.transfer.live import Refit

    rank = dist.get_rank()
    train_mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("tp",))  # every rank creates both meshes
    infer_mesh = DeviceMesh("cpu", [2, 3], mesh_dim_names=("dp",))
    torch.manual_seed(0)
    full_w1, full_w2 = torch.randn(FFN, HIDDEN) * 0.1, torch.randn(HIDDEN, FFN) * 0.1
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(2))

    if rank < 2:  # trainer: DTensor parameters, autograd and SGD on the shards
        w1 = torch.nn.Parameter(distribute_tensor(full_w1, train_mesh, [Shard(0)]))
        w2 = torch.nn.Parameter(distribute_tensor(full_w2, train_mesh, [Shard(1)]))
        opt = torch.optim.SGD([w1, w2], lr=0.5)
        refit = Refit(role="src")
        params = {"mlp.up_proj.weight": w1, "mlp.down_proj.weight": w2}
    else:  # inference: plain full tensors (two replicas); the layout comes from DTensor views of them
        w1 = torch.zeros(FFN, HIDDEN)
        w2 = torch.zeros(HIDDEN, FFN)
        refit = Refit(role="dst")
        params = {"mlp.up_proj.weight": _replicated(w1, infer_mesh), "mlp.down_proj.weight": _replicated(w2, infer_mesh)}
    ptrs = (w1.data_ptr(), w2.data_ptr())
    worst = 0.0
    for step in range(STEPS):
        if rank < 2:
            xd = distribute_tensor(x, train_mesh, [Replicate()])
            out = torch.relu(xd @ w1.T) @ w2.T
            loss = ((out - distribute_tensor(target, train_mesh, [Replicate()])) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        stats = refit(params, verify_checksums=True)
        with torch.no_grad():  # both sides: the same plain forward of the updated weights on the same input
            # (the trainer's weights gathered once for the comparison: a TP2 forward sums its partial products
            # in another order, which may differ in the last bit from the one-device forward)
            u1, u2 = (w1.full_tensor(), w2.full_tensor()) if rank < 2 else (w1, w2)
            y = torch.relu(x @ u1.T) @ u2.T
        outs = [None] * dist.get_world_size()
        dist.all_gather_object(outs, y)
        diff = max(float((outs[r] - outs[0]).abs().max()) for r in (2, 3))
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step}: loss {float(loss.detach().full_tensor()):.5f}  refit {stats.seconds * 1e3:.1f} ms  "
                  f"checksums {'ok' if stats.checksums_ok else 'WRONG'}  max |trainer - inference| = {diff:.3g}")
    if rank >= 2:
        assert (w1.data_ptr(), w2.data_ptr()) == ptrs, "inference buffers must be written in place"
    dist.destroy_process_group()
    if rank == 0:
        print("outputs equal after every refit" if worst == 0.0 else f"MISMATCH {worst}")
    return 0 if worst == 0.0 else 1


def _replicated(local: torch.Tensor, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(local, mesh, [Replicate()], run_check=False)


if __name__ == "__main__":
    if "RANK" not in os.environ:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        sys.exit(subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "4", __file__], env=env))
    sys.exit(main())
