"""The streaming executor: runs a dataset's operators as tasks and actor pools, block by
block, with backpressure on the bytes its blocks hold in the object store.

Every block the executor holds a reference to (queued between operators, waiting for the
consumer, or being produced by a running task, estimated from the operator's output so far)
counts against ``DataContext.max_bytes_in_flight``; a task is launched only while the total
stays under the bound (one task may always run, so the pipeline never stalls). The consumer
drains the last operator first, so a slow consumer holds the upstream operators back.

A dataset only records logical operators; consuming it builds ``PhysicalOp`` objects and
runs :class:`StreamingExecutor` in the consuming process. Consecutive task operators
fuse into one task per block (reads included; each returns the block and its
``BlockMeta``, rows and bytes); a callable class in ``map_batches`` runs on an
autoscaling actor pool, grown while blocks queue and every actor is busy, up to
``concurrency``'s max, never so far that the tasks feeding it lose their last CPU;
``random_shuffle``/``repartition`` are two-phase all-to-all operators (split tasks, then
one merge task per output block).

The loop: collect finished tasks and move their blocks downstream, yield to the
consumer, launch (downstream operators first, so draining frees the bytes that hold
upstream back; at most ``max_tasks_in_flight_per_op``, default twice the cluster's
CPUs), wait 0.5 s at most on the running tasks' metadata. The executor handles refs and
metadata only; the consumer fetches the blocks it iterates.

DATA-1: the bytes of the blocks an execution holds (queued between operators, waiting
for the consumer, the inputs of running tasks plus each running task's expected output,
the operator's mean so far) stay under ``DataContext.max_bytes_in_flight`` (default a
quarter of the cluster's object store, at least 64 MiB), except that one task may always
run so the pipeline never stalls (``StreamingExecutor._schedule``; ``Dataset.stats()``
reports the peak). A slow consumer therefore holds every upstream operator back.

DATA-2: with ``preserve_order`` (the default) blocks reach the consumer in source order;
blocks that finish early wait in the executor and count against DATA-1
(``StreamingExecutor.run``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import tpuray
from tpuray.data import block as B
from tpuray.data.context import DataContext


@dataclass
class BlockMeta:
    """What the executor knows of a block without fetching it: rows, approximate bytes
    and the column names."""

    num_rows: int
    size_bytes: int
    columns: tuple = ()


def _meta(block) -> BlockMeta:
    return BlockMeta(B.num_rows(block), B.size_bytes(block), tuple(block.keys()))


@tpuray.remote(num_returns=2)
def _run_block_fn(fn, *blocks):
    """A fused chain of per-block transforms (or a read when ``blocks`` is empty)."""
    out = fn(*blocks)
    return out, _meta(out)


@tpuray.remote
def _split_block(block, how, arg):
    """The map half of an all-to-all operator: ``block`` cut into parts, one return object
    per part (the caller sets ``num_returns``).

    ``how``: ``"shuffle"`` (``arg=(parts, seed)``: each row to a random part),
    ``"repartition"`` (``arg=[(output, start, end), ...]`` row ranges), ``"range"``
    (``arg=(key, boundaries, descending)``: sort's range partitioning on the first key),
    ``"hash"`` (``arg=(keys, parts)``: groupby's hash partitioning).
    """
    import numpy as np

    n = B.num_rows(block)
    if how == "shuffle":
        parts, seed = arg
        rng = np.random.default_rng(seed)
        owner = rng.integers(0, parts, size=n)
        out = [B.take_indices(block, np.nonzero(owner == j)[0]) for j in range(parts)]
    elif how == "range":
        key, bounds, descending = arg
        parts = len(bounds) + 1
        if n == 0:
            out = [block] * parts
        else:
            owner = np.searchsorted(np.asarray(bounds, dtype=block[key].dtype), block[key],
                                    side="right") if len(bounds) else np.zeros(n, dtype=np.int64)
            if descending:
                owner = parts - 1 - owner
            order = np.argsort(owner, kind="stable")
            cuts = np.searchsorted(owner[order], np.arange(parts + 1), side="left")
            out = [B.take_indices(block, order[cuts[j]:cuts[j + 1]]) for j in range(parts)]
    elif how == "hash":
        keys, parts = arg
        owner = B.hash_partition(block, keys, parts)
        order = np.argsort(owner, kind="stable")
        cuts = np.searchsorted(owner[order], np.arange(parts + 1), side="left")
        out = [B.take_indices(block, order[cuts[j]:cuts[j + 1]]) for j in range(parts)]
    else:
        # repartition: arg = [(output index, start, end) ...] row ranges of this block
        out = [B.slice_block(block, s, e) for (_, s, e) in arg]
    return out[0] if len(out) == 1 else tuple(out)


def _split(ref, how, arg, parts: int) -> list:
    refs = _split_block.options(num_returns=parts).remote(ref, how, arg)
    return [refs] if parts == 1 else list(refs)


@tpuray.remote(num_returns=2)
def _merge_parts(how, arg, *pieces):
    """The reduce half: joins the parts meant for one output block, then ``"shuffle"``
    permutes them (``arg``: the seed), ``"sort"`` sorts them (``arg=(keys,
    descending)``), ``"call"`` hands them to ``arg(block) -> block`` (groupby)."""
    out = B.concat(list(pieces))
    if how == "shuffle" and B.num_rows(out) > 1:
        import numpy as np

        idx = np.random.default_rng(arg).permutation(B.num_rows(out))
        out = B.take_indices(out, idx)
    elif how == "sort" and B.num_rows(out) > 1:
        keys, descending = arg
        out = B.take_indices(out, B.sort_indices(out, keys, descending))
    elif how == "call":
        out = arg(out)
    return out, _meta(out)


@tpuray.remote
def _sample_keys(block, key, k, seed):
    """Up to ``k`` values of column ``key`` of ``block``, drawn without replacement."""
    import numpy as np

    col = block.get(key)
    if col is None or len(col) == 0:
        return col[:0] if col is not None else np.zeros(0)
    if len(col) <= k:
        return col
    idx = np.random.default_rng(seed).choice(len(col), size=k, replace=False)
    return col[np.sort(idx)]


@tpuray.remote
def _meta_remote(block):
    return _meta(block)


@tpuray.remote(num_returns=2)
def _slice_remote(block, start, end):
    out = B.slice_block(block, start, end)
    return out, _meta(out)


def sort_boundaries(samples: list, parts: int):
    """``parts - 1`` ascending boundaries cutting the pooled ``samples`` into ``parts``
    ranges of near-equal size (sample-based range partitioning, as Ray's sort does)."""
    import numpy as np

    samples = [s for s in samples if s is not None and len(s)]
    if parts <= 1 or not samples:
        return []
    pool = np.sort(np.concatenate(samples), kind="stable")
    picks = [pool[min(len(pool) - 1, (len(pool) * j) // parts)] for j in range(1, parts)]
    return [p.item() if isinstance(p, np.generic) else p for p in picks]


class _ActorWorker:
    """Hosts one instance of a user's callable class for ``map_batches``."""

    def __init__(self, cls, args, kwargs):
        self._fn = cls(*args, **kwargs)

    def process(self, transform, block):
        out = transform(self._fn, block)
        return out, _meta(out)

    def ready(self):
        return True


@dataclass
class _Running:
    block_ref: Any
    meta_ref: Any
    input_bytes: int
    index: int
    actor: Any = None


@dataclass
class PhysicalOp:
    """One stage of the pipeline."""

    name: str
    kind: str  # "source", "task", "actors", "all_to_all", "limit"
    fn: Optional[Callable] = None
    remote_args: dict = field(default_factory=dict)
    read_fns: list = field(default_factory=list)  # sources: one zero-argument read per block
    blocks: list = field(default_factory=list)  # sources of existing blocks: (ref, meta)
    actor_cls: Any = None
    actor_args: tuple = ()
    actor_kwargs: dict = field(default_factory=dict)
    concurrency: tuple = (1, 1)
    # ("shuffle", n, seed) | ("repartition", n) | ("sort", n, (keys, descending, bounds))
    # | ("groupby", n, (keys, finish)); n None: one output block per input block
    all_to_all: tuple = ()
    limit: int = 0  # "limit": the rows to pass
    max_concurrency: Optional[int] = None  # tasks of this operator at once (Ray's concurrency)
    # sources whose output is known without reading (range): ([names], [arrow type
    # strings]) and the row count, for repr; None: unknown
    known_schema: Optional[tuple] = None
    known_rows: Optional[int] = None


class _OpState:
    def __init__(self, op: PhysicalOp, index: int, bars: bool):
        self.op = op
        self.index = index
        self.inqueue: collections.deque = collections.deque()
        self.outqueue: collections.deque = collections.deque()
        self.running: list[_Running] = []
        self.inputs_done = op.kind == "source"
        self.rows_out = 0
        self.blocks_out = 0
        self.bytes_out = 0
        self.actors: list = []
        self.busy: dict = {}
        self.pending_reads = collections.deque(op.read_fns)
        self.pending_blocks = collections.deque(op.blocks)
        self.next_index = 0  # sources: the order of the blocks they make
        self.all_inputs: list = []
        self.limit_pending: dict = {}  # "limit": blocks waiting for their turn, by index
        self.limit_next = 0
        self.limit_rows = 0
        self.started = time.time()
        self.finished: Optional[float] = None
        self.bar = None
        if bars:
            try:
                from tqdm import tqdm

                # disable=None: no bar when stderr is not a terminal (logs stay clean).
                self.bar = tqdm(desc=f"{op.name}", unit=" rows", position=index, leave=False,
                                disable=None)
            except ImportError:
                self.bar = None

    def done(self) -> bool:
        return (
            self.inputs_done
            and not self.inqueue
            and not self.running
            and not self.pending_reads
            and not self.pending_blocks
            and not self.all_inputs
            and not self.limit_pending
        )

    def expected_output_bytes(self) -> int:
        """What one more task of this operator is expected to produce (its mean so far)."""
        if self.blocks_out:
            return self.bytes_out // self.blocks_out
        return 0


class StreamingExecutor:
    """Runs ``ops`` (first is a source) and yields ``(block_ref, BlockMeta)`` of the last
    operator as they are ready.

    ``max_bytes_in_flight``: the backpressure bound in bytes (default from
    :class:`DataContext`). ``stats`` holds the largest number of bytes the executor held.
    """

    def __init__(self, ops: list[PhysicalOp], ctx: Optional[DataContext] = None):
        self.ctx = ctx or DataContext.get_current()
        self.ops = ops
        self.peak_bytes = 0
        self.op_stats: list = []  # per operator: (name, blocks, rows, bytes, seconds)
        self._early: dict = {}
        self._cpus: Optional[int] = None

    # ---- accounting ----

    def _bytes_held(self, states) -> int:
        total = sum(m.size_bytes for _, m in self._early.values())
        for s in states:
            total += sum(m.size_bytes for _, m, _ in s.inqueue)
            total += sum(m.size_bytes for _, m, _ in s.outqueue)
            total += sum(m.size_bytes for _, m, _ in s.all_inputs)
            for r in s.running:
                total += r.input_bytes + s.expected_output_bytes()
        return total

    def _cpu_cap(self) -> int:
        """The cluster's CPUs (asked of the head once per execution)."""
        if self._cpus is None:
            try:
                self._cpus = max(1, int(tpuray.cluster_resources().get("CPU", 1)))
            except Exception:
                self._cpus = 1
        return self._cpus

    # ---- launching ----

    def _launch_task(self, s: _OpState, budget_left: int) -> bool:
        op = s.op
        if op.kind == "source":
            index = s.next_index
            if s.pending_blocks:
                ref, meta = s.pending_blocks.popleft()
                s.next_index += 1
                s.outqueue.append((ref, meta, index))
                self._count_out(s, meta)
                return True
            if not s.pending_reads:
                return False
            fn = s.pending_reads.popleft()
            s.next_index += 1
            args: tuple = ()
            input_bytes = 0
        else:
            if not s.inqueue:
                return False
            ref, meta, index = s.inqueue.popleft()
            fn = op.fn
            args = (ref,)
            input_bytes = meta.size_bytes
        opts = dict(op.remote_args)
        block_ref, meta_ref = _run_block_fn.options(**opts).remote(fn, *args)
        s.running.append(_Running(block_ref, meta_ref, input_bytes, index))
        return True

    def _launch_actor_call(self, s: _OpState) -> bool:
        if not s.inqueue:
            return False
        free = [a for a in s.actors if s.busy.get(id(a), 0) < self.ctx.max_tasks_in_flight_per_actor]
        if not free:
            return False
        actor = min(free, key=lambda a: s.busy.get(id(a), 0))
        ref, meta, index = s.inqueue.popleft()
        block_ref, meta_ref = actor.process.options(num_returns=2).remote(s.op.fn, ref)
        s.busy[id(actor)] = s.busy.get(id(actor), 0) + 1
        s.running.append(_Running(block_ref, meta_ref, meta.size_bytes, index, actor))
        return True

    def _scale_actors(self, s: _OpState, upstream_cpus: float) -> None:
        op = s.op
        lo, hi = op.concurrency
        per_actor = float(op.remote_args.get("num_cpus", 1) or 0)
        if per_actor > 0 and upstream_cpus > 0:
            # Never let the pool take every CPU the tasks feeding it need (they would
            # starve, and the pool with them): leave room for one upstream task.
            room = int((self._cpu_cap() - upstream_cpus) // per_actor)
            hi = max(1, min(hi, room))
            lo = min(lo, hi)
        want = len(s.actors)
        if want < lo:
            want = lo
        elif s.inqueue and want < hi and all(
            s.busy.get(id(a), 0) >= 1 for a in s.actors
        ):
            want += 1
        while len(s.actors) < want:
            cls = tpuray.remote(**op.remote_args)(_ActorWorker)
            s.actors.append(cls.remote(op.actor_cls, op.actor_args, op.actor_kwargs))

    def _run_all_to_all(self, s: _OpState) -> None:
        how = s.op.all_to_all[0]
        inputs = sorted(s.all_inputs, key=lambda item: item[2])
        s.all_inputs = []
        if not inputs:
            return
        n = s.op.all_to_all[1]
        n = max(1, int(n if n is not None else len(inputs)))
        if how == "shuffle":
            seed = s.op.all_to_all[2]
            base = seed if seed is not None else int(time.time_ns() % (2**31))
            splits = [
                _split(ref, "shuffle", (n, base + i), n) for i, (ref, _, _) in enumerate(inputs)
            ]
            # Reducer j joins part j of every input block.
            for j in range(n):
                parts = [sp[j] for sp in splits]
                b, m = _merge_parts.remote("shuffle", base + 7919 * (j + 1), *parts)
                s.running.append(_Running(b, m, 0, j))
            return
        if how in ("sort", "groupby"):
            columns = next((m.columns for _, m, _ in inputs if m.num_rows), ())
            keys = s.op.all_to_all[2][0]
            missing = [k for k in keys if k not in columns]
            if missing and columns:
                what = "sort" if how == "sort" else "groupby"
                raise ValueError(
                    f"The {what} key(s) {missing} are not in the dataset's columns {list(columns)}"
                )
            if how == "sort":
                keys, descending, bounds = s.op.all_to_all[2]
                if bounds is None:
                    # Sample-based range partitioning: a few key values of every block
                    # (small) choose the boundaries; the blocks stay in the object store.
                    per_block = max(10, 20 * n // len(inputs) + 1)
                    samples = tpuray.get([
                        _sample_keys.remote(ref, keys[0], per_block, i)
                        for i, (ref, _, _) in enumerate(inputs)
                    ])
                    bounds = sort_boundaries(samples, n)
                n = len(bounds) + 1
                splits = [_split(ref, "range", (keys[0], list(bounds), descending[0]), n)
                          for ref, _, _ in inputs]
                merge_how, merge_arg = "sort", (keys, descending)
            else:
                keys, finish = s.op.all_to_all[2]
                splits = [_split(ref, "hash", (keys, n), n) for ref, _, _ in inputs]
                merge_how, merge_arg = "call", finish
            for j in range(n):
                b, m = _merge_parts.remote(merge_how, merge_arg, *[sp[j] for sp in splits])
                s.running.append(_Running(b, m, 0, j))
            return
        total = sum(m.num_rows for _, m, _ in inputs)
        if how == "repartition" and s.op.all_to_all[1] is None:
            n = max(1, -(-total // int(s.op.all_to_all[2])))  # target rows per block
        bounds = [round(total * j / n) for j in range(n + 1)]
        per_output: list[list] = [[] for _ in range(n)]
        offset = 0
        for ref, m, _ in inputs:
            ranges = []
            for j in range(n):
                lo, hi = max(bounds[j], offset), min(bounds[j + 1], offset + m.num_rows)
                if lo < hi:
                    ranges.append((j, lo - offset, hi - offset))
            offset += m.num_rows
            if not ranges:
                continue
            sp = _split(ref, "repartition", ranges, len(ranges))
            for k, (j, _, _) in enumerate(ranges):
                per_output[j].append(sp[k])
        for j in range(n):
            b, m = _merge_parts.remote("repartition", None, *per_output[j])
            s.running.append(_Running(b, m, 0, j))

    def _run_limit(self, s: _OpState, states) -> None:
        """Passes blocks in order until ``op.limit`` rows went by (the last one cut by a
        small task), then stops everything upstream: no more reads or tasks start."""
        while s.inqueue:
            ref, meta, index = s.inqueue.popleft()
            s.limit_pending[index] = (ref, meta)
        limit = s.op.limit
        while s.limit_rows < limit:
            if s.limit_next not in s.limit_pending:
                if s.inputs_done and s.limit_pending:
                    # Indices restart after an all-to-all operator: take the smallest next.
                    s.limit_next = min(s.limit_pending)
                    continue
                return
            ref, meta = s.limit_pending.pop(s.limit_next)
            s.limit_next += 1
            left = limit - s.limit_rows
            if meta.num_rows <= left:
                s.outqueue.append((ref, meta, s.limit_next - 1))
                self._count_out(s, meta)
                s.limit_rows += meta.num_rows
            else:
                b, m = _slice_remote.remote(ref, 0, left)
                s.running.append(_Running(b, m, meta.size_bytes, s.limit_next - 1))
                s.limit_rows += left
        # Reached: drop what is queued and stop the operators feeding this one.
        s.limit_pending.clear()
        s.inputs_done = True
        for t in states[: s.index]:
            t.pending_reads.clear()
            t.pending_blocks.clear()
            t.inqueue.clear()
            t.outqueue.clear()
            t.all_inputs = []
            t.running = []
            t.inputs_done = True

    def _count_out(self, s: _OpState, meta: BlockMeta) -> None:
        s.rows_out += meta.num_rows
        s.blocks_out += 1
        s.bytes_out += meta.size_bytes
        if s.bar is not None:
            s.bar.update(meta.num_rows)

    # ---- the loop ----

    def run(self):
        ctx = self.ctx
        states = [_OpState(op, i, ctx.enable_progress_bars) for i, op in enumerate(self.ops)]
        last = states[-1]
        # DATA-2 (preserve_order): blocks leave in source order (after an all-to-all operator,
        # in its output order); the ones that finish early wait, counted as held bytes.
        early = self._early = {}
        want = 0
        try:
            while True:
                # Hand finished outputs downstream (or to the consumer).
                self._collect(states)
                if ctx.preserve_order:
                    while last.outqueue:
                        ref, meta, index = last.outqueue.popleft()
                        early[index] = (ref, meta)
                    while want in early:
                        yield early.pop(want)
                        want += 1
                    if early and all(s.done() for s in states):
                        # Indices restart after an all-to-all operator: release the rest.
                        for k in sorted(early):
                            yield early.pop(k)
                else:
                    while last.outqueue:
                        ref, meta, _ = last.outqueue.popleft()
                        yield ref, meta
                if all(s.done() for s in states) and not last.outqueue and not early:
                    return
                self._schedule(states)
                self.peak_bytes = max(self.peak_bytes, self._bytes_held(states))
                self._wait(states)
        finally:
            now = time.time()
            self.op_stats = [
                (s.op.name, s.blocks_out, s.rows_out, s.bytes_out, (s.finished or now) - s.started)
                for s in states
            ]
            for s in states:
                if s.bar is not None:
                    s.bar.close()
                for a in s.actors:
                    try:
                        tpuray.kill(a)
                    except Exception:
                        pass

    def _collect(self, states) -> None:
        for i, s in enumerate(states):
            if s.running:
                metas = [r.meta_ref for r in s.running]
                ready, _ = tpuray.wait(metas, num_returns=len(metas), timeout=0)
                ready_set = set(ready)
                still = []
                for r in s.running:
                    if r.meta_ref in ready_set:
                        meta = tpuray.get(r.meta_ref)
                        if r.actor is not None:
                            s.busy[id(r.actor)] -= 1
                        s.outqueue.append((r.block_ref, meta, r.index))
                        self._count_out(s, meta)
                    else:
                        still.append(r)
                s.running = still
            if s.op.kind == "source" and not s.pending_reads and not s.pending_blocks:
                s.inputs_done = True
            if s.finished is None and s.done():
                s.finished = time.time()
            if i + 1 < len(states):
                nxt = states[i + 1]
                while s.outqueue:
                    item = s.outqueue.popleft()
                    if nxt.op.kind == "all_to_all":
                        nxt.all_inputs.append(item)
                    else:
                        nxt.inqueue.append(item)
                if s.done():
                    nxt.inputs_done = True

    def _schedule(self, states) -> None:
        ctx = self.ctx
        cpu_cap = self._cpu_cap()
        # Downstream first: draining frees the bytes that hold upstream back.
        for i in range(len(states) - 1, -1, -1):
            s = states[i]
            op = s.op
            if op.kind == "all_to_all":
                if s.inputs_done and s.all_inputs and not s.running:
                    self._run_all_to_all(s)
                continue
            if op.kind == "limit":
                self._run_limit(s, states)
                continue
            if op.kind == "actors":
                upstream = sum(
                    float(t.op.remote_args.get("num_cpus", 1) or 0)
                    for t in states[:i]
                    if t.op.kind in ("task", "source") and not t.done()
                )
                self._scale_actors(s, upstream)
            cap = ctx.max_tasks_in_flight_per_op or 2 * cpu_cap
            if op.max_concurrency is not None and op.kind != "actors":
                cap = min(cap, op.max_concurrency)
            while len(s.running) < cap:
                if s.running and s.blocks_out == 0 and not s.pending_blocks:
                    # The size of this operator's blocks is unknown until its first one is
                    # made: one task probes it, so a burst at the start cannot pass the bound.
                    break
                held = self._bytes_held(states)
                anything_running = any(t.running for t in states)
                est = s.expected_output_bytes() + (s.inqueue[0][1].size_bytes if s.inqueue else 0)
                # DATA-1: launch only under the bound, except when nothing runs (no stall).
                if anything_running and held + est > ctx.max_bytes_in_flight:
                    break
                launched = (
                    self._launch_actor_call(s) if op.kind == "actors" else self._launch_task(s, 0)
                )
                if not launched:
                    break

    def _wait(self, states) -> None:
        metas = [r.meta_ref for s in states for r in s.running]
        if metas:
            tpuray.wait(metas, num_returns=1, timeout=0.5)
        else:
            time.sleep(0.001)

