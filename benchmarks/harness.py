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
"""
import gc
import math
import statistics
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
