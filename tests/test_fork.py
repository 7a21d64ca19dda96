"""attnx in processes created by fork (multiprocessing's default start method
on Linux: Pools, DataLoader workers).

GNU OpenMP cannot run a parallel region in a forked child once the parent
has started its worker threads: the child waits for threads it does not
have. attnx therefore runs single-threaded in a forked child. Each test
first makes multi-threaded calls in this process, so the pool exists when
the child is forked, and bounds the child by a timeout (a hang is killed and
reported, never left to stall the suite)."""
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import attnx

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"),
                                reason="os.fork does not exist on this platform")

CHILD_TIMEOUT = 60  # seconds; the calls themselves take milliseconds


def _inputs():
    rng = np.random.default_rng(20)
    # 8 heads of n = 512, d = 64: large enough that both kernels split the
    # work over every thread they are given
    q, k, v = (rng.standard_normal((2, 4, 512, 64), dtype=np.float32) for _ in range(3))
    return q, k, v


def _calls(q, k, v):
    return [attnx.softmax_attention(q, k, v, causal=True),
            attnx.linear_attention(q, k, v, causal=True),
            attnx.linear_attention(q, k, v, causal=True, method="cumsum"),
            attnx.performer_attention(q, k, v, num_features=32, seed=0)]


@pytest.fixture
def two_threads():
    before = attnx.get_num_threads()
    attnx.set_num_threads(2)
    yield
    attnx.set_num_threads(before)


def _wait_for_child(pid):
    """The child's exit code, or a failure naming the hang after killing it."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung (killed after {CHILD_TIMEOUT} s)")


def _fork_and_run(child):
    """Run child() in a forked process; its return value is the exit code
    (any exception: 99)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    return _wait_for_child(pid)


def test_forked_child_computes_after_parent_used_threads(two_threads):
    q, k, v = _inputs()
    expected = _calls(q, k, v)  # starts the OpenMP pool in this process

    def child():
        got = _calls(q, k, v)
        # threads split heads and tiles without changing any sum's order
        return 0 if all(np.array_equal(a, b) for a, b in zip(got, expected)) else 3

    assert _fork_and_run(child) == 0


def test_forked_child_runs_single_threaded(two_threads):
    q, k, v = _inputs()
    _calls(q, k, v)

    def child():
        if attnx.get_num_threads() != 1:
            return 4
        attnx.set_num_threads(2)  # kept at 1: two threads would hang here
        if attnx.get_num_threads() != 1:
            return 5
        _calls(q, k, v)
        return 0

    assert _fork_and_run(child) == 0
    assert attnx.get_num_threads() == 2  # the parent keeps its threads


def test_grandchild_of_fork(two_threads):
    q, k, v = _inputs()
    expected = _calls(q, k, v)

    def grandchild():
        return 0 if np.array_equal(_calls(q, k, v)[0], expected[0]) else 3

    def child():
        _calls(q, k, v)
        return _fork_and_run(grandchild)

    assert _fork_and_run(child) == 0


def _pool_task(index):
    q, k, v = _inputs()
    return (attnx.softmax_attention(q[index], k[index], v[index], causal=True),
            attnx.linear_attention(q[index], k[index], v[index], causal=True))


def test_multiprocessing_fork_pool(two_threads):
    q, k, v = _inputs()
    expected_softmax, expected_linear = _calls(q, k, v)[:2]
    pool = multiprocessing.get_context("fork").Pool(2)
    try:
        results = pool.map_async(_pool_task, range(q.shape[0])).get(timeout=CHILD_TIMEOUT)
    except multiprocessing.TimeoutError:
        pytest.fail(f"a fork Pool worker hung (> {CHILD_TIMEOUT} s)")
    finally:
        pool.terminate()
        pool.join()
    for index, (softmax_out, linear_out) in enumerate(results):
        np.testing.assert_array_equal(softmax_out, expected_softmax[index])
        np.testing.assert_array_equal(linear_out, expected_linear[index])


def test_forked_child_decodes_after_parent_used_its_team(two_threads):
    """Decoding steps run on attnx's own helper threads (team.c), which a
    forked child does not have: its steps run on one thread"""
    rng = np.random.default_rng(21)
    # runs of 38 steps: the team takes them from the 17th on (team.c)
    q, k, v = (rng.standard_normal((2, 16, 40, 64), dtype=np.float32) for _ in range(3))

    def decode():
        _, state = attnx.linear_attention(q[..., :2, :], k[..., :2, :], v[..., :2, :],
                                          causal=True, return_state=True)
        return [state.step(q[..., t:t + 1, :].copy(), k[..., t:t + 1, :].copy(),
                           v[..., t:t + 1, :].copy()) for t in range(2, 40)]

    expected = decode()  # the team's helpers now exist in this process

    def child():
        return 0 if all(np.array_equal(a, b) for a, b in zip(decode(), expected)) else 3

    assert _fork_and_run(child) == 0
