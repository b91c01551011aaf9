"""Data-parallel PyTorch training over every host of a TPU slice (run by scripts/demo.sh).

`tpuray.util.tpu.run_on_slice` starts one process per host of a v6e-16 slice (4 hosts; on
this machine they are simulated hosts, on a TPU pod the same script runs unchanged). Each
member sets up `torch.distributed` only from the environment the gang received
(`MASTER_ADDR`, `MASTER_PORT`, `NNODES`, and its rank from `NODE_RANK`, or
`JOB_COMPLETION_INDEX` on hosts with real TPU devices where TorchTPU derives `NODE_RANK`
itself), picks its device with `torch_device()` (`tpu` when `torch_tpu` imports, else
`cuda`, else `cpu`), trains a small MLP on its shard of a synthetic regression problem,
and all-reduces gradients every step (gloo on CPU). The driver checks that every member
ends with identical weights (the all-reduce worked) and a lower loss.

Usage: python examples/python/torch_ddp.py [HEAD_ADDRESS]
"""

import sys

import tpuray as ray
from tpuray.util import tpu

STEPS = 60


@ray.remote
def train(steps: int):
    import os
    import socket

    import torch
    import torch.distributed as dist

    device = tpu.torch_device()
    rank = int(os.environ.get("NODE_RANK", os.environ["JOB_COMPLETION_INDEX"]))
    world = int(os.environ["NNODES"])
    init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    # gloo all-reduces CPU tensors; NCCL would serve CUDA, TorchTPU its own backend.
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same initial weights on every rank
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        ).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        # This rank's shard of y = sum(w * x) + noise.
        g = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(512, 8, generator=g)
        w = torch.linspace(-1.0, 1.0, 8)
        y = (x @ w).unsqueeze(1) + 0.01 * torch.randn(512, 1, generator=g)
        x, y = x.to(device), y.to(device)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():
                grad = p.grad.detach().cpu() if backend == "gloo" else p.grad
                dist.all_reduce(grad, op=dist.ReduceOp.SUM)
                p.grad.copy_(grad / world)
            opt.step()
            losses.append(loss.item())
        checksum = float(sum(p.detach().double().sum().item() for p in model.parameters()))
        return {
            "rank": rank,
            "world": world,
            "host": socket.gethostname(),
            "slice": os.environ.get("TPU_NAME"),
            "worker_id": int(os.environ["TPU_WORKER_ID"]),
            "node": ray.get_runtime_context().get_node_id()[:8],
            "device": device.type,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "checksum": checksum,
        }
    finally:
        dist.destroy_process_group()


def main():
    ray.init(sys.argv[1] if len(sys.argv) > 1 else None)
    refs = tpu.run_on_slice(train, STEPS, topology="4x4", accelerator_version="v6e")
    results = ray.get(refs, timeout=600)
    for r in results:
        print(
            f"rank {r['rank']}/{r['world']} on slice {r['slice']} host {r['worker_id']} "
            f"(node {r['node']}, device {r['device']}): loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}"
        )
    checksums = {round(r["checksum"], 6) for r in results}
    assert len(results) == 4, results
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert len({r["node"] for r in results}) == 4, "one member per host"
    assert len(checksums) == 1, f"members diverged: {checksums}"
    assert all(r["last_loss"] < r["first_loss"] * 0.5 for r in results), results
    print(f"data-parallel training over {len(results)} hosts: identical weights on every rank")
    ray.shutdown()


if __name__ == "__main__":
    main()
