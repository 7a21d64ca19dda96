"""Reformer LSH attention beside dense softmax attention, in one run (median
wall times of interleaved repeats), with the time per n log2 n so that its
growth shows.

    python benchmarks/lsh.py [--n 4096,8192,16384,32768] [--repeats 5] [--dense-max 32768]

Shapes: 8 heads, d = e = 64, float32, chunk 64, n_buckets = n / chunk (as
in Reformer), n_hashes 1 and 4. Also the hashing alone (lsh_buckets), which
with n_buckets = n / chunk costs O(n^2 d / chunk) and so grows faster than
the rest: the last column leaves it out. Dense softmax is
attnx.softmax_attention on the same q as keys.
"""
import argparse
import math
import time

import numpy as np

import attnx


def median_time(call, repeats):
    call()  # warm: first-touch of the outputs, thread start
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="4096,8192,16384,32768")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dense-max", type=int, default=32768,
                        help="largest n at which dense softmax is timed too")
    args = parser.parse_args()
    heads, d, chunk = args.heads, 64, args.chunk
    print(f"attnx {attnx.__version__}, {attnx.get_num_threads()} threads, {heads} heads, "
          f"d = e = {d}, float32, chunk {chunk}, n_buckets = n / chunk; "
          f"median of {args.repeats} (seconds)")
    header = ("n", "n_hashes", "lsh", "hashing", "dense", "dense/lsh", "lsh/(n log2 n) ns",
              "(lsh-hashing)/(n log2 n) ns")
    print("{:>6} {:>8} {:>9} {:>9} {:>9} {:>9} {:>17} {:>27}".format(*header))
    for n in (int(x) for x in args.n.split(",")):
        rng = np.random.default_rng(n)
        q = rng.standard_normal((heads, n, d), dtype=np.float32)
        v = rng.standard_normal((heads, n, d), dtype=np.float32)
        n_buckets = max(2, n // chunk)
        n_buckets += n_buckets % 2
        dense = (median_time(lambda: attnx.softmax_attention(q, q, v), args.repeats)
                 if n <= args.dense_max else float("nan"))
        for n_hashes in (1, 4):
            lsh = median_time(lambda: attnx.lsh_attention(q, v, n_buckets, n_hashes, chunk),
                              args.repeats)
            hashing = median_time(lambda: attnx.lsh_buckets(q, n_buckets, n_hashes), args.repeats)
            per = lsh / (n * math.log2(n)) * 1e9
            rest = (lsh - hashing) / (n * math.log2(n)) * 1e9
            print(f"{n:>6} {n_hashes:>8} {lsh:>9.4f} {hashing:>9.4f} {dense:>9.3f} "
                  f"{dense / lsh:>9.1f} {per:>17.2f} {rest:>27.2f}")


if __name__ == "__main__":
    main()
