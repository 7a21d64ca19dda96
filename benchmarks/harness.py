"""Interleaved timing harness.

Competitors of one case are timed round-robin (A, B, C, A, B, C, ...), so a
slow phase of the shared machine hits all of them alike and ratios taken
from the medians of one run are meaningful even when absolute times drift.

Per case:
1. warm-up: each competitor runs until `warmup_s` has passed (at least once);
   its first result is kept so the caller can check the answers agree, and
   its fastest call sets the number of inner repetitions, chosen so that one
   sample lasts at least `min_sample_s` (tiny calls loop thousands of times);
2. rounds: as many as fit in `budget_s`, clamped to [min_rounds, max_rounds];
   every round takes one sample of every competitor in a fixed order;
3. a sample is the mean time of its inner repetitions (time.perf_counter,
   garbage collector off). Before each sample the harness sleeps `pause_s`,
   so that the previous competitor's worker threads stop spinning: OpenBLAS
   threads spin for about 2^28 cycles (~0.1 s) after a call and libgomp's
   for a few ms. With a 5 ms pause, attnx at n = 512 timed right after the
   gemm measured 2.6-11 ms instead of its 1.5 ms alone; from 0.1 s on it
   measures 1.5-1.6 ms, as alone;
4. after the pause and before the sample, a competitor whose call lasts
   under `rewarm_below_s` runs once untimed. The pause itself slows the
   next calls: on the two-vCPU development VM (AMD Zen 5, November 2026),
   after 0.15 s of sleep the first causal linear attention forward +
   backward at (1, 8, 4096, 64) on two threads took 2.8 + 7.2 ms against
   2.1 + 5.8 ms back to back, and fast-transformers' causal product
   forward + backward 46.0, 44.1, 43.4 ms against 41.8 ms (medians of 7
   and 9 pauses; one thread showed no such cost). A sample of three short
   calls pays that once, a sample of one long call pays it too, and the
   ratio between them would measure the pause, not the libraries. The
   untimed call makes every sample start from the state a loop of calls
   is in; calls longer than `rewarm_below_s` skip it (the slowdown is then
   a few per cent of one call at most, and the extra call would double
   their rounds).

The machine's ceilings, measured in the same run (machine_peak): the
multiply-add peak of float32 and float64 and the read bandwidth of memory,
on the threads the benchmark uses, from benchmarks/machine_peak.c, built on
the fly with the C compiler (CC, else cc) and OpenMP, and loaded by ctypes.
A benchmark gives a FLOP rate as a fraction of the peak and a rate of
bytes read as a fraction of the bandwidth, for attnx and torch alike.
"""
import ctypes
import gc
import hashlib
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Settings:
    min_rounds: int = 3
    max_rounds: int = 9
    budget_s: float = 20.0      # target time for the timed rounds of one case
    warmup_s: float = 0.2
    min_sample_s: float = 0.02
    pause_s: float = 0.15
    rewarm_below_s: float = 0.25


@dataclass
class Stats:
    """Per-call times (seconds) of one competitor, one value per round."""
    samples: list
    number: int                  # inner repetitions per sample
    median: float = field(init=False)
    q1: float = field(init=False)
    q3: float = field(init=False)
    min: float = field(init=False)
    max: float = field(init=False)

    def __post_init__(self):
        self.median = statistics.median(self.samples)
        if len(self.samples) >= 2:
            self.q1, _, self.q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        else:
            self.q1 = self.q3 = self.median
        self.min, self.max = min(self.samples), max(self.samples)

    def as_dict(self):
        return {"median_s": self.median, "q1_s": self.q1, "q3_s": self.q3,
                "min_s": self.min, "max_s": self.max, "number": self.number,
                "samples_s": self.samples}


def warm_up(call, warmup_s):
    """Run `call` for about warmup_s (at least once). Return (first result,
    fastest single-call time)."""
    first_result, fastest = None, math.inf
    started = time.perf_counter()
    calls = 0
    while calls == 0 or time.perf_counter() - started < warmup_s:
        t0 = time.perf_counter()
        result = call()
        fastest = min(fastest, time.perf_counter() - t0)
        if calls == 0:
            first_result = result
        calls += 1
    return first_result, fastest


def take_sample(call, number):
    """Mean seconds per call over `number` back-to-back calls."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(number):
            call()
        return (time.perf_counter() - t0) / number
    finally:
        if gc_was_enabled:
            gc.enable()


def round_count(seconds_per_round, settings):
    fitting = int(settings.budget_s / max(seconds_per_round, 1e-9))
    return max(settings.min_rounds, min(settings.max_rounds, fitting))


def measure(calls, settings):
    """Time the zero-argument callables in `calls` ({name: call}), interleaved.

    Returns ({name: Stats}, {name: result of the first warm-up call},
    {name: error message} for the calls that raised during warm-up, which
    are left out of the rounds).
    """
    first_results, numbers, rewarm, failures = {}, {}, {}, {}
    seconds_per_round = 0.0
    for name, call in calls.items():
        time.sleep(settings.pause_s)
        try:
            first_results[name], fastest = warm_up(call, settings.warmup_s)
        except Exception as error:      # reported beside the others, not fatal
            failures[name] = "%s: %s" % (type(error).__name__, error)
            continue
        numbers[name] = max(1, math.ceil(settings.min_sample_s / max(fastest, 1e-9)))
        rewarm[name] = fastest < settings.rewarm_below_s
        seconds_per_round += (numbers[name] + rewarm[name]) * fastest + settings.pause_s
    samples = {name: [] for name in numbers}
    for _ in range(round_count(seconds_per_round, settings)):
        for name in numbers:
            time.sleep(settings.pause_s)
            if rewarm[name]:
                calls[name]()
            samples[name].append(take_sample(calls[name], numbers[name]))
    stats = {name: Stats(samples[name], numbers[name]) for name in numbers}
    return stats, first_results, failures


# ------------------------------------------------------------ machine ceilings

PEAK_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "machine_peak.c")


def _peak_library():
    """machine_peak.c built (once per source and compiler, in the temporary
    directory) and loaded; None with a message on stderr when it cannot be."""
    compiler = shlex.split(os.environ.get("CC", "cc"))
    with open(PEAK_SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(compiler).encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"attnx-machine-peak-{key}.so")
    if not os.path.exists(path):
        building = path + f".{os.getpid()}"
        command = compiler + ["-O2", "-fopenmp", "-shared", "-fPIC", "-o", building, PEAK_SOURCE]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"machine peak not measured: {' '.join(command)} failed:\n{run.stderr}",
                  file=sys.stderr)
            return None
        os.replace(building, path)
    library = ctypes.CDLL(path)
    library.peak_isa.restype = ctypes.c_char_p
    library.fma_gflops.restype = ctypes.c_double
    library.fma_gflops.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int]
    library.read_gbps.restype = ctypes.c_double
    library.read_gbps.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    return library


def _last_level_cache_bytes():
    """the largest cache of CPU 0 (Linux's sysfs), or 32 MiB when unknown"""
    largest = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for entry in os.listdir(base) if os.path.isdir(base) else ():
        try:
            with open(os.path.join(base, entry, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        largest = max(largest, int(text[:-1]) * units[text[-1]] if text[-1] in units
                      else int(text))
    return largest or 32 << 20


def read_seconds(threads, nbytes, repeats=200):
    """The fastest of `repeats` reads of a buffer of `nbytes` bytes on
    `threads` threads, in seconds: the buffer is read again and again, so a
    small one is read from the cache, as a decoding step finds its state.
    None where machine_peak.c cannot be built."""
    library = _peak_library()
    if library is None:
        return None
    gbps = library.read_gbps(threads, nbytes, repeats)
    return nbytes / (gbps * 1e9) if gbps > 0 else None


@dataclass(frozen=True)
class MachinePeak:
    """The ceilings of `threads` threads: GFLOP/s of vector multiply-adds
    (2 FLOPs each) in `isa`'s widest vectors, and GB/s (1e9 bytes) read
    from a buffer of `buffer_bytes`, much larger than the last-level cache;
    each the fastest of several runs."""
    isa: str
    threads: int
    fma_f32_gflops: float
    fma_f64_gflops: float
    read_gbps: float
    buffer_bytes: int

    def flops_fraction(self, flops_per_s, dtype="float32"):
        peak = self.fma_f64_gflops if str(dtype).endswith("64") else self.fma_f32_gflops
        return flops_per_s / (peak * 1e9)

    def read_fraction(self, bytes_per_s):
        return bytes_per_s / (self.read_gbps * 1e9)

    def describe(self):
        return (f"machine peak on {self.threads} threads ({self.isa} multiply-adds): "
                f"float32 {self.fma_f32_gflops:.0f} GFLOP/s, float64 {self.fma_f64_gflops:.0f} "
                f"GFLOP/s; read bandwidth {self.read_gbps:.1f} GB/s "
                f"({self.buffer_bytes >> 20} MiB buffer)")


def machine_peak(threads, repeats=15):
    """The machine's multiply-add peak and read bandwidth on `threads`
    threads (MachinePeak), measured now: a few seconds, in short runs, so
    that some run finds the cores free on a shared machine. None where
    machine_peak.c cannot be built."""
    library = _peak_library()
    if library is None:
        return None
    buffer_bytes = min(max(256 << 20, 8 * _last_level_cache_bytes()), 1 << 30)
    steps = 300_000
    return MachinePeak(isa=library.peak_isa().decode(), threads=threads,
                       fma_f32_gflops=library.fma_gflops(threads, 0, steps, repeats),
                       fma_f64_gflops=library.fma_gflops(threads, 1, steps, repeats),
                       # threads can read at least what fewer read: on a shared
                       # machine a run on all of them is the likeliest to be slowed
                       read_gbps=max(library.read_gbps(count, buffer_bytes, repeats)
                                     for count in {1, threads}),
                       buffer_bytes=buffer_bytes)
