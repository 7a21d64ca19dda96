"""attnx.torch.scaled_dot_product_attention as a drop-in for torch's: the
behaviours PyTorch's own SDPA tests check (test/test_transformers.py, run
with the function replaced by attnx's), each written here against torch's
function itself: CausalBias masks, the attn_mask + is_causal error, any
finite scale, dropout_p = 1, torch's exception types and mask dtype rules,
and shape errors in attnx's words."""
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attnx.torch as at

SHAPES = [(3, 5), (5, 5), (5, 3), (1, 7), (6, 1)]


def _inputs(n, m, dtype=torch.float64, batch=(2, 3), d=8, e=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, n, d, dtype=dtype, generator=gen)
    k = torch.randn(*batch, m, d, dtype=dtype, generator=gen)
    v = torch.randn(*batch, m, e, dtype=dtype, generator=gen)
    return [t.requires_grad_() for t in (q, k, v)]


def _grads(out, inputs, seed=1):
    dout = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, dout)


def _causal_bias(make, n, m):
    with warnings.catch_warnings():
        # torch warns that lower-right with n > m leaves rows without keys
        warnings.simplefilter("ignore", UserWarning)
        return make(n, m)


def _close(got, want, dtype=torch.float64):
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right])
@pytest.mark.parametrize("n, m", SHAPES)
def test_causal_bias_equals_torch_outputs_and_gradients(make, n, m):
    q, k, v = _inputs(n, m)
    mask = _causal_bias(make, n, m)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = at.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # rows that see no key (lower right, n > m): zeros in both
    _close(got, want)
    for g, w in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        _close(g, w)


@pytest.mark.parametrize("make, flag", [(causal_upper_left, "upper_left"),
                                        (causal_lower_right, "lower_right")])
def test_causal_bias_is_the_causal_flag_never_its_storage(make, flag):
    """A CausalBias holds no values: its result is the causal flag's, the
    same on every call (the bug read its placeholder memory as a bias)."""
    q, k, v = _inputs(4, 9, dtype=torch.float32)
    want = at.softmax_attention(q, k, v, causal=flag)
    for _ in range(3):
        got = at.scaled_dot_product_attention(q, k, v, attn_mask=make(4, 9))
        assert torch.equal(got, want)


@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right])
def test_causal_bias_under_compile(make):
    def attend(q, k, v, mask):
        return at.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    q, k, v = (t.detach() for t in _inputs(4, 6, dtype=torch.float32))
    mask = make(4, 6)
    _close(compiled(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
           torch.float32)


def test_causal_bias_with_is_causal_raises_value_error_as_torch():
    q, k, v = _inputs(4, 4)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(4, 4), is_causal=True)
    with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
        at.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(4, 4),
                                        is_causal=True)


def test_causal_bias_of_other_lengths_broadcasts_as_torch_materialises_it():
    """A lower-right bias of (1, m) broadcasts over the queries (all keys
    visible); one whose lengths do not broadcast is an error."""
    q, k, v = _inputs(5, 4)
    mask = causal_lower_right(1, 4)
    _close(at.scaled_dot_product_attention(q, k, v, attn_mask=mask),
           F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    with pytest.raises(RuntimeError, match=r"attn_mask .*\(2, 3\).*\(\.\.\., L, S\)"):
        at.scaled_dot_product_attention(q, k, v,
                                        attn_mask=_causal_bias(causal_lower_right, 2, 3))


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64])
def test_attn_mask_with_is_causal_is_a_runtime_error(mask_dtype):
    q, k, v = _inputs(4, 4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    if mask_dtype != torch.bool:
        mask = torch.zeros(4, 4, dtype=mask_dtype)
    # torch's own message, as PyTorch's tests match it
    with pytest.raises(RuntimeError, match="_scaled_dot_product_attention: Explicit attn_mask "
                                           "should not be set when is_causal=True"):
        at.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("scale", [-0.7, -3.0, 0.0, 0.01, 2.5])
@pytest.mark.parametrize("causal", [False, True])
def test_any_finite_scale_equals_torch(scale, causal):
    q, k, v = _inputs(5, 5)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    got = at.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    _close(got, want)
    for g, w in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        _close(g, w)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale_is_refused(scale):
    q, k, v = _inputs(3, 3)
    with pytest.raises(RuntimeError, match="scale must be finite"):
        at.scaled_dot_product_attention(q, k, v, scale=scale)


def test_dropout_one_drops_everything_as_torch():
    q, k, v = _inputs(4, 6)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    got = at.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert torch.equal(got, want) and not got.any()
    for g in _grads(got, (q, k, v)):
        assert not g.any()
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\]"):
        at.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\]"):
        at.scaled_dot_product_attention(q, k, v, dropout_p=-0.1)


def _q(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# each: the call, and the type torch's own function raises for it (our
# error is both that type and attnx's ValueError / TypeError)
BAD_CALLS = {
    "mixed dtypes": (lambda f: f(_q(2, 3, 4), _q(2, 3, 4, dtype=torch.float64), _q(2, 3, 4)),
                     TypeError, "share one dtype"),
    "integer inputs": (lambda f: f(*(torch.ones(1, 2, 3, 4, dtype=torch.int64),) * 3),
                       TypeError, "float32, float64, bfloat16 or float16"),
    "1-d inputs": (lambda f: f(_q(4), _q(4), _q(4)), ValueError, "at least 2 dimensions"),
    "batch mismatch": (lambda f: f(_q(2, 2, 3, 4), _q(3, 2, 3, 4), _q(3, 2, 3, 4)),
                       ValueError, "leading .* axes do not broadcast"),
    "head mismatch without enable_gqa": (
        lambda f: f(_q(1, 6, 3, 4), _q(1, 2, 3, 4), _q(1, 2, 3, 4)),
        ValueError, r"do not broadcast: query \(1, 6, 3, 4\), key \(1, 2, 3, 4\)"),
    "enable_gqa with heads that do not divide": (
        lambda f: f(_q(1, 6, 3, 4), _q(1, 4, 3, 4), _q(1, 4, 3, 4), enable_gqa=True),
        ValueError, "multiple of the key/value heads"),
    "d mismatch": (lambda f: f(_q(2, 2, 3, 4), _q(2, 2, 3, 5), _q(2, 2, 3, 4)),
                   ValueError, "same last size d"),
    "integer mask": (lambda f: f(_q(2, 3, 4), _q(2, 3, 4), _q(2, 3, 4),
                                 attn_mask=torch.ones(3, 3, dtype=torch.int64)),
                     TypeError, "attn_mask has dtype torch.int64"),
    "float64 mask on float32": (lambda f: f(_q(2, 3, 4), _q(2, 3, 4), _q(2, 3, 4),
                                            attn_mask=torch.zeros(3, 3, dtype=torch.float64)),
                                TypeError, "float32 or the query's dtype"),
    "mask of the wrong shape": (lambda f: f(_q(2, 3, 4), _q(2, 3, 4), _q(2, 3, 4),
                                            attn_mask=torch.ones(4, 3, dtype=torch.bool)),
                                ValueError, r"attn_mask has shape \(4, 3\)"),
    "mask whose heads do not broadcast": (
        lambda f: f(_q(1, 2, 3, 4), _q(1, 2, 3, 4), _q(1, 2, 3, 4),
                    attn_mask=torch.ones(3, 3, 3, dtype=torch.bool)),
        ValueError, r"attn_mask \(3, 3, 3\)"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_errors_are_torchs_runtime_error_with_attnx_words(case):
    call, attnx_type, message = BAD_CALLS[case]
    with pytest.raises(RuntimeError):
        call(F.scaled_dot_product_attention)
    with pytest.raises(RuntimeError, match=message) as raised:
        call(at.scaled_dot_product_attention)
    assert isinstance(raised.value, attnx_type)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_mask_dtypes_torch_accepts(mask_dtype):
    """bool, float32 and the query's own dtype are accepted, as by torch."""
    q, k, v = (t.detach().to(torch.bfloat16) for t in _inputs(3, 5, dtype=torch.float32))
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    if mask_dtype != torch.bool:
        mask = torch.zeros(3, 5).masked_fill(~mask, -torch.inf).to(mask_dtype)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                          attn_mask=mask if mask.dtype == torch.bool
                                          else mask.float())
    got = at.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_shapes_torch_broadcasts():
    """2-d inputs, a 3-d query against 4-d keys, and size-1 batch axes
    broadcast as in torch."""
    for shapes in [((3, 4), (5, 4), (5, 6)), ((2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)),
                   ((2, 2, 3, 4), (1, 2, 5, 4), (1, 1, 5, 4))]:
        q, k, v = (_q(*s, dtype=torch.float64) for s in shapes)
        _close(at.scaled_dot_product_attention(q, k, v),
               F.scaled_dot_product_attention(q, k, v))


def test_front_end_shape_errors_name_the_arguments():
    """The other front ends: leading axes that do not broadcast are a
    ValueError naming the arguments, not torch's broadcasting internals."""
    with pytest.raises(ValueError, match=r"do not broadcast: q \(2, 2, 3, 4\), k \(3, 2, 3, 4\)"):
        at.softmax_attention(_q(2, 2, 3, 4), _q(3, 2, 3, 4), _q(3, 2, 3, 4))
    with pytest.raises(ValueError, match="do not broadcast"):
        at.linear_attention(_q(2, 2, 3, 4), _q(3, 2, 3, 4), _q(3, 2, 3, 4))


def test_import_without_torch_says_what_to_install(tmp_path):
    """A Python where torch cannot be imported: a clear ImportError that
    names the CPU build, not a bare ModuleNotFoundError."""
    script = tmp_path / "no_torch.py"
    script.write_text(textwrap.dedent("""
        import sys
        sys.modules["torch"] = None      # import torch now raises ModuleNotFoundError
        try:
            import attnx.torch
        except ImportError as error:
            assert not isinstance(error, ModuleNotFoundError), type(error)
            print(error)
        else:
            raise AssertionError("imported attnx.torch without torch")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "attnx.torch needs PyTorch" in result.stdout
    assert "whl/cpu" in result.stdout


PLAIN_CALLS = {
    "heads": (((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)), {}),
    "causal": (((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)), {"is_causal": True}),
    "scale": (((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)), {"scale": 0.3}),
    "int scale": (((1, 2, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)), {"scale": 2}),
    "decoding step": (((1, 4, 1, 16), (1, 4, 300, 16), (1, 4, 300, 16)), {}),
    "grouped": (((2, 6, 3, 8), (2, 2, 7, 8), (2, 2, 7, 4)), {"enable_gqa": True}),
    "grouped causal": (((1, 4, 3, 8), (1, 2, 7, 8), (1, 2, 7, 4)),
                       {"enable_gqa": True, "is_causal": True}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(PLAIN_CALLS))
def test_calls_without_graph_equal_torch_and_the_differentiable_path(case, dtype):
    """A call that needs no gradient takes a shorter path (decoding steps):
    its result equals torch's and that of the same call with gradients
    (the operator), strided inputs read in place, inputs untouched."""
    shapes, options = PLAIN_CALLS[case]
    gen = torch.Generator().manual_seed(7)
    # the query as a transposed view: last axis contiguous, others strided
    q = torch.randn(*shapes[0][:-3], shapes[0][-2], shapes[0][-3], shapes[0][-1], dtype=dtype,
                    generator=gen).transpose(-3, -2)
    k, v = (torch.randn(*s, dtype=dtype, generator=gen) for s in shapes[1:])
    copies = [t.clone() for t in (q, k, v)]
    with torch.no_grad():
        got = at.scaled_dot_product_attention(q, k, v, **options)
    want = F.scaled_dot_product_attention(q, k, v, **options)
    differentiable = at.scaled_dot_product_attention(*(t.clone().requires_grad_()
                                                       for t in (q, k, v)), **options)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, dtype)
    _close(got, differentiable.detach(), dtype)
    for t, copy in zip((q, k, v), copies):
        assert torch.equal(t, copy)


def test_calls_without_graph_still_refuse_what_torch_refuses():
    """Grouped heads without enable_gqa, a head count that does not divide,
    zero and negative scales: the short path leaves them to the checks of
    the general one (the last two are valid and must equal torch)."""
    q, k, v = _q(1, 4, 3, 8), _q(1, 2, 5, 8), _q(1, 2, 5, 8)
    with pytest.raises(RuntimeError):
        at.scaled_dot_product_attention(q, k, v)
    with pytest.raises(RuntimeError):
        at.scaled_dot_product_attention(_q(1, 3, 3, 8), k, v, enable_gqa=True)
    q, k, v = _q(1, 2, 3, 8), _q(1, 2, 5, 8), _q(1, 2, 5, 8)
    for scale in (0.0, -0.5):
        torch.testing.assert_close(at.scaled_dot_product_attention(q, k, v, scale=scale),
                                   F.scaled_dot_product_attention(q, k, v, scale=scale),
                                   rtol=2e-5, atol=2e-5)
