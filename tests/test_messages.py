"""The messages of bad calls: every front end validates its arrays in one
place (csrc/args.c), so a core shape that does not fit gets the same
message everywhere, naming the argument, its shape and the expected shape
with the sizes filled in; sizes the kernels cannot take are refused before
anything is copied."""
import os
import re

import numpy as np
import pytest

import attnx

from helpers import run_isolated  # noqa: E402

SOFTMAX_FAMILY = [attnx.softmax_attention, attnx.gaussian_attention]


def _qkv(lead=(2,), n=4, m=5, d=3, e=2):
    rng = np.random.default_rng(7)
    return (rng.standard_normal(lead + (n, d)), rng.standard_normal(lead + (m, d)),
            rng.standard_normal(lead + (m, e)))


def _message(fn, *args, error=ValueError, **kwargs):
    with pytest.raises(error) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("fn", SOFTMAX_FAMILY)
def test_core_shape_message_names_argument_shape_and_expectation(fn):
    q, k, v = _qkv()
    assert _message(fn, q, k[..., :2], v) == (
        "k has shape (2, 5, 2), expected (..., m, d) = (..., 5, 3) (d from q)")
    assert _message(fn, q, k, v[:, :4]) == (
        "v has shape (2, 4, 2), expected (..., m, e) = (..., 5, 2) (m from k)")
    assert _message(fn, q[0, 0], k, v) == "q has shape (3,), expected (..., n, d)"
    assert _message(fn, q, k, v, mask=np.ones((3, 5), bool)) == (
        "mask has shape (3, 5), expected to broadcast to (..., n, m) = (..., 4, 5) (n from q)")
    assert _message(fn, q, k, v, bias=np.ones((4, 6))) == (
        "bias has shape (4, 6), expected to broadcast to (..., n, m) = (..., 4, 5) (m from k)")
    assert _message(fn, q, k, v, out=np.empty((2, 4, 3))) == (
        "out has shape (2, 4, 3), expected (2, 4, 2): (..., n, e) over the batch shape")


def test_gaussian_sigma_out_of_range_prints_the_number():
    q, k, v = _qkv()
    for sigma, shown in ((1e-300, "1e-300"), (1e300, "1e+300")):
        message = _message(attnx.gaussian_attention, q, k, v, sigma=sigma)
        assert message.startswith("sigma=%s is out of range" % shown), message
        assert "%" not in message


# k and v of 2**31 + 1 keys, broadcast from one row (4 bytes of data): a
# copy would need 32 GiB. The check must come first, so it runs under an
# address-space limit that such a copy would hit.
HUGE_BROADCAST = """
    import os, resource
    # AddressSanitizer reserves terabytes of shadow address space, so the
    # limit is left off in the sanitizer run (tests/run_sanitizers.sh)
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    big = 2 ** 31 + 1
    q = np.zeros((4, 4), np.float32)
    k = np.broadcast_to(np.zeros(4, np.float32), (big, 4))
    v = np.broadcast_to(np.zeros(2, np.float32), (big, 2))
    wide = np.broadcast_to(np.zeros(1, np.float32), (5, big))
    calls = {CALLS}
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            print(name, "ValueError:", exc)
        except MemoryError as exc:
            print(name, "MemoryError:", exc)
        else:
            print(name, "NO ERROR")
"""


def test_huge_broadcast_sizes_refused_before_any_copy():
    calls = """{
        "softmax m": lambda: attnx.softmax_attention(q, k, v),
        "gaussian m": lambda: attnx.gaussian_attention(q, k, v),
        "softmax e": lambda: attnx.softmax_attention(q[:, :4], k[:5], wide),
        "softmax d": lambda: attnx.softmax_attention(wide[:4], wide, v[:5]),
    }"""
    out = run_isolated(HUGE_BROADCAST.replace("{CALLS}", calls))
    lines = {" ".join(line.split(" ")[:2]): line for line in out.splitlines()}
    assert len(lines) == 4, out
    for name, symbol, source in (("softmax m", "m", "k"), ("gaussian m", "m", "k"),
                                 ("softmax e", "e", "v"), ("softmax d", "d", "q")):
        assert re.search(r"ValueError: %s: %s = 2147483649 is too large: the kernels take "
                         r"d, e, m below 2\*\*31$" % (source, symbol), lines[name]), out


def test_linear_core_shape_messages():
    q, k, v = _qkv(n=4, m=4)
    assert _message(attnx.linear_attention, q, k[..., :2], v) == (
        "k has shape (2, 4, 2), expected (..., m, d) = (..., 4, 3) (d from q)")
    assert _message(attnx.linear_attention, q, k, v, key_mask=np.ones((2, 5), bool)) == (
        "key_mask has shape (2, 5), expected to broadcast to (..., m) = (..., 4) (m from k)")
    assert _message(attnx.performer_attention, q, k, v, projection=np.ones((5, 4))) == (
        "projection has shape (5, 4), expected (r, d) = (5, 3) (d from q)")


def test_state_messages_name_the_array_and_its_own_expected_shape():
    q, k, v = _qkv(n=4, m=4)
    _, state = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    legend = "; r: the features of this feature map"
    # z of the wrong size names z's own shape (it used to name S's (..., r, e))
    wrong_z = attnx.LinearAttentionState(state.S, state.z[..., :2], state.offset)
    assert _message(attnx.linear_attention, q, k, v, causal=True, initial_state=wrong_z) == (
        "initial_state.z has shape (2, 2), expected (..., r) = (..., 3)" + legend)
    # r of another feature map (taylor: d + 1)
    assert _message(attnx.linear_attention, q, k, v, causal=True, initial_state=state,
                    feature_map="taylor") == (
        "initial_state.S has shape (2, 3, 2), expected (..., r, e) = (..., 4, 2)" + legend)
    assert _message(attnx.linear_attention, q, k, v[..., :1], causal=True,
                    initial_state=state) == (
        "initial_state.S has shape (2, 3, 2), expected (..., r, e) = (..., 3, 1) (e from v)"
        + legend)
    assert _message(attnx.linear_attention, *(x.astype(np.float32) for x in (q, k, v)),
                    causal=True, initial_state=state, error=TypeError) == (
        "initial_state.S must have dtype dtype('float32'), the dtype this call computes in, "
        "got dtype('float64')")
    # the same through state.step, which names the state it updates
    state.z = state.z[..., :2].copy()
    assert _message(state.step, q[:, :1], k[:, :1], v[:, :1]) == (
        "state.z has shape (2, 2), expected (..., r) = (..., 3)" + legend)


def test_linear_huge_broadcast_sizes_refused_before_any_copy():
    calls = """{
        "linear m": lambda: attnx.linear_attention(q[:, :3], k[:, :3], v),
        "causal m": lambda: attnx.linear_attention(q[:, :3], k[:, :3], v, causal=True),
        "linear e": lambda: attnx.linear_attention(q[:, :3], k[:5, :3], wide),
    }"""
    out = run_isolated(HUGE_BROADCAST.replace("{CALLS}", calls))
    lines = {" ".join(line.split(" ")[:2]): line for line in out.splitlines()}
    assert len(lines) == 3, out
    for name, symbol, source in (("linear m", "m", "k"), ("causal m", "m", "k"),
                                 ("linear e", "e", "v")):
        assert re.search(r"ValueError: %s: %s = 2147483649 is too large: the kernels take "
                         r"d, e, m, r below 2\*\*31$" % (source, symbol), lines[name]), out


@pytest.mark.parametrize("missing", ["q", "k", "v"])
def test_a_required_array_given_as_none_is_a_type_error(missing):
    # found by the fuzz test: None for k reached the kernel as a NULL pointer
    arrays = {name: np.ones((3, 4)) for name in ("q", "k", "v")}
    arrays[missing] = None
    for front in (attnx.softmax_attention, attnx.gaussian_attention, attnx.linear_attention,
                  attnx.cosformer_attention):
        with pytest.raises(TypeError, match=f"{missing} must be an array, got None"):
            front(arrays["q"], arrays["k"], arrays["v"])
    q = np.ones((3, 4))
    out, lse = attnx.softmax_attention(q, q, q, return_lse=True)
    for name, args in (("dout", (None, q, q, q, out, lse)), ("out", (out, q, q, q, None, lse)),
                       ("lse", (out, q, q, q, out, None))):
        with pytest.raises(TypeError, match=f"{name} must be an array, got None"):
            attnx.softmax_attention_backward(*args)
    with pytest.raises(TypeError, match="dout must be an array, got None"):
        attnx.linear_attention_backward(None, q, q, q)
