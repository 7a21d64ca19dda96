"""What is measured: the cases, their inputs, FLOP counts and competitors.

A case is one shape of one variant. Its competitors are zero-argument calls
built by the BUILDERS table (kind -> competitor name -> builder); the timed
competitors of a kind are listed in COMPETITORS, attnx first. A peer that
would need too much memory or time at a shape is skipped with a reason.
"""
from dataclasses import dataclass
from functools import partial

import importlib
import os
import sys

import numpy as np

import peers

MEMORY_LIMIT = 4 * 2**30          # skip a peer whose working set would exceed this
RECURRENT_MAX_N = 1024            # the torch loop over tokens is too slow beyond this
WINDOW = (256, 0)                 # window cases: 256 keys back, causal
DECODE_HEADS = 32
LINEAR_CHUNK = 16                 # attnx's default chunk_size at r = e = 64, as the FLOPs count it
SEED = 2024
GEMM_N = 2048                     # the reference gemm is GEMM_N^3
FLOP_KINDS = ("softmax", "window", "linear")   # cases timed beside the gemm


@dataclass(frozen=True)
class Case:
    kind: str                     # gemm | softmax | window | linear | decode | tiny
    n: int
    batch: int = 1
    heads: int = 8
    d: int = 64
    dtype: str = "float32"
    causal: bool = False
    key_padding: bool = False     # the last quarter of the keys are padding

    @property
    def window(self):
        return WINDOW if self.kind == "window" else None

    @property
    def series(self):
        """The plot line this case belongs to: the label without n; None for
        one-off shapes that are not plotted against n."""
        if self.kind not in FLOP_KINDS or self.key_padding or self.d != 64:
            return None
        return self._describe(with_n=False)

    @property
    def label(self):
        return self._describe(with_n=True)

    def _describe(self, with_n):
        if self.kind == "decode":
            return "decode 1 token, %d heads, d=%d" % (self.heads, self.d)
        if self.kind == "tiny":
            return "tiny n=m=%d, d=%d" % (self.n, self.d)
        words = [self.kind]
        if self.kind == "window":
            words.append("(%d,%d)" % WINDOW)
        if self.kind == "linear":
            words.append("elu")
        if self.kind != "gemm":
            words += ["causal" if self.causal else "full", self.dtype.replace("float", "f"),
                      "b%d" % self.batch]
            if self.d != 64:
                words.append("d%d" % self.d)
            if self.key_padding:
                words.append("keypad")
        if with_n:
            words.append("n=%d" % self.n)
        return " ".join(words)

    @property
    def key(self):
        """Command-line name of the case (memory.py --case)."""
        return self.label.replace(" ", "-").replace("=", "").replace("(", "").replace(")", "").replace(",", "_")

    @property
    def itemsize(self):
        return np.dtype(self.dtype).itemsize

    @property
    def heads_total(self):
        return self.batch * self.heads


# ------------------------------------------------------------ case lists

def gemm_case(dtype):
    return Case("gemm", GEMM_N, dtype=dtype)


def gemm_cases():
    return [gemm_case("float32"), gemm_case("float64")]


def softmax_cases(quick):
    if quick:
        return [Case("softmax", n, causal=c) for n in (512, 2048) for c in (False, True)]
    cases = [Case("softmax", n, batch=b, dtype=t, causal=c)
             for t in ("float32", "float64") for b in (1, 8)
             for n in (128, 512, 2048, 8192) for c in (False, True)
             if n <= 2048 or (t == "float32" and b == 1)]
    cases += [Case("softmax", 2048, causal=c, key_padding=True) for c in (False, True)]
    cases.append(Case("softmax", 2048, d=128))
    return cases


def window_cases(quick):
    return [] if quick else [Case("window", n, causal=True) for n in (4096, 16384, 65536)]


def linear_cases(quick):
    return [Case("linear", n, causal=True) for n in ((8192,) if quick else (1024, 8192, 65536))]


def overhead_cases():
    return [Case("decode", 1, heads=DECODE_HEADS, causal=True), Case("tiny", 4, heads=1, d=8)]


def timed_cases(quick):
    return softmax_cases(quick) + window_cases(quick) + linear_cases(quick) + overhead_cases()


# ------------------------------------------------------------ FLOP counts

def visible_pairs(n, m, causal=False, window=None, key_valid=None):
    """Number of (query, key) pairs attention must combine, counted exactly
    (lower-right alignment, as attnx defines causal and window)."""
    rows = np.arange(n, dtype=np.int64) + (m - n)
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    first = np.zeros(n, np.int64) if left is None else np.clip(rows - left, 0, m)
    end = np.full(n, m, np.int64) if right is None else np.clip(rows + right + 1, 0, m)
    end = np.maximum(end, first)
    if key_valid is None:
        return int((end - first).sum())
    valid_before = np.concatenate([[0], np.cumsum(key_valid, dtype=np.int64)])
    return int((valid_before[end] - valid_before[first]).sum())


def linear_chunk_flops_per_head(n, r, e, chunk):
    """GEMM arithmetic of the chunked causal form, chunk sizes c:
    intra 2c^2 r (masked q k^T) + 2c^2 e (weights @ v),
    inter 2c r e (q @ S) + 2 r e c (S += k^T v); feature map not counted."""
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    return sum(2 * c * c * (r + e) + 4 * c * r * e for c in sizes)


FLOP_FORMULAS = {
    "gemm": "2 n^3",
    "softmax": "2 (d + e) x visible pairs per head (4 n m d when nothing is masked)",
    "linear": "per chunk of c: 2c^2 r + 2c^2 e + 2c r e + 2 r e c per head (r = d for elu); "
              "feature map not counted",
}


def case_flops(case):
    if case.kind == "gemm":
        return 2 * case.n ** 3
    if case.kind in ("softmax", "window"):
        pairs = visible_pairs(case.n, case.n, case.causal, case.window,
                              key_valid_mask(case) if case.key_padding else None)
        return case.heads_total * 2 * (case.d + case.d) * pairs
    if case.kind == "linear":
        return case.heads_total * linear_chunk_flops_per_head(case.n, case.d, case.d, LINEAR_CHUNK)
    return None


# ------------------------------------------------------------ inputs

@dataclass
class Inputs:
    q: np.ndarray        # (batch, heads, n, d)
    k: np.ndarray
    v: np.ndarray
    key_valid: np.ndarray = None     # (n,) bool or None


def key_valid_mask(case):
    valid = np.ones(case.n, dtype=bool)
    valid[case.n - case.n // 4:] = False
    return valid


def make_inputs(case, seed=SEED):
    rng = np.random.default_rng(seed)
    if case.kind == "gemm":
        shape = (case.n, case.n)
    else:
        shape = (case.batch, case.heads, case.n, case.d)
    q, k, v = (rng.standard_normal(shape, dtype=np.dtype(case.dtype).type) for _ in range(3))
    return Inputs(q, k, v, key_valid_mask(case) if case.key_padding else None)


def tensors(x):
    return tuple(peers.torch_tensor(a) for a in (x.q, x.k, x.v))


# ------------------------------------------------------------ competitors

def softmax_visibility(case, x):
    return peers.visibility(case.n, case.n, case.causal, case.window, x.key_valid)


def attnx_softmax(case, x, attnx):
    mask = None if x.key_valid is None else x.key_valid[None, :]
    return partial(attnx.softmax_attention, x.q, x.k, x.v, causal=case.causal,
                   mask=mask, window=case.window)


def torch_sdpa(case, x, attnx):
    only_causal = case.causal and case.window is None and x.key_valid is None
    mask = None if only_causal else peers.torch_tensor(softmax_visibility(case, x))
    return partial(peers.torch_sdpa, *tensors(x), causal=only_causal, mask=mask)


def numpy_softmax(case, x, attnx):
    return partial(peers.numpy_softmax_attention, x.q, x.k, x.v, softmax_visibility(case, x))


def attnx_linear(method):
    def build(case, x, attnx):
        return partial(attnx.linear_attention, x.q, x.k, x.v, causal=True, method=method,
                       chunk_size=LINEAR_CHUNK)
    return build


def torch_call(function):
    def build(case, x, attnx):
        return partial(function, *tensors(x))
    return build


def numpy_call(function):
    def build(case, x, attnx):
        return partial(function, x.q, x.k, x.v)
    return build


def attnx_decoder(case, x, attnx):
    """One token per call, the state carried from call to call."""
    state = None

    def step():
        nonlocal state
        out, state = attnx.linear_attention(x.q, x.k, x.v, causal=True,
                                            initial_state=state, return_state=True)
        return out
    return step


def attnx_step_decoder(case, x, attnx):
    """One token per call through LinearAttentionState.step (in place),
    starting from the state of an empty sequence."""
    empty = x.q[..., :0, :]
    _, state = attnx.linear_attention(empty, empty, empty, causal=True, return_state=True)
    return partial(state.step, x.q, x.k, x.v)


def peer_decoder(step_function, as_arrays, zeros):
    def build(case, x, attnx):
        q, k, v = as_arrays(x)
        lead = x.q.shape[:-2]
        state = (zeros(lead + (case.d, case.d), x.q.dtype), zeros(lead + (1, case.d), x.q.dtype))
        return partial(step_function, q, k, v, state)
    return build


def torch_zeros(shape, dtype):
    return peers.torch_tensor(np.zeros(shape, dtype))


def empty_call(*args):
    return None


def with_output(build):
    """The same attnx call writing into an output allocated once, outside the
    timing (out=): the kernel without the page faults of a fresh output,
    which at n = 65536 (128 MiB) cost from 15 ms to hundreds of ms per call
    here, as the host hands memory back."""
    def built(case, x, attnx):
        call = build(case, x, attnx)
        return partial(call, out=np.empty(x.q.shape[:-1] + x.v.shape[-1:], x.q.dtype))
    return built


BUILDERS = {
    "gemm": {"numpy-openblas": lambda case, x, attnx: partial(peers.numpy_sgemm, x.q, x.k)},
    "softmax": {"attnx": attnx_softmax, "torch-sdpa": torch_sdpa, "numpy": numpy_softmax},
    "linear": {
        "attnx": attnx_linear("chunk"),
        "attnx-out": with_output(attnx_linear("chunk")),
        "attnx-cumsum": attnx_linear("cumsum"),
        "torch-recurrent": torch_call(peers.torch_linear_recurrent),
        "torch-cumsum": torch_call(peers.torch_linear_cumsum),
        "torch-chunked": torch_call(peers.torch_linear_chunked),
        "torch-chunked-par": torch_call(peers.torch_linear_chunked_parallel),
        "numpy-chunked": numpy_call(peers.numpy_linear_causal_chunked),
    },
    "decode": {
        "attnx": attnx_decoder,
        "attnx-step": attnx_step_decoder,
        "torch-step": peer_decoder(peers.torch_linear_step, tensors, torch_zeros),
        "numpy-step": peer_decoder(peers.numpy_linear_step, lambda x: (x.q, x.k, x.v), np.zeros),
    },
    "tiny": {
        "attnx": attnx_softmax,
        "torch-sdpa": torch_sdpa,
        "empty-call": lambda case, x, attnx: partial(empty_call, x.q, x.k, x.v),
    },
}
BUILDERS["window"] = dict(BUILDERS["softmax"], **{"attnx-out": with_output(attnx_softmax)})

COMPETITORS = {
    "gemm": ["numpy-openblas"],
    "softmax": ["attnx", "torch-sdpa", "numpy"],
    "window": ["attnx", "attnx-out", "torch-sdpa", "numpy"],
    "linear": ["attnx", "attnx-out", "torch-recurrent", "torch-cumsum", "torch-chunked", "torch-chunked-par",
               "numpy-chunked"],
    "decode": ["attnx", "attnx-step", "torch-step", "numpy-step"],
    "tiny": ["attnx", "torch-sdpa", "empty-call"],
}

ATTNX_FUNCTION = {"softmax": "softmax_attention", "window": "softmax_attention",
                  "tiny": "softmax_attention", "linear": "linear_attention",
                  "decode": "linear_attention"}


def peer_working_set(case, name):
    """Rough peak bytes a peer allocates beyond its inputs and output."""
    n, size = case.n, case.itemsize
    dense_mask = n * n if (case.causal or case.key_padding or case.window) else 0
    if name == "numpy" and case.kind in ("softmax", "window"):
        return case.heads_total * n * n * size + 2 * dense_mask
    if name == "torch-sdpa" and case.kind == "window":
        return dense_mask * (1 + size)            # the bool mask and its float copy
    if name == "torch-cumsum":
        return 2 * case.heads_total * n * case.d * case.d * size
    return 0


def skip_reason(case, name, quick=False):
    if name == "torch-recurrent" and case.n > RECURRENT_MAX_N:
        return "loop over tokens too slow; measured at n <= %d only (full run)" % RECURRENT_MAX_N
    if name == "torch-cumsum" and quick:
        return "seconds per call (fresh multi-GB prefix states); timed in the full run only"
    working_set = peer_working_set(case, name)
    if working_set > MEMORY_LIMIT:
        return "would need %.1f GB (> %.0f GB)" % (working_set / 1e9, MEMORY_LIMIT / 2**30)
    return None


def build_call(case, inputs, name, attnx):
    return BUILDERS[case.kind][name](case, inputs, attnx)


def load_attnx():
    """The attnx under test: the importable one, else the one built in place
    in this checkout (the parent of benchmarks/). Raises ImportError."""
    try:
        return importlib.import_module("attnx")
    except ImportError:
        sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        return importlib.import_module("attnx")


def attnx_requirement(case, name="attnx"):
    """The attribute path of attnx an attnx competitor calls."""
    return "LinearAttentionState.step" if name == "attnx-step" else ATTNX_FUNCTION[case.kind]


def attnx_supports(case, attnx, name="attnx"):
    found = attnx
    for part in attnx_requirement(case, name).split("."):
        found = getattr(found, part, None)
    return found is not None
