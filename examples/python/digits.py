"""Handwritten digits: a `tpuray.data` pipeline streamed into a trainer gang on a TPU slice.

The data set is the one that ships inside scikit-learn (`sklearn.datasets.load_digits`:
1,797 real 8x8 scans of handwritten digits, 16 grey levels, from the UCI "Optical
Recognition of Handwritten Digits" set). 20% is held out (stratified, seeded); the rest
is streamed for EPOCHS epochs through two `map_batches` stages that run as tasks on the
cluster:

1. `load_and_normalise`: each row id becomes (epoch, position) -> a scan of that epoch's
   seeded permutation, pixels scaled to 0..1;
2. `augment`: a random shift of up to one pixel and a little Gaussian noise, seeded by
   the batch's first row id so every run sees the same stream;

then `streaming_split(4)` hands the blocks to the four members of a gang on every host of
an intact v6e-16 slice (`tpuray.util.tpu.run_on_slice`; simulated hosts here, a TPU pod
unchanged). Each member sets up `torch.distributed` from the gang's environment
(`MASTER_ADDR`, `MASTER_PORT`, `NNODES`, `NODE_RANK` or `JOB_COMPLETION_INDEX`), picks
its device with `torch_device()`, and trains an MLP on its own stream; every step the
members sum their gradients and sample counts (gloo all-reduce on CPU) so they stay in
lock-step even when their streams differ in length. The driver saves the model to
`$TPURAY_EXAMPLE_DIR/digits.pt` (default `/tmp/tpuray-examples`), evaluates it on the
held-out scans, prints which nodes and slice hosts ran each stage, and exits 1 unless
the held-out accuracy is at least 0.9.

For a serving example, importing this module runs nothing: `DigitsNet`,
`load_digits_model(path)` and `predict_digits(model, pixels)` are at top level.

Usage: python examples/python/digits.py [HEAD_ADDRESS] [--seed N]
Needs: torch, numpy, scikit-learn (and the tpuray package).
"""

from __future__ import annotations

import os
import sys
import time

import torch

SEED = 0
EPOCHS = 12
BATCH_PER_MEMBER = 32
BLOCK_ROWS = 256
LR = 1e-2
TARGET_ACCURACY = 0.9
PIXELS = 64
MAX_PIXEL = 16.0
SHIFT_PROB = 0.25
NOISE = 0.03


class DigitsNet(torch.nn.Module):
    """An MLP classifier of 8x8 digit scans.

    Input: ``[batch, 64]`` float pixels scaled to 0..1 (raw 0..16 values divided by 16,
    row-major 8x8). Output: ``[batch, 10]`` logits for the digits 0..9.
    """

    def __init__(self, hidden: int = 128):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(PIXELS, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_digits_model(path: str) -> torch.nn.Module:
    """The ``DigitsNet`` saved by this example at ``path``, on CPU, in eval mode.

    Raises:
        FileNotFoundError: no file at ``path``.
        RuntimeError: the file is not a ``DigitsNet`` state dict.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    model = DigitsNet(hidden=int(state["layers.0.weight"].shape[0]))
    model.load_state_dict(state)
    return model.eval()


def predict_digits(model: torch.nn.Module, pixels: list) -> list:
    """The digit (0..9) of each scan.

    Args:
        model: from :func:`load_digits_model`.
        pixels: ``n`` scans of 64 raw grey levels each (0..16, row-major 8x8), as
            ``sklearn.datasets.load_digits().data`` has them.

    Returns:
        ``n`` ints.

    Raises:
        ValueError: not ``n x 64`` numbers, or a value outside 0..16.
    """
    x = torch.as_tensor(pixels, dtype=torch.float32)
    if x.dim() != 2 or x.shape[1] != PIXELS:
        raise ValueError(f"pixels must be n x {PIXELS} raw grey levels, got shape {tuple(x.shape)}")
    if x.numel() and (x.min() < 0 or x.max() > MAX_PIXEL or not torch.isfinite(x).all()):
        raise ValueError(f"pixel values must lie in 0..{MAX_PIXEL:g} (sklearn's digits), got "
                         f"{float(x.min()):g}..{float(x.max()):g}")
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(x.to(device) / MAX_PIXEL).argmax(-1).cpu().tolist()


def split_digits(seed: int = SEED):
    """``(train_index, test_index)`` of sklearn's digits: a stratified 80/20 split."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    y = load_digits().target
    return tuple(np.sort(i) for i in train_test_split(
        np.arange(len(y)), test_size=0.2, random_state=seed, stratify=y))


def load_and_normalise(batch: dict, train_index, seed: int) -> dict:
    """Stage 1 (a task): row ids -> scans of each epoch's seeded permutation, scaled to
    0..1. ``batch["id"]``: ``[rows]`` ints in ``0 .. epochs * len(train_index)``."""
    import numpy as np
    from sklearn.datasets import load_digits

    import tpuray as ray

    d = load_digits()
    n = len(train_index)
    epoch, pos = np.divmod(np.asarray(batch["id"]), n)
    idx = np.empty_like(pos)
    for e in np.unique(epoch):
        perm = np.random.default_rng([seed, int(e)]).permutation(train_index)
        idx[epoch == e] = perm[pos[epoch == e]]
    node = ray.get_runtime_context().get_node_id()[:8]
    return {"id": np.asarray(batch["id"]), "pixels": (d.data[idx] / MAX_PIXEL).astype(np.float32),
            "label": d.target[idx].astype(np.int64), "load_node": np.full(len(idx), node)}


def augment(batch: dict, seed: int, shift_prob: float = SHIFT_PROB, noise: float = NOISE) -> dict:
    """Stage 2 (a task): with probability ``shift_prob`` shift a scan by one pixel in a
    random direction (zero fill), then add Gaussian noise of sd ``noise`` (on the 0..1
    scale), clipped to 0..1; seeded by the batch's first row id."""
    import numpy as np

    import tpuray as ray

    ids = np.asarray(batch["id"])
    rng = np.random.default_rng([seed, int(ids[0]) if len(ids) else 0])
    imgs = np.asarray(batch["pixels"]).reshape(-1, 8, 8)
    out = np.zeros_like(imgs)
    shifts = rng.integers(-1, 2, size=(len(imgs), 2))
    shifts[rng.random(len(imgs)) >= shift_prob] = 0
    for i, (dy, dx) in enumerate(shifts):
        src = imgs[i, max(0, -dy):8 - max(0, dy), max(0, -dx):8 - max(0, dx)]
        out[i, max(0, dy):max(0, dy) + src.shape[0], max(0, dx):max(0, dx) + src.shape[1]] = src
    out = np.clip(out + rng.normal(0.0, noise, out.shape).astype(np.float32), 0.0, 1.0)
    node = ray.get_runtime_context().get_node_id()[:8]
    return {**batch, "pixels": out.reshape(-1, PIXELS), "augment_node": np.full(len(ids), node)}


def train_member(iterators: list, batch_size: int, lr: float, seed: int) -> dict:
    """One gang member: trains on its stream, gradients summed over the gang every step.
    Returns this member's facts and, on rank 0, the trained state dict."""
    import socket

    import torch.distributed as dist

    import tpuray as ray
    from tpuray.util import tpu

    device = tpu.torch_device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # simulated hosts share one machine's cores
    rank = int(os.environ.get("NODE_RANK", os.environ.get("JOB_COMPLETION_INDEX", "0")))
    world = int(os.environ["NNODES"])
    init = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(seed)  # the same initial weights on every member
        model = DigitsNet().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        params = list(model.parameters())
        batches = iter(iterators[rank].iter_batches(batch_size=batch_size))
        seen, steps, rows, load_nodes, aug_nodes = 0, 0, 0, set(), set()
        t0, first_loss, last_loss = time.time(), None, None
        while True:
            batch = next(batches, None)
            opt.zero_grad()
            if batch is not None:
                x = torch.tensor(batch["pixels"], device=device)  # a copy: blocks are read-only
                y = torch.tensor(batch["label"], device=device)
                loss = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
                loss.backward()
                loss = loss.item()
                rows += len(y)
                load_nodes.update(map(str, batch["load_node"]))
                aug_nodes.update(map(str, batch["augment_node"]))
            # One all-reduce of every gradient plus this member's sample count and loss.
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                              .reshape(-1).cpu() for p in params]
                             + [torch.tensor([float(len(y)) if batch is not None else 0.0,
                                              loss if batch is not None else 0.0])])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            count, total_loss = float(flat[-2]), float(flat[-1])
            if count == 0:
                break  # every member's stream is done
            off = 0
            for p in params:
                g = flat[off:off + p.numel()].view_as(p) / count
                p.grad = g.to(device)
                off += p.numel()
            opt.step()
            steps += 1
            seen += int(count)
            last_loss = total_loss / count
            first_loss = last_loss if first_loss is None else first_loss
        checksum = float(sum(p.detach().double().sum().item() for p in params))
        facts = {
            "rank": rank, "world": world, "host": socket.gethostname(),
            "slice": os.environ.get("TPU_NAME"), "worker_id": os.environ.get("TPU_WORKER_ID"),
            "node": ray.get_runtime_context().get_node_id()[:8], "device": device.type,
            "rows": rows, "steps": steps, "gang_rows": seen, "first_loss": first_loss,
            "last_loss": last_loss, "seconds": time.time() - t0, "checksum": checksum,
            "load_nodes": sorted(load_nodes), "augment_nodes": sorted(aug_nodes),
        }
        if rank == 0:
            facts["state"] = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        return facts
    finally:
        dist.destroy_process_group()


def node_names() -> dict:
    """Short node id -> ``"<id> (slice sa host 2)"`` or ``"<id> (cpu)"``, from the node
    table's TPU labels."""
    import tpuray as ray

    out = {}
    for n in ray.nodes():
        lab = n.get("Labels") or {}
        short = n["NodeID"][:8]
        sl = lab.get("tpuray.io/tpu-slice-name")
        out[short] = (f"{short} (slice {sl} host {lab.get('tpuray.io/tpu-worker-id')})" if sl
                      else f"{short} (cpu)")
    return out


def main() -> int:
    import numpy as np
    from sklearn.datasets import load_digits

    import tpuray as ray
    import tpuray.data as rd
    from tpuray.util import tpu

    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("address", nargs="?", default=None)
    ap.add_argument("--seed", type=int, default=SEED,
                    help="seeds the split, the epoch order, the augmentation and the weights")
    args = ap.parse_args()
    seed = args.seed
    started = time.time()
    torch.manual_seed(seed)
    np.random.seed(seed)
    out_dir = os.environ.get("TPURAY_EXAMPLE_DIR", "/tmp/tpuray-examples")
    os.makedirs(out_dir, exist_ok=True)
    ray.init(args.address)
    train_index, test_index = split_digits(seed)
    n = len(train_index)
    print(f"digits: {n + len(test_index)} scans from sklearn, {n} to train on for {EPOCHS} epochs, "
          f"{len(test_index)} held out")

    ds = (rd.range(EPOCHS * n, override_num_blocks=-(-EPOCHS * n // BLOCK_ROWS))
          .map_batches(load_and_normalise, batch_size=None,
                       fn_kwargs={"train_index": train_index, "seed": seed})
          .map_batches(augment, batch_size=None, fn_kwargs={"seed": seed}))
    train = ray.remote(train_member)
    tpu_slice = tpu.slice_placement_group("4x4", "v6e")  # every host of one intact v6e-16
    try:
        if not tpu_slice.placement_group.wait(300):
            raise RuntimeError("no intact v6e-16 slice (TPU 4x4) was free within 300s")
        splits = ds.streaming_split(tpu_slice.num_hosts)
        refs = tpu.run_on_slice(train, splits, BATCH_PER_MEMBER, LR, seed, tpu_slice=tpu_slice,
                                name="digits-trainer")
        members = ray.get(refs, timeout=900)
    finally:
        tpu_slice.shutdown()
    members.sort(key=lambda m: m["rank"])
    state = members[0].pop("state")
    path = os.path.join(out_dir, "digits.pt")
    torch.save(state, path)

    loaded = load_digits_model(path)
    d = load_digits()
    pred = np.asarray(predict_digits(loaded, d.data[test_index].tolist()))
    accuracy = float((pred == d.target[test_index]).mean())
    driver_node = ray.get_runtime_context().get_node_id()[:8]

    names = node_names()
    load_nodes = sorted({x for m in members for x in m["load_nodes"]})
    aug_nodes = sorted({x for m in members for x in m["augment_nodes"]})
    print(f"stage load_and_normalise (tasks) ran on nodes {', '.join(names.get(x, x) for x in load_nodes)}")
    print(f"stage augment (tasks) ran on nodes {', '.join(names.get(x, x) for x in aug_nodes)}")
    for m in members:
        print(f"stage train: rank {m['rank']}/{m['world']} on slice {m['slice']} host {m['worker_id']} "
              f"(node {m['node']}, device {m['device']}): {m['rows']} rows in {m['steps']} steps, "
              f"loss {m['first_loss']:.3f} -> {m['last_loss']:.3f}, {m['seconds']:.1f}s")
    print(f"stage evaluate: driver on node {driver_node}, model loaded from {path}")
    print(f"held-out accuracy: {accuracy:.4f} on {len(test_index)} scans "
          f"(target >= {TARGET_ACCURACY}); total {time.time() - started:.1f}s")
    ray.shutdown()

    ok = True
    if len({round(m["checksum"], 4) for m in members}) != 1:
        print("FAIL: members ended with different weights", file=sys.stderr)
        ok = False
    if sum(m["rows"] for m in members) != EPOCHS * n:
        print(f"FAIL: the gang saw {sum(m['rows'] for m in members)} rows, not {EPOCHS * n}",
              file=sys.stderr)
        ok = False
    if accuracy < TARGET_ACCURACY:
        print(f"FAIL: held-out accuracy {accuracy:.4f} < {TARGET_ACCURACY}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
