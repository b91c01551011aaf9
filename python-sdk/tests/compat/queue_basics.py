"""ray.util.queue: blocking and non-blocking put/get, batches, Empty/Full, and one
queue shared by a producer task, a consumer actor and the driver."""

import ray
from ray.util.queue import Empty, Full, Queue

ray.init(num_cpus=4)


def describe(e):
    """The error's class and message (a remote one's cause message: a traceback names
    the module path it ran under)."""
    if isinstance(e, ray.exceptions.RayTaskError):
        return f"{type(e).__name__} cause={e.cause!r}"
    return f"{type(e).__name__} {e!r}"


q = Queue(maxsize=3)
print("empty", q.empty(), "full", q.full(), "size", q.qsize(), len(q))
for i in range(3):
    q.put(i)
print("empty", q.empty(), "full", q.full(), "size", q.size())

for name, call in [
    ("put_nowait", lambda: q.put_nowait(9)),
    ("put block=False", lambda: q.put(9, block=False)),
    ("put timeout", lambda: q.put(9, timeout=0.2)),
    ("put_nowait_batch", lambda: q.put_nowait_batch([7, 8])),
]:
    try:
        call()
    except Full as e:
        print(name, "-> Full", isinstance(e, Full), describe(e))

print("get", q.get(), q.get(block=False), q.get_nowait())
for name, call in [
    ("get_nowait", q.get_nowait),
    ("get block=False", lambda: q.get(block=False)),
    ("get timeout", lambda: q.get(timeout=0.2)),
    ("get_nowait_batch", lambda: q.get_nowait_batch(1)),
]:
    try:
        call()
    except Empty as e:
        print(name, "-> Empty", isinstance(e, Empty), describe(e))

for name, call in [
    ("negative put timeout", lambda: q.put(1, timeout=-1)),
    ("negative get timeout", lambda: q.get(timeout=-1)),
    ("negative batch", lambda: q.get_nowait_batch(-1)),
    ("batch of str", lambda: q.get_nowait_batch("2")),
    ("batch not iterable", lambda: q.put_nowait_batch(5)),
]:
    try:
        call()
    except (TypeError, ValueError) as e:
        print(name, "->", type(e).__name__, e)

q.put_nowait_batch([10, 11, 12])
print("batch", q.get_nowait_batch(2), q.get_nowait_batch(1), q.get_nowait_batch(0))

# Empty and Full are the standard library's queue exceptions too.
import queue as stdlib_queue

print(issubclass(Empty, stdlib_queue.Empty), issubclass(Full, stdlib_queue.Full))

# One unbounded queue between a producer task, a consumer actor and the driver.
work = Queue()
results = Queue()


@ray.remote
def produce(queue, n):
    for i in range(n):
        queue.put(i)
    queue.put(None)
    return n


@ray.remote
class Consumer:
    def __init__(self, inbox, outbox):
        self.inbox = inbox
        self.outbox = outbox

    def run(self):
        total = 0
        while True:
            item = self.inbox.get(timeout=30)
            if item is None:
                break
            total += item
            self.outbox.put(item * item)
        return total


consumer = Consumer.remote(work, results)
done = consumer.run.remote()
print("produced", ray.get(produce.remote(work, 10)))
print("consumed total", ray.get(done))
print("squares", sorted(results.get() for _ in range(10)))
print("left", work.qsize(), results.qsize())

# A blocked get is woken by a put from elsewhere.
waiter = Queue()


@ray.remote
def late_put(queue):
    import time

    time.sleep(0.5)
    queue.put("late")


late_put.remote(waiter)
print("blocking get", waiter.get(timeout=30))


# The async forms, from an async actor.
@ray.remote
class AsyncUser:
    async def roundtrip(self, queue):
        await queue.put_async("a")
        await queue.put_async("b", block=False)
        first = await queue.get_async()
        second = await queue.get_async(block=False)
        try:
            await queue.get_async(block=False)
        except Empty:
            third = "Empty"
        return [first, second, third]


print("async", ray.get(AsyncUser.remote().roundtrip.remote(Queue())))

q.shutdown()
print("shut down", q.actor)
work.shutdown(force=True)
results.shutdown()
ray.shutdown()
