"""ray.util.collective on the gloo backend: a group of 4 actors declared by the driver
(create_collective_group) and another joined by the members themselves
(init_collective_group); allreduce, allgather, reducescatter, broadcast, reduce,
barrier, send/recv on torch tensors and numpy arrays."""

import numpy as np
import torch

import ray
import ray.util.collective as col
from ray.util.collective.types import ReduceOp

ray.init(num_cpus=4, namespace="collective")
print("gloo available", col.gloo_available(), "nccl available", col.nccl_available())


@ray.remote(num_cpus=1)
class Member:
    def __init__(self, rank):
        self.rank = rank

    def join(self, world_size, group_name):
        col.init_collective_group(world_size, self.rank, backend="gloo", group_name=group_name)
        return col.get_rank(group_name), col.get_collective_group_size(group_name)

    def collectives(self, group_name):
        out = {}
        # A declared group is joined by the first collective call (get_rank and
        # get_collective_group_size do not join: -1 before it).
        out["rank before joining"] = col.get_rank(group_name)
        t = torch.arange(4, dtype=torch.float32) + 10 * self.rank
        col.allreduce(t, group_name)
        out["allreduce sum"] = t.tolist()
        world = col.get_collective_group_size(group_name)
        out["rank, size"] = (col.get_rank(group_name), world)

        m = torch.tensor([float(self.rank)])
        col.allreduce(m, group_name, op=ReduceOp.MAX)
        out["allreduce max"] = m.tolist()

        a = np.full(3, self.rank + 1, dtype=np.int64)
        col.allreduce(a, group_name, op=ReduceOp.PRODUCT)
        out["allreduce product (numpy)"] = a.tolist()

        gathered = [torch.zeros(2) for _ in range(world)]
        col.allgather(gathered, torch.tensor([self.rank, self.rank * self.rank], dtype=torch.float32), group_name)
        out["allgather"] = [g.tolist() for g in gathered]

        scatter_in = [torch.full((2,), float(self.rank + i)) for i in range(world)]
        scatter_out = torch.zeros(2)
        col.reducescatter(scatter_out, scatter_in, group_name)
        out["reducescatter"] = scatter_out.tolist()

        b = torch.tensor([float(self.rank)] * 2)
        col.broadcast(b, src_rank=2, group_name=group_name)
        out["broadcast from 2"] = b.tolist()

        r = torch.tensor([float(self.rank + 1)])
        col.reduce(r, dst_rank=1, group_name=group_name)
        out["reduce to 1"] = r.tolist()

        col.barrier(group_name)

        # A ring: each rank sends to the next and receives from the previous.
        nxt, prev = (self.rank + 1) % world, (self.rank - 1) % world
        got = torch.zeros(1)
        if self.rank % 2 == 0:
            col.send(torch.tensor([100.0 + self.rank]), nxt, group_name)
            col.recv(got, prev, group_name)
        else:
            col.recv(got, prev, group_name)
            col.send(torch.tensor([100.0 + self.rank]), nxt, group_name)
        out["recv from previous"] = got.tolist()
        return out

    def errors(self, group_name):
        out = []
        for what, call in [
            ("send to self", lambda: col.send(torch.zeros(1), self.rank, group_name)),
            ("bad rank", lambda: col.broadcast(torch.zeros(1), 9, group_name)),
            ("not a tensor", lambda: col.allreduce([1, 2], group_name)),
            ("short allgather list", lambda: col.allgather([torch.zeros(1)], torch.zeros(1), group_name)),
            ("unknown group", lambda: col.allreduce(torch.zeros(1), "no-such-group")),
            ("init twice", lambda: col.init_collective_group(4, self.rank, "gloo", group_name)),
        ]:
            try:
                call()
                out.append(f"{what}: no error")
            except (RuntimeError, ValueError) as e:
                out.append(f"{what}: {type(e).__name__}")
        return out

    def leave(self, group_name):
        col.destroy_collective_group(group_name)
        return col.is_group_initialized(group_name), col.get_rank(group_name)


members = [Member.remote(rank) for rank in range(4)]

# Declared by the driver: each member joins at its first collective call.
col.create_collective_group(members, 4, [0, 1, 2, 3], backend="gloo", group_name="declared")
results = ray.get([m.collectives.remote("declared") for m in members])
for key in results[0]:
    print(key, [r[key] for r in results])

# Joined by the members themselves.
print("init", ray.get([m.join.remote(4, "joined") for m in members]))
results = ray.get([m.collectives.remote("joined") for m in members])
print("allreduce sum again", [r["allreduce sum"] for r in results])
print("errors", ray.get(members[0].errors.remote("joined")))
print("leave", ray.get([m.leave.remote("joined") for m in members]))

for what, call in [
    ("declare twice", lambda: col.create_collective_group(members, 4, [0, 1, 2, 3], backend="gloo", group_name="declared")),
    ("ranks not a permutation", lambda: col.create_collective_group(members, 4, [0, 1, 1, 3], backend="gloo", group_name="other")),
    ("rank per actor", lambda: col.create_collective_group(members, 4, [0, 1], backend="gloo", group_name="other")),
    ("nccl without CUDA", lambda: col.create_collective_group(members, 4, [0, 1, 2, 3], backend="nccl", group_name="other")),
    ("driver is no member", lambda: col.allreduce(torch.zeros(1), "declared")),
]:
    try:
        call()
        print(what, "no error")
    except (RuntimeError, ValueError) as e:
        print(what, type(e).__name__)


@ray.remote(num_cpus=0)
def nccl_in_a_task():
    try:
        col.init_collective_group(1, 0, backend="nccl", group_name="n")
    except (RuntimeError, ValueError) as e:
        return type(e).__name__


print("nccl init without CUDA", ray.get(nccl_in_a_task.remote()))
ray.shutdown()
