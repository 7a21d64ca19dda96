"""attnx.dask from one worker to two: the same graph on a LocalCluster of one
worker process and on one of two (one thread each, attnx.set_num_threads(1)
in every worker), rounds interleaved, median wall time of each and the
speed-up, and the share of the wall time each worker spent computing
tasks (near 100% on both: the graph keeps both busy, and the speed-up is
what the cores give) with the CPU time the workers used and the cores that
amounts to (what the machine's other processes left them). The inputs are made and kept on the workers (persisted) and the
result stays there too (persist, then wait), so a round times the attention
and the scheduling, not moving arrays to and from this process.

    python benchmarks/dask_scaling.py [--batch 8] [--heads 8] [--n 2048] [--d 64]
                                      [--variant softmax|linear] [--rounds 7]

The batch is split into one chunk per batch item, so both workers have
whole calls to run. The machine's load (cores other processes kept busy,
from /proc/stat) is printed before and after: on a shared machine the
ratio is only what that load left.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import busy_cores  # noqa: E402


def start(workers):
    from dask.distributed import Client, LocalCluster

    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                           dashboard_address=":0")
    client = Client(cluster)
    client.run(_one_thread)
    return cluster, client


def _one_thread():
    import attnx

    attnx.set_num_threads(1)
    return attnx.get_num_threads()


def inputs(client, args):
    import dask.array as da

    shape = (args.batch, args.heads, args.n, args.d)
    chunks = (1, args.heads, args.n, args.d)
    rng = da.random.default_rng(0)
    arrays = [rng.standard_normal(shape, chunks=chunks, dtype=np.float32) for _ in range(3)]
    arrays = client.persist(arrays)
    from dask.distributed import wait

    wait(arrays)
    return arrays


def one_round(client, attend, arrays):
    from dask.distributed import wait

    start_time = time.perf_counter()
    out = client.persist(attend(*arrays))
    wait(out)
    elapsed = time.perf_counter() - start_time
    del out
    return elapsed


def cpu_seconds(client):
    """CPU seconds the cluster's worker processes have used so far"""
    return sum(client.run(time.process_time).values())


def busy_fractions(task_stream, wall_seconds):
    """per worker, the seconds its tasks computed over the rounds' wall time"""
    busy = {}
    for task in task_stream:
        for span in task["startstops"]:
            if span["action"] == "compute":
                busy[task["worker"]] = busy.get(task["worker"], 0.0) + span["stop"] - span["start"]
    return [seconds / wall_seconds for seconds in busy.values()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--variant", choices=("softmax", "linear"), default="softmax")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    # no start and stop lines (nor a late heartbeat at shutdown) from the
    # scheduler, nannies and workers
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "critical")

    import dask
    from dask.distributed import get_task_stream

    import attnx.dask

    def attend(q, k, v):
        if args.variant == "softmax":
            return attnx.dask.softmax_attention(q, k, v, causal=True)
        return attnx.dask.linear_attention(q, k, v, causal=True)

    print(f"attnx.dask scaling: causal {args.variant}, float32, batch {args.batch} x "
          f"{args.heads} heads, n = {args.n}, d = {args.d}, one chunk per batch item; "
          f"dask {dask.__version__}, {os.cpu_count()} cores")
    print(f"busy cores (other processes) before: {busy_cores():.2f}")
    setups = {workers: start(workers) for workers in (1, 2)}
    try:
        data = {workers: inputs(client, args) for workers, (_, client) in setups.items()}
        for workers, (_, client) in setups.items():  # warm up: imports, first calls
            one_round(client, attend, data[workers])
        times = {1: [], 2: []}
        streams = {workers: get_task_stream(client) for workers, (_, client) in setups.items()}
        cpu = {workers: -cpu_seconds(client) for workers, (_, client) in setups.items()}
        for stream in streams.values():
            stream.__enter__()
        for _ in range(args.rounds):
            for workers, (_, client) in setups.items():
                times[workers].append(one_round(client, attend, data[workers]))
        for stream in streams.values():
            stream.__exit__(None, None, None)
        for workers, (_, client) in setups.items():
            cpu[workers] += cpu_seconds(client)
    finally:
        for cluster, client in setups.values():
            client.close()
            cluster.close()
    print(f"busy cores (other processes) after:  {busy_cores():.2f}")
    medians = {workers: statistics.median(t) for workers, t in times.items()}
    for workers, t in times.items():
        print(f"{workers} worker{'s' if workers > 1 else ' '}: median {medians[workers] * 1e3:8.1f} ms"
              f"   (rounds: {', '.join(f'{x * 1e3:.0f}' for x in t)})")
    for workers, stream in streams.items():
        busy = busy_fractions(stream.data, sum(times[workers]))
        print(f"{workers} worker{'s' if workers > 1 else ' '}: share of the wall time each worker "
              f"spent in tasks: {', '.join(f'{b:.0%}' for b in busy)}; CPU time of the workers "
              f"{cpu[workers] / args.rounds * 1e3:.0f} ms a round, "
              f"{cpu[workers] / sum(times[workers]):.2f} cores obtained")
    ratios = [one / two for one, two in zip(times[1], times[2])]
    print(f"speed-up 1 -> 2 workers: {medians[1] / medians[2]:.2f}x "
          f"(ratio of medians; per-round ratios median {statistics.median(ratios):.2f}x; "
          f"fastest rounds {min(times[1]) / min(times[2]):.2f}x)")


if __name__ == "__main__":
    main()
