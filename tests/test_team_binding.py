"""attnx's decoding helper threads (csrc/team.c) under OpenMP's thread
binding. With OMP_PROC_BIND set, GNU OpenMP binds the main thread to one
place, and a thread it creates inherits that mask: the helpers would share
the caller's core, each spinning while the other works (a 32-head step took
519 us instead of 3 on two cores). The helpers must run on OpenMP's other
places instead, and keep the process's mask when nothing is bound. When
the caller and its helpers would share CPUs whatever their masks (a process
held to one CPU, asked for two threads), the helpers are not used at all:
a step then took 525 us against 15 us through OpenMP.

Each case runs in a child process, since OpenMP reads its environment once
at start-up. The helpers are found by their name, "attnx-team"."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="thread affinity and /proc/self/task are Linux's, and binding needs two CPUs")

CHILD = textwrap.dedent("""
    import json, os
    if os.environ.get("ONE_CPU"):  # as `taskset -c N python ...` would
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import numpy as np
    import attnx

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 32, 1, 64)).astype(np.float32) for _ in range(3))
    empty = q[..., :0, :]

    def decode(threads, steps=40):
        # from the 17th step of a run on, a step splits over the helpers
        attnx.set_num_threads(threads)
        state = attnx.linear_attention(empty, empty, empty, causal=True, return_state=True)[1]
        outs = [state.step(q * (t + 1) / 40, k, v).copy() for t in range(steps)]
        return np.concatenate(outs, axis=-2), state.S, state.z

    def run():
        global alone, split, caller
        caller = sorted(os.sched_getaffinity(0))
        alone = decode(1)
        split = decode(2)

    if os.environ.get("IN_THREAD"):
        # a Python thread: not bound by OpenMP, but started with the bound
        # main thread's mask
        import threading
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()

    def helper_mask(tid):
        # the joined Python thread may still be listed and then vanish (its
        # OS thread ends a moment after join() returns), between the listing
        # and either read: it is not a helper, whose threads live on
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "attnx-team":
                    return None
            return sorted(os.sched_getaffinity(int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            return None

    masks = [helper_mask(tid) for tid in os.listdir("/proc/self/task")]
    helpers = [mask for mask in masks if mask is not None]
    print(json.dumps({"main": caller, "helpers": helpers,
                      "equal": all(np.array_equal(a, b) for a, b in zip(alone, split))}))
""")


def run_child(**environment):
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OMP_", "GOMP_"))}
    env.update(environment)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bind, in_thread", [("spread", ""), ("close", ""), ("true", ""),
                                             ("spread", "1")])
def test_helpers_leave_the_callers_place_when_openmp_binds(bind, in_thread):
    """bound to one CPU, the caller's helper runs on the others, and the
    split steps equal the one-thread steps bit for bit; the same for a
    Python thread that inherited the main thread's mask"""
    got = run_child(OMP_PROC_BIND=bind, OMP_PLACES="threads", IN_THREAD=in_thread)
    assert len(got["main"]) == 1, got  # OpenMP did bind the main thread
    assert got["helpers"], got
    for cpus in got["helpers"]:
        assert cpus and not set(cpus) & set(got["main"]), got
    assert got["equal"]


def test_helpers_keep_the_process_mask_unbound():
    """no binding: a helper may run wherever the process may"""
    got = run_child()
    assert got["helpers"], got
    for cpus in got["helpers"]:
        assert cpus == got["main"], got
    assert got["equal"]


def test_no_helpers_when_they_would_share_the_callers_cpu():
    """a process held to one CPU and asked for two threads decodes through
    OpenMP, with no helper started, and gets the one-thread steps"""
    got = run_child(ONE_CPU="1")
    assert len(got["main"]) == 1, got
    assert got["helpers"] == [], got
    assert got["equal"]
