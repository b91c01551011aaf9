"""GRPO on verifiable arithmetic: a trainer gang on one TPU slice, samplers on another.

A small decoder-only transformer (2 layers, d_model 64, a 14-token vocabulary of digits,
``+``, ``=``, an end mark ``$`` and padding) learns to answer prompts ``"a+b="`` (a, b in
0..9) with the sum followed by ``$``. The reward is verifiable: 1 when the completion up
to ``$`` parses to a + b, else 0.

1. Warm-up (supervised, on the trainer gang): next-token training on correct answers,
   stopped as soon as the greedy accuracy over the 100 facts reaches WARMUP_STOP (0.3),
   so the policy knows the format but is far from the target; the warm-up policy is kept
   as the KL reference.
2. GRPO (Shao et al. 2024, DeepSeekMath, https://arxiv.org/abs/2402.03300), STEPS steps:
   the samplers pull the policy version ``v`` from the object store (``tpuray.rl.
   WeightStore``: one shard per trainer member, pulled by version), sample G completions
   for each of PROMPTS prompts and score them; the driver computes group-relative
   advantages (``tpuray.rl.group_advantages``); the trainer members each take a share of
   the groups, run UPDATE_EPOCHS epochs of the clipped objective with a KL term
   (``tpuray.rl.grpo_loss``), summing gradients over the gang (gloo all-reduce), and
   publish version ``v + 1``, one shard per member.

Trainer and samplers are ``tpuray.rl.WorkerGroup``s on two separate v6e-16 slices (4
simulated hosts each here; a TPU pod runs the same script): every member has its host's
chips, so the two pools never share chips, and if the cluster cannot hold both the
script fails at once naming the missing slice. ``--cpu-pools`` puts both pools on CPU
groups instead (2 workers each).

Prints the mean reward per step with the step time split into generate / reward / update
/ weight sync, where each stage ran, and the greedy accuracy before and after. Saves the
policy to ``$TPURAY_EXAMPLE_DIR/grpo_policy.pt`` (default ``/tmp/tpuray-examples``); a
serving example imports ``load_policy(path)`` and ``answer(policy, prompt)`` from here
without running anything. Exits 1 unless the mean reward of the last five steps is at
least 0.5 and at least 0.2 above the first GRPO step's.

Usage: python examples/python/grpo.py [HEAD_ADDRESS] [--seed N] [--cpu-pools]
Needs: torch, numpy (and the tpuray package).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

VOCAB = list("0123456789+=$")
EOS = VOCAB.index("$")
PAD = len(VOCAB)
VOCAB_SIZE = len(VOCAB) + 1
STOI = {c: i for i, c in enumerate(VOCAB)}
CONTEXT = 16
MAX_NEW = 3  # two answer digits and "$"
MAX_OPERAND = 9

SEED = 0
WARMUP_STOP = 0.3
WARMUP_MAX_STEPS = 2000
WARMUP_BATCH = 32  # per trainer member
STEPS = 80
PROMPTS = 32  # per step
GROUP = 8  # completions per prompt (G)
UPDATE_EPOCHS = 4
LR = 2e-3
CLIP_EPS = 0.2
KL_COEF = 0.02


class Policy(torch.nn.Module):
    """A causal transformer over ``VOCAB``: ``[batch, tokens]`` token ids (at most
    ``CONTEXT``) -> ``[batch, tokens, VOCAB_SIZE]`` next-token logits."""

    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4, context: int = CONTEXT):
        super().__init__()
        self.config = {"d_model": d_model, "layers": layers, "heads": heads, "context": context}
        self.tok = torch.nn.Embedding(VOCAB_SIZE, d_model)
        self.pos = torch.nn.Embedding(context, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        causal = torch.triu(torch.full((t, t), float("-inf"), device=x.device), 1)
        return self.head(self.norm(self.blocks(h, mask=causal)))


def encode(text: str) -> list:
    """Token ids of ``text``.

    Raises:
        ValueError: a character outside ``VOCAB``.
    """
    bad = sorted({c for c in text if c not in STOI})
    if bad:
        raise ValueError(f"characters {bad} are not in the vocabulary {''.join(VOCAB)!r}")
    return [STOI[c] for c in text]


def decode(ids) -> str:
    """The completion text of ``ids`` up to (without) the end mark; padding dropped."""
    out = []
    for i in ids:
        i = int(i)
        if i == EOS:
            break
        if i != PAD:
            out.append(VOCAB[i])
    return "".join(out)


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def reward(a: int, b: int, completion_ids) -> float:
    """1.0 when the completion ends with ``$`` and what precedes it parses to ``a + b``."""
    ids = [int(i) for i in completion_ids]
    if EOS not in ids:
        return 0.0
    text = decode(ids)
    return 1.0 if text.isdigit() and int(text) == a + b else 0.0


def all_facts() -> list:
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]


@torch.no_grad()
def generate(policy: Policy, prompts: list, n: int, *, greedy: bool = False, generator=None):
    """``n`` completions of each prompt (``(a, b)`` pairs), sampled at temperature 1 (or
    greedy): ``[len(prompts) * n, prompt + MAX_NEW]`` token ids, completions padded after
    ``$``, and the prompt length."""
    device = next(policy.parameters()).device
    x = torch.tensor([encode(prompt_text(a, b)) for a, b in prompts for _ in range(n)],
                     device=device)
    p = x.shape[1]
    done = torch.zeros(len(x), dtype=torch.bool, device=device)
    for _ in range(MAX_NEW):
        logits = policy(x)[:, -1]
        if greedy:
            t = logits.argmax(-1)
        else:
            probs = F.softmax(logits.float(), -1).cpu()
            t = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
        t = torch.where(done, torch.full_like(t, PAD), t)
        done |= t == EOS
        x = torch.cat([x, t[:, None]], 1)
    return x, p


def completion_logp(policy: Policy, x: torch.Tensor, p: int):
    """``(logp, mask)``: ``[batch, MAX_NEW]`` log-probabilities of the completion tokens of
    ``x`` under ``policy`` and 1 where the token is not padding."""
    logits = policy(x[:, :-1])
    lp = F.log_softmax(logits.float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
    return lp[:, p - 1:], (x[:, p:] != PAD).float()


def greedy_accuracy(policy: Policy) -> float:
    facts = all_facts()
    x, p = generate(policy, facts, 1, greedy=True)
    return sum(reward(a, b, row[p:].tolist()) for (a, b), row in zip(facts, x)) / len(facts)


def load_policy(path: str) -> Policy:
    """The policy this example saved at ``path`` (CPU, eval mode).

    Raises:
        FileNotFoundError: no file at ``path``.
        KeyError, RuntimeError: not a file this example wrote.
    """
    saved = torch.load(path, map_location="cpu", weights_only=True)
    policy = Policy(**saved["config"])
    policy.load_state_dict(saved["state"])
    return policy.eval()


def answer(policy: Policy, prompt: str) -> str:
    """The greedy completion of ``prompt`` (e.g. ``"3+4="`` -> ``"7"``), without the end
    mark; at most ``MAX_NEW`` tokens.

    Raises:
        ValueError: an empty prompt, one with characters outside ``VOCAB``, or one too long
            for the policy's context.
    """
    ids = encode(prompt)
    ctx = policy.config["context"]
    if not ids or len(ids) + MAX_NEW > ctx:
        raise ValueError(f"prompt must have 1..{ctx - MAX_NEW} characters, got {len(ids)}")
    device = next(policy.parameters()).device
    x = torch.tensor([ids], device=device)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            t = policy(x)[:, -1].argmax(-1)
            x = torch.cat([x, t[:, None]], 1)
            if int(t) == EOS:
                break
    return decode(x[0, len(ids):].tolist())


def _where() -> dict:
    import tpuray as ray

    return {"node": ray.get_runtime_context().get_node_id()[:8],
            "slice": os.environ.get("TPU_NAME"), "worker_id": os.environ.get("TPU_WORKER_ID"),
            "rank": int(os.environ.get("NODE_RANK", os.environ.get("JOB_COMPLETION_INDEX", "0")))}


class Trainer:
    """One member of the trainer gang: a full copy of the policy, gradients summed over the
    gang with ``torch.distributed`` (gloo) set up from the gang's environment."""

    def __init__(self, seed: int, store_name: str):
        import torch.distributed as dist

        from tpuray.util.tpu import torch_device

        self.device = torch_device()
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # simulated hosts share one machine's cores
        self.rank = int(os.environ.get("NODE_RANK", os.environ.get("JOB_COMPLETION_INDEX", "0")))
        self.world = int(os.environ["NNODES"])
        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                rank=self.rank, world_size=self.world)
        self.dist = dist
        self.seed = seed
        self.store_name = store_name
        self.store = None  # opened on first use
        torch.manual_seed(seed)  # the same initial weights on every member
        self.policy = Policy().to(self.device)
        self.reference = None
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=LR)

    def where(self) -> dict:
        return {**_where(), "device": self.device.type}

    def _sum_gradients(self, extra=()) -> list:
        """All-reduces (sums) every gradient and the floats ``extra`` in one message."""
        params = list(self.policy.parameters())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach()
                          .reshape(-1).cpu() for p in params] + [torch.tensor(list(extra), dtype=torch.float32)])
        self.dist.all_reduce(flat, op=self.dist.ReduceOp.SUM)
        off = 0
        for p in params:
            p.grad = flat[off:off + p.numel()].view_as(p).to(self.device)
            off += p.numel()
        return flat[off:].tolist()

    def warmup(self, stop_at: float, max_steps: int, batch: int) -> dict:
        """Supervised next-token training on correct answers until the greedy accuracy over
        all facts reaches ``stop_at`` (checked every 10 steps); keeps the result as the KL
        reference."""
        import copy

        import numpy as np

        facts = all_facts()
        t0, steps, acc = time.time(), 0, greedy_accuracy(self.policy)
        while acc < stop_at and steps < max_steps:
            rng = np.random.default_rng([self.seed, self.rank, steps])
            pick = [facts[i] for i in rng.integers(0, len(facts), batch)]
            rows = [encode(prompt_text(a, b) + str(a + b) + "$") for a, b in pick]
            width = max(map(len, rows))
            x = torch.tensor([r + [PAD] * (width - len(r)) for r in rows], device=self.device)
            target = x[:, 1:].clone()
            prompt_len = torch.tensor([len(prompt_text(a, b)) for a, b in pick], device=self.device)
            target[torch.arange(target.shape[1], device=self.device)[None] < prompt_len[:, None] - 1] = -100
            target[target == PAD] = -100
            loss = F.cross_entropy(self.policy(x[:, :-1]).reshape(-1, VOCAB_SIZE), target.reshape(-1),
                                   ignore_index=-100)
            self.opt.zero_grad()
            (loss / self.world).backward()
            self._sum_gradients()
            self.opt.step()
            steps += 1
            if steps % 10 == 0:
                acc = greedy_accuracy(self.policy)
        self.reference = copy.deepcopy(self.policy).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=LR)  # fresh moments for RL
        return {"steps": steps, "accuracy": acc, "seconds": time.time() - t0}

    def update(self, tokens, advantages, prompt_len: int, total_tokens: float) -> dict:
        """UPDATE_EPOCHS epochs of the GRPO objective on this member's share of the batch.

        Args:
            tokens: ``[n, prompt_len + MAX_NEW]`` int token ids (prompt, then completion).
            advantages: ``[n]`` group-relative advantages.
            total_tokens: completion tokens in the whole batch (all members), so the summed
                gradient is the gradient of the whole batch's mean loss.
        """
        from tpuray.rl import grpo_loss

        t0 = time.time()
        x = torch.tensor(tokens, device=self.device)
        adv = torch.tensor(advantages, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            old, mask = completion_logp(self.policy, x, prompt_len)
            ref, _ = completion_logp(self.reference, x, prompt_len)
        losses = []
        for _ in range(UPDATE_EPOCHS):
            logp, _ = completion_logp(self.policy, x, prompt_len)
            loss = grpo_loss(logp, old, adv, mask, clip_eps=CLIP_EPS, kl_coef=KL_COEF,
                             logp_ref=ref, num_tokens=total_tokens)
            self.opt.zero_grad()
            loss.backward()
            (total,) = self._sum_gradients([loss.item()])
            self.opt.step()
            losses.append(total)
        return {"seconds": time.time() - t0, "loss": losses[0]}

    def publish(self, version: int) -> float:
        """Publishes this member's shard of the state dict (every ``world``-th tensor) as
        ``version``; returns the seconds it took."""
        from tpuray.rl import WeightStore

        t0 = time.time()
        state = self.policy.state_dict()
        shard = {k: v.detach().cpu().numpy() for i, (k, v) in enumerate(state.items())
                 if i % self.world == self.rank}
        if self.store is None:
            self.store = WeightStore(self.store_name)
        self.store.publish_shard("policy", version, self.rank, self.world, shard)
        return time.time() - t0

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum().item() for p in self.policy.parameters()))

    def state(self) -> dict:
        return {"config": self.policy.config,
                "state": {k: v.detach().cpu() for k, v in self.policy.state_dict().items()}}

    def shutdown(self) -> None:
        self.dist.destroy_process_group()


class Sampler:
    """One member of the sampler gang: pulls the policy by version, samples and scores."""

    def __init__(self, seed: int, store_name: str):
        from tpuray.util.tpu import torch_device

        self.device = torch_device()
        if self.device.type == "cpu":
            torch.set_num_threads(1)
        self.seed = seed
        self.store_name = store_name
        self.store = None  # opened on first use
        self.policy = Policy().to(self.device).eval()
        self.version = None

    def where(self) -> dict:
        return {**_where(), "device": self.device.type}

    def rollout(self, version: int, prompts: list, group: int, step: int) -> dict:
        """``group`` completions of each prompt under policy ``version`` and their rewards."""
        import numpy as np

        from tpuray.rl import WeightStore

        t0 = time.time()
        if version != self.version:
            if self.store is None:
                self.store = WeightStore(self.store_name)
            v, shards = self.store.fetch("policy", version, wait=120)
            state = {k: torch.as_tensor(np.array(a)) for s in shards for k, a in s.items()}
            self.policy.load_state_dict(state)
            self.version = v
        t1 = time.time()
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 101 + int(os.environ.get("NODE_RANK", "0")))
        x, p = generate(self.policy, prompts, group, generator=gen)
        t2 = time.time()
        pairs = [pr for pr in prompts for _ in range(group)]
        rewards = [reward(a, b, row[p:].tolist()) for (a, b), row in zip(pairs, x)]
        t3 = time.time()
        return {"tokens": x.cpu().numpy(), "prompt_len": p, "rewards": np.asarray(rewards),
                "sync": t1 - t0, "generate": t2 - t1, "reward": t3 - t2}


def main() -> int:
    import argparse

    import numpy as np

    import tpuray as ray
    from tpuray.rl import PoolUnsatisfiableError, WeightStore, WorkerGroup, group_advantages

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("address", nargs="?", default=None)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--cpu-pools", action="store_true",
                    help="trainer and samplers on CPU groups (2 workers each) instead of slices")
    args = ap.parse_args()
    started = time.time()
    seed = args.seed
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    out_dir = os.environ.get("TPURAY_EXAMPLE_DIR", "/tmp/tpuray-examples")
    os.makedirs(out_dir, exist_ok=True)
    ray.init(args.address)
    store_name = f"grpo-weights-{os.getpid()}"
    store = WeightStore(store_name, keep=2)
    pool = (dict(num_workers=2, num_cpus=1) if args.cpu_pools
            else dict(topology="4x4", accelerator_version="v6e"))
    trainer = samplers = None
    try:
        trainer = WorkerGroup(ray.remote(Trainer), seed, store_name, name="trainer", **pool)
        samplers = WorkerGroup(ray.remote(Sampler), seed, store_name, name="sampler", **pool)
    except PoolUnsatisfiableError as e:
        print(f"grpo: {e}", file=sys.stderr)
        for g in (trainer, samplers):
            if g is not None:
                g.shutdown()
        store.destroy()
        return 1
    names = _node_names()
    for label, g in (("trainer", trainer), ("sampler", samplers)):
        for w in g.call("where"):
            host = f"slice {w['slice']} host {w['worker_id']}" if w["slice"] else "a CPU group"
            print(f"{label} rank {w['rank']}: {host} (node {w['node']}, device {w['device']})")
    try:
        warm = trainer.call("warmup", WARMUP_STOP, WARMUP_MAX_STEPS, WARMUP_BATCH)[0]
        print(f"warm-up: {warm['steps']} supervised steps on the trainer gang, greedy accuracy "
              f"{warm['accuracy']:.2f} (stops at {WARMUP_STOP}), {warm['seconds']:.1f}s")
        version = 0
        trainer.call("publish", version)
        facts = all_facts()
        history = []
        n_s = samplers.size
        for step in range(STEPS):
            t0 = time.time()
            pick = rng.choice(len(facts), PROMPTS, replace=False)
            prompts = [facts[i] for i in pick]
            share = [prompts[i::n_s] for i in range(n_s)]
            rolls = samplers.call_each("rollout", [(version, s, GROUP, step) for s in share])
            tokens = np.concatenate([r["tokens"] for r in rolls])
            rewards = np.concatenate([r["rewards"] for r in rolls])
            p = rolls[0]["prompt_len"]
            adv = group_advantages(rewards, GROUP)
            total_tokens = float((tokens[:, p:] != PAD).sum())
            # Whole groups to each trainer member.
            groups = np.array_split(np.arange(len(rewards) // GROUP), trainer.size)
            parts = [(tokens[np.concatenate([np.arange(g * GROUP, (g + 1) * GROUP) for g in gs])],
                      adv[np.concatenate([np.arange(g * GROUP, (g + 1) * GROUP) for g in gs])],
                      p, total_tokens) for gs in groups]
            ups = trainer.call_each("update", parts)
            version += 1
            pubs = trainer.call("publish", version)
            wall = time.time() - t0
            split = {"generate": max(r["generate"] for r in rolls),
                     "reward": max(r["reward"] for r in rolls),
                     "update": max(u["seconds"] for u in ups),
                     "sync": max(pubs) + max(r["sync"] for r in rolls)}
            history.append(float(rewards.mean()))
            print(f"step {step + 1:3d}: mean reward {rewards.mean():.3f}  time {wall:.2f}s = "
                  f"generate {split['generate']:.3f} + reward {split['reward']:.3f} + update "
                  f"{split['update']:.3f} + weight sync {split['sync']:.3f} (publish "
                  f"{max(pubs):.3f}, pull {max(r['sync'] for r in rolls):.3f}) + driver/calls "
                  f"{max(0.0, wall - sum(split.values())):.3f}", flush=True)
        sums = set(round(c, 5) for c in trainer.call("checksum"))
        saved = trainer.call("state")[0]
        n_shards = trainer.size
        path = os.path.join(out_dir, "grpo_policy.pt")
        torch.save(saved, path)
        trainer.call("shutdown")
    finally:
        trainer.shutdown()
        samplers.shutdown()
        store.destroy()
    policy = load_policy(path)
    after = greedy_accuracy(policy)
    first, last5 = history[0], float(np.mean(history[-5:]))
    driver = ray.get_runtime_context().get_node_id()[:8]
    print(f"stages: warm-up and update on the trainer gang, generate and reward on the samplers, "
          f"advantages on the driver (node {names.get(driver, driver)}); weights through the object "
          f"store by version ({n_shards} shards per version)")
    print(f"mean reward: first GRPO step {first:.3f}, last five steps {last5:.3f} "
          f"(need >= 0.5 and >= first + 0.2); greedy accuracy over the {len(all_facts())} facts "
          f"{warm['accuracy']:.2f} after warm-up -> {after:.2f} after GRPO; "
          f'answer("7+8=") = {answer(policy, "7+8=")!r}; saved {path}; total {time.time() - started:.1f}s')
    ray.shutdown()
    ok = True
    if len(sums) != 1:
        print(f"FAIL: trainer members diverged ({sums})", file=sys.stderr)
        ok = False
    if last5 < 0.5 or last5 < first + 0.2:
        print(f"FAIL: last five steps' mean reward {last5:.3f}, first step {first:.3f}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


def _node_names() -> dict:
    """Short node id -> ``"<id> (slice sa host 2)"`` or ``"<id> (cpu)"``."""
    import tpuray as ray

    out = {}
    for n in ray.nodes():
        lab = n.get("Labels") or {}
        short = n["NodeID"][:8]
        sl = lab.get("tpuray.io/tpu-slice-name")
        out[short] = (f"{short} (slice {sl} host {lab.get('tpuray.io/tpu-worker-id')})" if sl
                      else f"{short} (cpu)")
    return out


if __name__ == "__main__":
    sys.exit(main())
