"""Helpers shared by the test suites: tolerances, random inputs, and a
runner that isolates calls which could crash the interpreter."""

import contextlib
import os
import shlex
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import attnx

CAUSAL_MODES = [False, True, "lower_right", "upper_left"]


def hypothesis_settings(default_examples):
    """ATTNX_HYPOTHESIS_EXAMPLES=1000 gives a deeper (slower) run."""
    return settings(max_examples=int(os.environ.get("ATTNX_HYPOTHESIS_EXAMPLES", default_examples)),
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tol(dtype, scale=1.0):
    scale = max(1.0, float(scale))
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return dict(rtol=1e-10, atol=1e-10 * scale)
    if dtype == np.float32:
        return dict(rtol=2e-5, atol=2e-5 * scale)
    if dtype == np.float16:
        return dict(rtol=2e-3, atol=2e-3 * scale)
    raise AssertionError(dtype)


def vscale(v):
    v = np.asarray(v, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(np.max(np.abs(v))) if v.size else 1.0


def assert_close(got, want, dtype, scale=1.0, err_msg=""):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got.astype(np.float64), want, err_msg=err_msg,
                               **tol(dtype, scale))


def make(rng, shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


def qkv(rng, lead, n, m, d, e, dtype=np.float64):
    return (make(rng, lead + (n, d), dtype), make(rng, lead + (m, d), dtype),
            make(rng, lead + (m, e), dtype))


def mixed_dtype_qkv(rng, dtypes, n=6, m=9, d=4, e=3):
    """q, k, v of the given dtypes (two heads): bool as the sign, integers
    rounded (unsigned ones from |x|), floats cast."""
    arrays = []
    for shape, dtype in zip([(2, n, d), (2, m, d), (2, m, e)], map(np.dtype, dtypes)):
        x = rng.standard_normal(shape) * 2
        if dtype == np.bool_:
            arrays.append(x > 0)
        elif dtype.kind == "u":
            arrays.append(np.abs(np.round(x)).astype(dtype))
        elif dtype.kind == "i":
            arrays.append(np.round(x).astype(dtype))
        else:
            arrays.append(x.astype(dtype))
    return arrays


def f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


# The command that starts an interpreter like this one: under user-mode
# emulation (.ci/run's qemu phases) a child started directly would run on
# the host's CPU, or not at all, so the emulator's command line comes first
# (ATTNX_TEST_EMULATOR).
PYTHON = shlex.split(os.environ.get("ATTNX_TEST_EMULATOR", "")) + [sys.executable]


def run_isolated(code, timeout=180):
    """Run code in a fresh interpreter (so that a crash or hang is a test
    failure, not the end of the test session), importing the same attnx as
    this process."""
    src = "import numpy as np, attnx\n" + textwrap.dedent(code)
    try:
        p = subprocess.run(PYTHON + ["-c", src], capture_output=True,
                           text=True, timeout=timeout,
                           cwd=os.path.dirname(os.path.dirname(
                               os.path.abspath(attnx.__file__))))
    except subprocess.TimeoutExpired:
        pytest.fail("hung (> %d s):\n%s" % (timeout, src))
    assert p.returncode == 0, "crashed or failed (rc %d):\nstdout:%s\nstderr:%s" % (
        p.returncode, p.stdout, p.stderr)
    return p.stdout


def grads_of(fn, inputs, dout):
    """fn()'s output (detached) and the gradients of sum(dout * fn()) with
    respect to the torch tensors `inputs` (None where none reaches one)"""
    for t in inputs:
        t.grad = None
    out = fn()
    out.backward(dout)
    return out.detach(), [None if t.grad is None else t.grad.clone() for t in inputs]


def traced_peak(call):
    """(call(), the peak of the memory Python and numpy allocated during it,
    in bytes: tracemalloc's)"""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


INTERRUPT = """
import os, signal, threading, time
# a shell starts a background job with SIGINT ignored, and Python then
# leaves it so: the test asks for Ctrl-C's usual handler whatever started it
signal.signal(signal.SIGINT, signal.default_int_handler)
{setup}
def call():
    {call}
print("slowdown", machine_slowdown())
sent = []
def interrupt():
    time.sleep(0.3)
    sent.append(time.perf_counter())
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt).start()
try:
    call()
    print("finished")
except KeyboardInterrupt:
    print("interrupted after", time.perf_counter() - sent[0])
{check}
print("usable")
"""


# The time of one small softmax call on one thread, the median of five:
# about 0.35 ms on the machine CI runs on (0.5 ms with 8 processes busy on
# its 2 cores, more when they take its turns). Under emulation (qemu,
# .ci/run) it is tens of times that.
UNIT_CALL_SECONDS = 0.002

MACHINE_SLOWDOWN = """
def machine_slowdown():
    import numpy as np, time
    threads = attnx.get_num_threads()
    attnx.set_num_threads(1)
    x = np.ones((1, 512, 64), np.float32)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        attnx.softmax_attention(x, x, x)
        times.append(time.perf_counter() - start)
    attnx.set_num_threads(threads)
    return max(1.0, sorted(times)[2] / %r)
""" % UNIT_CALL_SECONDS


def assert_interrupted_quickly(setup, call, check):
    """In a fresh interpreter, after the code `setup`, the long `call`
    (several seconds whole) ends with KeyboardInterrupt within 0.5 s of a
    SIGINT sent 0.3 s in, and `check` (attnx still usable and right) then
    runs. On a machine loaded by other processes one try may be descheduled
    for longer: the best of three counts. On a machine that computes more
    slowly than CI's (emulated), the call's work items, and so the wait for
    the next check, take longer: the 0.5 s grows by the ratio of a small
    call's time there to its time on CI's machine (UNIT_CALL_SECONDS), as
    the whole call does."""
    script = INTERRUPT.format(setup=MACHINE_SLOWDOWN + textwrap.dedent(setup), call=call,
                              check=textwrap.dedent(check))
    latencies, allowed = [], 0.5
    for _ in range(3):
        stdout = run_isolated(script, timeout=600)
        lines = stdout.split("\n")
        assert lines[0].startswith("slowdown"), stdout
        allowed = 0.5 * float(lines[0].split()[-1])
        assert lines[1].startswith("interrupted after"), stdout
        assert "usable" in stdout
        latencies.append(float(lines[1].split()[-1]))
        if latencies[-1] < allowed:
            break
    assert min(latencies) < allowed, (latencies, allowed)


@contextlib.contextmanager
def dispatched(disabled=None, **limits):
    """Every family's kernels chosen again for the block (attnx._C._set_dispatch,
    the code import runs): as ATTNX_DISABLE_CPU_FEATURES=disabled would choose
    them (None: the features left out now, as the environment said at
    import), each family named in limits held to that kernel set or a lesser
    one of its table (csrc/dispatch.c)."""
    if disabled is None:
        disabled = ",".join(attnx._C.build_info()["disabled_cpu_features"])
    before = attnx._C._set_dispatch(disabled, limits)
    try:
        yield attnx.cpu_dispatch()
    finally:
        attnx._C._set_dispatch(*before)


@contextlib.contextmanager
def backward_blocks(side):
    """The softmax backward's query and key blocks held at side x side (64 or
    128) for the block; otherwise the L2 of this CPU's cores chooses
    (csrc/softmax_backward.c)."""
    before = attnx._C._softmax_backward_block(side)
    try:
        yield side
    finally:
        attnx._C._softmax_backward_block(before)


def cpuinfo_field(name):
    """A field of Linux's /proc/cpuinfo for the first CPU ("flags",
    "vendor_id", ...) as its text, or None where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo
                         if line.split(":", 1)[0].strip() == name), None)
    except OSError:
        return None


def kernel_set_params(family, *names):
    """pytest params of the kernel sets `names` of `family`, each skipped
    where this CPU or build does not have it."""
    here = kernels_here(family)
    return [pytest.param(name, marks=pytest.mark.skipif(
        name not in here, reason=f"this CPU or build has no {name} set for {family}"))
        for name in names]


def kernels_here(family):
    """The kernel sets `family` can run on this CPU and build, best first,
    less those the features left out rule out: those its table gives when
    held to each set in turn."""
    sets = []
    for name in ("amx", "avx512_group", "avx512_bf16", "avx512", "avx2", "neon", "plain"):
        try:
            with dispatched(**{family: name}) as chosen:
                if chosen[family] not in sets:
                    sets.append(chosen[family])
        except ValueError:      # not in this family's table, or not in this build
            pass
    return sets


@st.composite
def strided_layouts(draw):
    """(base shape, view): a view of 0-4 axes taken with steps, reversals,
    a transpose and a broadcast (stride 0) axis, its last axis contiguous
    or not."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=ndim, max_size=ndim)))
    steps = tuple(draw(st.sampled_from([1, 2, -1])) for _ in shape)
    swap = ndim >= 2 and draw(st.booleans())
    broadcast = draw(st.integers(0, ndim - 1)) if ndim and draw(st.booleans()) else None

    def view(base):
        v = base[tuple(slice(None, None, step) for step in steps)]
        v = v[tuple(slice(0, s) for s in shape)]
        if swap:
            v = v.swapaxes(0, -1)
        if broadcast is not None:
            v = np.broadcast_to(v.take(range(min(1, v.shape[broadcast])), axis=broadcast), v.shape)
        return v

    return tuple(2 * s + 1 for s in shape), view


def half_value(bits, exponent_bits):
    """16-bit floating-point bits -> value in float64 from the fields: a
    sign, `exponent_bits` of exponent (5 for float16, 8 for bfloat16), the
    rest fraction; subnormals at exponent 0, infinity and NaN at the
    largest."""
    fraction_bits = 15 - exponent_bits
    bias, top = (1 << (exponent_bits - 1)) - 1, (1 << exponent_bits) - 1
    bits = np.asarray(bits, dtype=np.uint16).astype(np.int64)
    sign = np.where(bits >> 15, -1.0, 1.0)
    exponent, fraction = (bits >> fraction_bits) & top, bits & ((1 << fraction_bits) - 1)
    fraction = fraction / float(1 << fraction_bits)
    normal = np.ldexp(1.0 + fraction, exponent - bias)
    subnormal = np.ldexp(fraction, 1 - bias)
    value = np.where(exponent == 0, subnormal, normal)
    value = np.where(exponent == top, np.where(fraction == 0, np.inf, np.nan), value)
    return sign * value


def check_random_narrowing_on_every_path(narrow, check):
    """2^20 random float32 bit patterns narrowed by `narrow` on each
    conversion path this CPU has: each result passes `check(x, got)`, and
    every path gives the plain path's bits, NaN payloads included."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint32).view(np.float32)
    results = {}
    for name in kernels_here("convert"):
        with dispatched(convert=name):
            results[name] = narrow(x)
        check(x, results[name])
    for name, result in results.items():
        np.testing.assert_array_equal(result, results["plain"], err_msg=name)
