"""Random, mostly wrong calls of every public function, for tests/test_fuzz.py:
the forward functions, their backward functions, LinearAttentionState.step
and the operators of attnx.torch (forward, and backward through autograd).

Run as a script in a child process: `python fuzz_calls.py SEED COUNT`. Each
call is printed (and flushed) before it runs, so when the process dies the
last line names the call that killed it. A call may return or raise
ValueError, TypeError or MemoryError (the documented errors, see
docs/conventions.md); any other exception is printed as UNEXPECTED. The
last line is "done" when every call came back. A torch operator may also
raise RuntimeError, which is how torch itself refuses some calls (autograd
on a tensor that needs no gradient, say)."""
import sys

import numpy as np

import attnx



class FeatureMapFailure(Exception):
    """Raised by a callable feature map; it must reach the caller as is."""


EXPECTED = (ValueError, TypeError, MemoryError, FeatureMapFailure)


class Draw:
    """Random arguments: mostly plausible shapes with a share of wrong
    sizes, dtypes, layouts and option values."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def pick(self, options):
        return options[self.rng.integers(len(options))]

    def chance(self, p):
        return self.rng.random() < p

    def size(self):
        return int(self.pick([0, 1, 1, 2, 3, 4, 5, 7, 8, 16, 17]))

    def dtype(self):
        return self.pick([np.float64, np.float64, np.float32, np.float32, np.float16,
                          np.int32, np.bool_, np.complex64, object])

    def values(self, shape, dtype=None):
        dtype = dtype or self.dtype()
        x = self.rng.standard_normal(shape) * self.pick([1.0, 1.0, 10.0, 1e-30, 1e30])
        if self.chance(0.1) and x.size:
            x.flat[self.rng.integers(x.size)] = self.pick([np.nan, np.inf, -np.inf])
        if dtype is object:
            return np.asarray(x).astype(object)
        with np.errstate(all="ignore"):
            return np.asarray(x).astype(dtype)

    def array(self, shape, dtype=None):
        """An array of `shape`, sometimes strided, transposed or broadcast,
        sometimes of a slightly wrong shape, sometimes not an array."""
        if self.chance(0.03):
            return self.pick([None, 3.0, "q", [1.0, 2.0]])
        shape = list(shape)
        if self.chance(0.1) and shape:
            axis = self.rng.integers(len(shape))
            shape[axis] = self.size()
        if self.chance(0.05):
            shape = shape[1:]
        shape = tuple(shape)
        kind = self.rng.integers(5)
        if kind == 0 and len(shape) >= 1:  # every other element of the last axis
            return self.values(shape[:-1] + (2 * shape[-1],), dtype)[..., ::2]
        if kind == 1 and len(shape) >= 2:  # a transposed view
            return self.values(shape[:-2] + shape[-2:][::-1], dtype).swapaxes(-1, -2)
        if kind == 2 and len(shape) >= 2:  # a broadcast (stride 0) row axis
            row = self.values(shape[:-2] + (1, shape[-1]), dtype)
            return np.broadcast_to(row, shape)
        x = self.values(shape, dtype)
        if self.chance(0.05) and x.ndim:
            x = x.copy(order="F") if x.ndim > 1 else x
        if self.chance(0.05):
            x.flags.writeable = False
        return x

    def qkv(self):
        lead = tuple(self.pick([1, 2, 3]) for _ in range(self.rng.integers(0, 3)))
        n, m, d, e = self.size(), self.size(), self.size(), self.size()
        dtype = self.dtype() if self.chance(0.2) else self.pick([np.float32, np.float64])
        return (self.array(lead + (n, d), dtype), self.array(lead + (m, d), dtype),
                self.array(lead + (m, e), dtype), lead, n, m, d, e)

    def causal(self):
        return self.pick([False, True, True, "lower_right", "upper_left", "sideways", 1, None])

    def window(self):
        return self.pick([None, None, 0, 1, 3, -1, (2, 0), (None, 1), (1, None), (None, None),
                          (1,), 2.5, "w", 2**62])

    def mask(self, lead, n, m):
        if self.chance(0.6):
            return None
        shape = self.pick([lead + (n, m), (1, m), (n, 1), (m,), lead + (1, m)])
        return self.array(shape, self.pick([np.bool_, np.bool_, np.float32, np.int8]))

    def out(self, lead, n, e, dtype):
        if self.chance(0.8):
            return None
        return self.array(lead + (n, e), self.pick([dtype, np.float32, np.float64]))

    def feature_map(self, d):
        def bad_shape(x):
            return np.ones(np.shape(x)[:-1] + (3,))[..., None, :]

        def no_features(x):
            return np.zeros(np.shape(x)[:-1] + (0,))

        def negative(x):
            return -np.abs(np.asarray(x, float)) - 1

        def not_array(x):
            return "features"

        def raises(x):
            raise FeatureMapFailure("feature map failed")

        return self.pick(["elu", "relu", "softmax", "taylor", "focused", "favor", "identity",
                          "bogus", None, np.abs, np.exp, no_features,
                          bad_shape, negative, not_array, raises])


def softmax_call(draw):
    q, k, v, lead, n, m, d, e = draw.qkv()
    fn = draw.pick([attnx.softmax_attention, attnx.gaussian_attention])
    options = dict(causal=draw.causal(), window=draw.window(), mask=draw.mask(lead, n, m),
                   out=draw.out(lead, n, e, np.float64), return_lse=draw.chance(0.3))
    if draw.chance(0.3):
        options["bias"] = draw.array(draw.pick([lead + (n, m), (n, m), (m,)]))
    if fn is attnx.softmax_attention and draw.chance(0.3):
        options["scale"] = draw.pick([0.5, 0.0, -1.0, np.nan, np.inf, 1e300, "s"])
    if draw.chance(0.2):
        options["dropout_p"] = draw.pick([0.1, 0.0, 0.5, 1.0, -0.5, np.nan])
        options["seed"] = draw.pick([0, 7, None, -1, 2**70, "s"])
    args = (q, k, v)
    if fn is attnx.gaussian_attention and draw.chance(0.5):
        args += (draw.pick([1.0, 1e-300, 0.0, -2.0, np.nan, 1e300]),)
    if draw.chance(0.3):  # the backward of this call, with out and lse of fitting or wrong shapes
        backward = (attnx.softmax_attention_backward if fn is attnx.softmax_attention
                    else attnx.gaussian_attention_backward)
        out_shape = np.broadcast_shapes(np.shape(q)[:-2], np.shape(k)[:-2]) + (n, e) \
            if isinstance(q, np.ndarray) and isinstance(k, np.ndarray) and q.ndim >= 2 \
            and k.ndim >= 2 and np.shape(q)[:-2] == np.shape(k)[:-2] else lead + (n, e)
        dout, out = draw.array(out_shape), draw.array(out_shape)
        lse = draw.array(out_shape[:-1], draw.pick([np.float32, np.float64]))
        options.pop("out")
        options.pop("return_lse")
        if draw.chance(0.3):
            options["bias_grad"] = draw.pick([True, False, "yes"])
        if draw.chance(0.2):
            options["dq"] = draw.array(np.shape(q) if isinstance(q, np.ndarray) else (2, 2))
        return backward, (dout,) + args[:3] + (out, lse) + args[3:], options
    return fn, args, options


LINEAR_FRONT_ENDS = ["linear", "cosformer", "focused", "taylor", "performer", "efficient"]


def linear_call(draw):
    q, k, v, lead, n, m, d, e = draw.qkv()
    front = draw.pick(LINEAR_FRONT_ENDS)
    options = dict(causal=draw.causal(), out=draw.out(lead, n, e, np.float64))
    if draw.chance(0.3):
        options["key_mask"] = draw.array(lead + (m,), draw.pick([np.bool_, np.float64]))
    if front == "efficient":
        return attnx.efficient_attention, (q, k, v), options
    options.update(method=draw.pick([None, None, "chunk", "recurrent", "cumsum", "quadratic",
                                     "bogus"]),
                   eps=draw.pick([1e-6, 1e-6, 0.0, -1.0, np.nan, 1e300]),
                   return_state=draw.chance(0.3))
    if draw.chance(0.2):
        options["mask"] = draw.mask(lead, n, m)
    if draw.chance(0.2):
        options["window"] = draw.window()
    if draw.chance(0.3):
        options["chunk_size"] = draw.pick([1, 3, 16, 0, -4, 2**40, 2.0])
    if front == "linear":
        options["feature_map"] = draw.feature_map(d)
        if draw.chance(0.5):
            options["projection"] = draw.array((draw.size(), d))
        if draw.chance(0.2):
            options["p"] = draw.pick([1, 3, 0, -1, 1e9, np.nan])
    elif front == "cosformer":
        if draw.chance(0.5):
            options["M"] = draw.pick([None, 1, 8, 100, 0, -3, 1.5, np.inf])
    elif front == "focused":
        options["p"] = draw.pick([1, 3, 0, -1, 1e9, np.nan])
    elif front == "performer":
        if draw.chance(0.5):
            options["projection"] = draw.array((draw.size(), d))
        else:
            options["num_features"] = draw.pick([None, 1, 8, 0, -1])
            options["seed"] = draw.pick([0, 1, None])
    fn = getattr(attnx, {"linear": "linear_attention", "cosformer": "cosformer_attention",
                         "focused": "focused_linear_attention", "taylor": "taylor_attention",
                         "performer": "performer_attention"}[front])
    return fn, (q, k, v), options


BACKWARD_DROPPED = ("out", "return_state")


def linear_backward_call(draw):
    """The backward of a (mostly wrong) kernelised call: the forward's
    options, a dout of fitting or wrong shape, sometimes a state, its
    gradient and gradient arrays given to fill."""
    fn, (q, k, v), options = linear_call(draw)
    backward = getattr(attnx, fn.__name__ + "_backward")
    for name in BACKWARD_DROPPED:
        options.pop(name, None)
    shape = np.shape(q)[:-1] + np.shape(v)[-1:] if isinstance(q, np.ndarray) and isinstance(
        v, np.ndarray) and q.ndim and v.ndim else (2, 2)
    dout = draw.array(shape)
    if backward is not attnx.efficient_attention_backward:
        if draw.chance(0.2):
            _, state = attnx.linear_attention(np.ones((1, 2)), np.ones((1, 2)), np.ones((1, 2)),
                                              causal=True, return_state=True)
            options["initial_state"] = draw.pick([state, (np.ones((2, 2)), np.ones(2)), "s"])
        if draw.chance(0.2):
            options["grad_state"] = draw.pick([(np.ones((2, 2)), np.ones(2)), None, (1,), "s"])
        if draw.chance(0.2):
            options["projection_grad"] = draw.pick([True, False])
    if draw.chance(0.2):
        options[draw.pick(["dq", "dk", "dv"])] = draw.array(np.shape(q) if isinstance(
            q, np.ndarray) else (2, 2))
    return backward, (dout, q, k, v), options


class TorchCall:
    """An attnx.torch operator on tensors made from the drawn arrays; with
    backward, then the gradients through autograd."""

    def __init__(self, fn, backward):
        self.fn, self.backward = fn, backward
        self.__qualname__ = f"attnx.torch.{fn.__name__}{' + backward' if backward else ''}"

    def __call__(self, *args, **options):
        result = self.fn(*args, **options)
        out = result[0] if isinstance(result, tuple) else result
        if self.backward and getattr(out, "requires_grad", False):
            out.sum().backward()
        return result


def tensor(draw, x, torch):
    """x as a tensor when it can be one (sometimes needing its gradient), else as is"""
    if not isinstance(x, np.ndarray) or x.dtype == object:
        return x
    t = torch.from_numpy(np.ascontiguousarray(x) if draw.chance(0.8) else x.copy())
    if t.is_floating_point() and draw.chance(0.7):
        t.requires_grad_(True)
    return t


def torch_call(draw):
    import torch
    import attnx.torch as attnx_torch
    q, k, v, lead, n, m, d, e = draw.qkv()
    name = draw.pick(["softmax_attention", "gaussian_attention", "scaled_dot_product_attention",
                      "linear_attention", "cosformer_attention", "focused_linear_attention",
                      "taylor_attention", "performer_attention", "efficient_attention"])
    fn = getattr(attnx_torch, name)
    args = tuple(tensor(draw, x, torch) for x in (q, k, v))
    options = {}
    mask = draw.mask(lead, n, m)
    if name == "scaled_dot_product_attention":
        options.update(attn_mask=tensor(draw, mask, torch), is_causal=draw.pick([False, True]),
                       dropout_p=draw.pick([0.0, 0.0, 0.2, 1.5]))
        if draw.chance(0.3):
            options["enable_gqa"] = True
    elif name in ("softmax_attention", "gaussian_attention"):
        options.update(causal=draw.causal(), window=draw.window(), mask=tensor(draw, mask, torch))
        if draw.chance(0.3):
            options["bias"] = tensor(draw, draw.array(draw.pick([lead + (n, m), (n, m), (m,)])),
                                     torch)
        if draw.chance(0.2):
            options.update(dropout_p=draw.pick([0.1, 0.0, -0.5]), seed=draw.pick([0, None, -1]))
        if draw.chance(0.2):
            options["return_lse"] = True
    elif name == "efficient_attention":
        options["causal"] = draw.causal()
    else:
        options.update(causal=draw.causal(),
                       method=draw.pick([None, None, "chunk", "recurrent", "quadratic", "bogus"]))
        if draw.chance(0.3):
            options["key_mask"] = tensor(draw, draw.array(lead + (m,), draw.pick(
                [np.bool_, np.float64])), torch)
        if name == "linear_attention":
            options["feature_map"] = draw.pick(["elu", "relu", "softmax", "taylor", "focused",
                                                "identity", "bogus", torch.nn.functional.softplus,
                                                torch.exp])
        elif name == "performer_attention":
            options["seed"] = draw.pick([0, 1])
        elif name == "cosformer_attention" and draw.chance(0.5):
            options["M"] = draw.pick([None, 8, 100, 0, -3])
    return TorchCall(fn, draw.chance(0.5)), args, options


def inspect_call(draw):
    q, k, v, lead, n, m, d, e = draw.qkv()
    fn = draw.pick([attnx.attention_weights, attnx.similarity])
    variant = draw.pick(["softmax", "gaussian", "linear", "cosformer", "focused", "taylor",
                         "performer", "efficient", "bogus"])
    options = {}
    if variant not in ("efficient", "gaussian") and draw.chance(0.5):
        options["causal"] = draw.causal()
    if variant == "performer":
        options["seed"] = 0
    return fn, (q, k), dict(options, variant=variant)


def other_call(draw):
    kind = draw.rng.integers(3)
    if kind == 0:
        return attnx.random_features, (draw.pick([1, 4, 0, -1, 2**40, 3.5]),
                                       draw.pick([1, 4, 0, -2, 2**40])), {"seed": 0}
    if kind == 1:
        return attnx.set_num_threads, (draw.pick([1, 2, 3, 0, -1, 2**40, "2"]),), {}
    return attnx.vjp, (attnx.softmax_attention, np.ones((2, 2)), np.ones((2, 2)),
                       np.ones((2, 2))), {}


def step_call(draw, states):
    """A step of a state made by an earlier call, with new arrays that may
    not fit it."""
    state = draw.pick(states)
    lead = state.z.shape[:-1]
    rows = draw.pick([1, 1, 2, 0, 9])
    d, e = draw.size(), state._S.shape[-1] if draw.chance(0.7) else draw.size()
    if draw.chance(0.6) and state._options is not None:
        d = None  # use the widths the state expects when it can tell
    width = d if d is not None else draw.size()
    dtype = state.z.dtype if draw.chance(0.8) else draw.dtype()
    arrays = [draw.array(lead + (rows, width), dtype) for _ in range(2)]
    return state.step, (arrays[0], arrays[1], draw.array(lead + (rows, e), dtype)), {}


def describe(fn, args, options):
    def short(x):
        if isinstance(x, np.ndarray):
            return f"array{x.shape}{x.dtype}{'' if x.flags.c_contiguous else ' strided'}"
        if callable(x):
            return getattr(x, "__name__", "callable")
        return repr(x)
    return (f"{getattr(fn, '__qualname__', fn)}({', '.join(short(a) for a in args)}"
            + "".join(f", {key}={short(value)}" for key, value in options.items()) + ")")


def torch_available():
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# the seeds whose calls include attnx.torch's operators: importing torch and
# its first operator calls take a few seconds of CPU, paid once
TORCH_SEEDS = (3,)


def main(seed, count):
    draw = Draw(seed)
    states = []
    attnx.set_num_threads(2)
    with_torch = seed in TORCH_SEEDS and torch_available()
    for index in range(count):
        kind = draw.rng.integers(13)
        expected = EXPECTED
        if kind < 4:
            fn, args, options = softmax_call(draw)
        elif kind < 7:
            fn, args, options = linear_call(draw)
        elif kind < 9:
            fn, args, options = linear_backward_call(draw)
        elif kind < 11 and with_torch:
            fn, args, options = torch_call(draw)
            expected = EXPECTED + (RuntimeError,)
        elif kind < 12 or not states:
            fn, args, options = (inspect_call if draw.chance(0.7) else other_call)(draw)
        else:
            fn, args, options = step_call(draw, states)
        if fn is attnx.set_num_threads:
            fn, args = attnx.set_num_threads, (draw.pick([1, 2]),) if draw.chance(0.5) else args
        print(index, describe(fn, args, options), flush=True)
        try:
            result = fn(*args, **options)
        except expected:
            continue
        except Exception as error:  # noqa: BLE001  (reported, then the run goes on)
            print(f"UNEXPECTED {type(error).__name__}: {error}", flush=True)
            continue
        if isinstance(result, tuple) and len(result) == 2 and isinstance(
                result[1], attnx.LinearAttentionState):
            states.append(result[1])
            del states[:-8]
    print("done", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
