"""Ray's repeated-line deduplication at the driver: 10 tasks each print the same line 10
times. Recorded under Ray 2.60 with deduplication on (scripts/record-compat.sh records
``logs_*`` scripts without RAY_DEDUP_LOGS=0 and keeps their worker lines in
``NAME.driver-lines``); test_logs.py compares tpuray's driver output with it."""

import time

import ray

ray.init(num_cpus=4)


@ray.remote
def f(i):
    # Held a moment first so the 10 tasks spread over several worker processes: lines
    # repeated by one process print as they come (Ray's rule); only those from other
    # processes are counted.
    time.sleep(0.5)
    for _ in range(10):
        print("hello from the tasks")
    return i


print("results", sum(ray.get([f.remote(i) for i in range(10)])))
# Lines travel to the driver in the background: give them a moment before shutdown,
# which prints the counts still held.
time.sleep(2)
ray.shutdown()
print("done")
