# Type stubs of attnx's public API (checked against the module by
# `python -m mypy.stubtest attnx`, see tests/test_typing.py).
from typing import Any, Callable, Literal, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

__version__: str

_Array = NDArray[Any]
# True / "lower_right": j <= i + m - n; "upper_left": j <= i
_Causal = bool | Literal["lower_right", "upper_left"]
# w, or (left, right) with None for an open side
_Window = int | tuple[int | None, int | None] | None
_FeatureMap = (Literal["elu", "relu", "softmax", "taylor", "focused", "favor", "identity"]
               | Callable[[_Array], ArrayLike])
_Method = Literal["chunk", "recurrent", "cumsum", "quadratic"] | None
_Seed = int | np.random.SeedSequence | np.random.BitGenerator | np.random.Generator | None

class LinearAttentionState:
    z: _Array
    offset: int
    def __init__(self, S: _Array, z: _Array, offset: int) -> None: ...
    @property
    def S(self) -> _Array: ...
    @S.setter
    def S(self, value: _Array) -> None: ...
    def step(self, q: ArrayLike, k: ArrayLike, v: ArrayLike,
             out: _Array | None = None) -> _Array: ...

class MultiHeadGradients(NamedTuple):
    x_q: _Array | None = None
    x_kv: _Array | None = None
    w_q: _Array | None = None
    w_k: _Array | None = None
    w_v: _Array | None = None
    w_o: _Array | None = None
    b_q: _Array | None = None
    b_k: _Array | None = None
    b_v: _Array | None = None
    b_o: _Array | None = None
    bias: _Array | None = None
    projection: Any = None

class DeltaRuleState:
    S: _Array
    def __init__(self, S: _Array, scale: float | None = None, qk_l2norm: bool = False) -> None: ...
    def step(self, q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike,
             g: ArrayLike | None = None, *, out: _Array | None = None) -> _Array: ...

class DeltaRuleGradients(NamedTuple):
    q: _Array | None = None
    k: _Array | None = None
    v: _Array | None = None
    beta: _Array | None = None
    g: _Array | None = None
    state: _Array | None = None

class Gradients(NamedTuple):
    q: _Array | None = None
    k: _Array | None = None
    v: _Array | None = None
    bias: _Array | None = None
    projection: Any = None
    state: Any = None

# softmax family ------------------------------------------------------------

@overload
def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
                      causal: _Causal = False, mask: ArrayLike | None = None,
                      bias: ArrayLike | None = None, window: _Window = None,
                      dropout_p: float = 0.0, seed: int | None = None,
                      out: _Array | None = None, return_lse: Literal[False] = False) -> _Array: ...
@overload
def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
                      causal: _Causal = False, mask: ArrayLike | None = None,
                      bias: ArrayLike | None = None, window: _Window = None,
                      dropout_p: float = 0.0, seed: int | None = None,
                      out: _Array | None = None,
                      return_lse: Literal[True]) -> tuple[_Array, _Array]: ...
@overload
def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
                      causal: _Causal = False, mask: ArrayLike | None = None,
                      bias: ArrayLike | None = None, window: _Window = None,
                      dropout_p: float = 0.0, seed: int | None = None,
                      out: _Array | None = None,
                      return_lse: bool = False) -> _Array | tuple[_Array, _Array]: ...
@overload
def gaussian_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, sigma: float = 1.0, *,
                       causal: _Causal = False, mask: ArrayLike | None = None,
                       bias: ArrayLike | None = None, window: _Window = None,
                       dropout_p: float = 0.0, seed: int | None = None,
                       out: _Array | None = None, return_lse: Literal[False] = False) -> _Array: ...
@overload
def gaussian_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, sigma: float = 1.0, *,
                       causal: _Causal = False, mask: ArrayLike | None = None,
                       bias: ArrayLike | None = None, window: _Window = None,
                       dropout_p: float = 0.0, seed: int | None = None,
                       out: _Array | None = None,
                       return_lse: Literal[True]) -> tuple[_Array, _Array]: ...
@overload
def gaussian_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, sigma: float = 1.0, *,
                       causal: _Causal = False, mask: ArrayLike | None = None,
                       bias: ArrayLike | None = None, window: _Window = None,
                       dropout_p: float = 0.0, seed: int | None = None,
                       out: _Array | None = None,
                       return_lse: bool = False) -> _Array | tuple[_Array, _Array]: ...

def softmax_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                               out: ArrayLike, lse: ArrayLike, *, scale: float | None = None,
                               causal: _Causal = False, mask: ArrayLike | None = None,
                               bias: ArrayLike | None = None, window: _Window = None,
                               dropout_p: float = 0.0, seed: int | None = None,
                               bias_grad: bool = False, dq: _Array | None = None,
                               dk: _Array | None = None, dv: _Array | None = None) -> Gradients: ...
def gaussian_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                out: ArrayLike, lse: ArrayLike, sigma: float = 1.0, *,
                                causal: _Causal = False, mask: ArrayLike | None = None,
                                bias: ArrayLike | None = None, window: _Window = None,
                                dropout_p: float = 0.0, seed: int | None = None,
                                bias_grad: bool = False, dq: _Array | None = None,
                                dk: _Array | None = None, dv: _Array | None = None) -> Gradients: ...

# kernelised ("linear") family: return_state=True also returns the state ----

@overload
def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, feature_map: _FeatureMap = "elu",
                     causal: _Causal = False, key_mask: ArrayLike | None = None,
                     mask: ArrayLike | None = None, window: _Window = None, method: _Method = None,
                     chunk_size: int | None = None, eps: float = 1e-6,
                     projection: ArrayLike | None = None, p: float = 3,
                     initial_state: LinearAttentionState | None = None,
                     return_state: Literal[False] = False, out: _Array | None = None) -> _Array: ...
@overload
def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, feature_map: _FeatureMap = "elu",
                     causal: _Causal = False, key_mask: ArrayLike | None = None,
                     mask: ArrayLike | None = None, window: _Window = None, method: _Method = None,
                     chunk_size: int | None = None, eps: float = 1e-6,
                     projection: ArrayLike | None = None, p: float = 3,
                     initial_state: LinearAttentionState | None = None,
                     return_state: Literal[True], out: _Array | None = None
                     ) -> tuple[_Array, LinearAttentionState]: ...
@overload
def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, feature_map: _FeatureMap = "elu",
                     causal: _Causal = False, key_mask: ArrayLike | None = None,
                     mask: ArrayLike | None = None, window: _Window = None, method: _Method = None,
                     chunk_size: int | None = None, eps: float = 1e-6,
                     projection: ArrayLike | None = None, p: float = 3,
                     initial_state: LinearAttentionState | None = None,
                     return_state: bool = False, out: _Array | None = None
                     ) -> _Array | tuple[_Array, LinearAttentionState]: ...
@overload
def cosformer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: _Causal = False,
                        key_mask: ArrayLike | None = None, M: float | None = None,
                        mask: ArrayLike | None = None, window: _Window = None,
                        method: _Method = None, chunk_size: int | None = None, eps: float = 1e-6,
                        initial_state: LinearAttentionState | None = None,
                        return_state: Literal[False] = False, out: _Array | None = None) -> _Array: ...
@overload
def cosformer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: _Causal = False,
                        key_mask: ArrayLike | None = None, M: float | None = None,
                        mask: ArrayLike | None = None, window: _Window = None,
                        method: _Method = None, chunk_size: int | None = None, eps: float = 1e-6,
                        initial_state: LinearAttentionState | None = None,
                        return_state: Literal[True], out: _Array | None = None
                        ) -> tuple[_Array, LinearAttentionState]: ...
@overload
def cosformer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: _Causal = False,
                        key_mask: ArrayLike | None = None, M: float | None = None,
                        mask: ArrayLike | None = None, window: _Window = None,
                        method: _Method = None, chunk_size: int | None = None, eps: float = 1e-6,
                        initial_state: LinearAttentionState | None = None,
                        return_state: bool = False, out: _Array | None = None
                        ) -> _Array | tuple[_Array, LinearAttentionState]: ...
@overload
def focused_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, p: float = 3, *,
                             causal: _Causal = False, key_mask: ArrayLike | None = None,
                             mask: ArrayLike | None = None, window: _Window = None,
                             method: _Method = None, chunk_size: int | None = None,
                             eps: float = 1e-6, initial_state: LinearAttentionState | None = None,
                             return_state: Literal[False] = False,
                             out: _Array | None = None, dwc_weight: ArrayLike | None = None,
                             spatial: tuple[int, int] | None = None) -> _Array: ...
@overload
def focused_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, p: float = 3, *,
                             causal: _Causal = False, key_mask: ArrayLike | None = None,
                             mask: ArrayLike | None = None, window: _Window = None,
                             method: _Method = None, chunk_size: int | None = None,
                             eps: float = 1e-6, initial_state: LinearAttentionState | None = None,
                             return_state: Literal[True], out: _Array | None = None,
                             dwc_weight: ArrayLike | None = None,
                             spatial: tuple[int, int] | None = None
                             ) -> tuple[_Array, LinearAttentionState]: ...
@overload
def focused_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, p: float = 3, *,
                             causal: _Causal = False, key_mask: ArrayLike | None = None,
                             mask: ArrayLike | None = None, window: _Window = None,
                             method: _Method = None, chunk_size: int | None = None,
                             eps: float = 1e-6, initial_state: LinearAttentionState | None = None,
                             return_state: bool = False, out: _Array | None = None,
                             dwc_weight: ArrayLike | None = None,
                             spatial: tuple[int, int] | None = None
                             ) -> _Array | tuple[_Array, LinearAttentionState]: ...
@overload
def taylor_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: _Causal = False,
                     key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                     window: _Window = None, method: _Method = None,
                     chunk_size: int | None = None, eps: float = 1e-6,
                     initial_state: LinearAttentionState | None = None,
                     return_state: Literal[False] = False, out: _Array | None = None) -> _Array: ...
@overload
def taylor_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: _Causal = False,
                     key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                     window: _Window = None, method: _Method = None,
                     chunk_size: int | None = None, eps: float = 1e-6,
                     initial_state: LinearAttentionState | None = None,
                     return_state: Literal[True], out: _Array | None = None
                     ) -> tuple[_Array, LinearAttentionState]: ...
@overload
def taylor_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, causal: _Causal = False,
                     key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                     window: _Window = None, method: _Method = None,
                     chunk_size: int | None = None, eps: float = 1e-6,
                     initial_state: LinearAttentionState | None = None,
                     return_state: bool = False, out: _Array | None = None
                     ) -> _Array | tuple[_Array, LinearAttentionState]: ...
@overload
def performer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                        projection: ArrayLike | None = None, num_features: int | None = None,
                        seed: _Seed = None, *, causal: _Causal = False,
                        key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                        window: _Window = None, method: _Method = None,
                        chunk_size: int | None = None, eps: float = 1e-6,
                        initial_state: LinearAttentionState | None = None,
                        return_state: Literal[False] = False, out: _Array | None = None) -> _Array: ...
@overload
def performer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                        projection: ArrayLike | None = None, num_features: int | None = None,
                        seed: _Seed = None, *, causal: _Causal = False,
                        key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                        window: _Window = None, method: _Method = None,
                        chunk_size: int | None = None, eps: float = 1e-6,
                        initial_state: LinearAttentionState | None = None,
                        return_state: Literal[True], out: _Array | None = None
                        ) -> tuple[_Array, LinearAttentionState]: ...
@overload
def performer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                        projection: ArrayLike | None = None, num_features: int | None = None,
                        seed: _Seed = None, *, causal: _Causal = False,
                        key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                        window: _Window = None, method: _Method = None,
                        chunk_size: int | None = None, eps: float = 1e-6,
                        initial_state: LinearAttentionState | None = None,
                        return_state: bool = False, out: _Array | None = None
                        ) -> _Array | tuple[_Array, LinearAttentionState]: ...
def efficient_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                        key_mask: ArrayLike | None = None, causal: _Causal = False,
                        out: _Array | None = None) -> _Array: ...
def random_features(r: int, d: int, seed: _Seed = None) -> NDArray[np.float64]: ...

# inspection, gradients, runtime --------------------------------------------

_Variant = Literal["softmax", "gaussian", "linear", "cosformer", "focused", "taylor",
                   "performer", "efficient", "block_sparse", "pooled", "linformer"]
_Positions = Literal["rotary", "sinusoidal"] | None
_Inspected = _Variant | Literal["lsh"]

def attention_weights(q: ArrayLike, k: ArrayLike, variant: _Inspected = "softmax",
                      **options: Any) -> _Array: ...
def similarity(q: ArrayLike, k: ArrayLike, variant: _Inspected = "softmax",
               **options: Any) -> _Array: ...
def vjp(fn: Callable[..., Any], *args: Any,
        **options: Any) -> tuple[Any, Callable[[ArrayLike], Gradients]]: ...
def get_num_threads() -> int: ...
def set_num_threads(num_threads: int, /) -> None: ...
def set_output_cache(limit: int, /) -> int: ...
def show_config() -> None: ...
def cpu_dispatch() -> dict[str, str]: ...

# gradients of the kernelised family, and the other systems ----------------

def linear_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                              feature_map: Any = ..., causal: Any = ..., key_mask: Any = ...,
                              mask: Any = ..., window: Any = ..., method: Any = ...,
                              chunk_size: Any = ..., eps: Any = ..., projection: Any = ...,
                              p: Any = ..., initial_state: Any = ..., grad_state: Any = ...,
                              projection_grad: Any = ..., dq: Any = ..., dk: Any = ...,
                              dv: Any = ...) -> Gradients: ...
def cosformer_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                                 causal: Any = ..., key_mask: Any = ..., M: Any = ...,
                                 mask: Any = ..., window: Any = ..., method: Any = ...,
                                 chunk_size: Any = ..., eps: Any = ...,
                                 initial_state: Any = ..., grad_state: Any = ...,
                                 dq: Any = ..., dk: Any = ..., dv: Any = ...) -> Gradients: ...
def focused_linear_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike,
                                      v: ArrayLike, p: Any = ..., *, causal: Any = ...,
                                      key_mask: Any = ..., mask: Any = ..., window: Any = ...,
                                      method: Any = ..., chunk_size: Any = ..., eps: Any = ...,
                                      initial_state: Any = ..., grad_state: Any = ...,
                                      dq: Any = ..., dk: Any = ..., dv: Any = ...,
                                      dwc_weight: Any = ..., spatial: Any = ...) -> Gradients: ...
def taylor_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                              causal: Any = ..., key_mask: Any = ..., mask: Any = ...,
                              window: Any = ..., method: Any = ..., chunk_size: Any = ...,
                              eps: Any = ..., initial_state: Any = ..., grad_state: Any = ...,
                              dq: Any = ..., dk: Any = ..., dv: Any = ...) -> Gradients: ...
def performer_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                 projection: Any = ..., num_features: Any = ...,
                                 seed: Any = ..., *, causal: Any = ..., key_mask: Any = ...,
                                 mask: Any = ..., window: Any = ..., method: Any = ...,
                                 chunk_size: Any = ..., eps: Any = ...,
                                 initial_state: Any = ..., grad_state: Any = ...,
                                 projection_grad: Any = ..., dq: Any = ..., dk: Any = ...,
                                 dv: Any = ...) -> Gradients: ...
def efficient_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, *,
                                 key_mask: Any = ..., causal: Any = ..., dq: Any = ...,
                                 dk: Any = ..., dv: Any = ...) -> Gradients: ...
def multi_head_attention(x_q: ArrayLike, x_kv: ArrayLike | None, w_q: ArrayLike, w_k: ArrayLike,
                         w_v: ArrayLike, w_o: ArrayLike, num_heads: int, *,
                         b_q: ArrayLike | None = None, b_k: ArrayLike | None = None,
                         b_v: ArrayLike | None = None, b_o: ArrayLike | None = None,
                         num_kv_heads: int | None = None, variant: _Variant = "softmax",
                         positions: _Positions = None, **options: Any) -> _Array: ...
def multi_head_attention_backward(dout: ArrayLike, x_q: ArrayLike, x_kv: ArrayLike | None,
                                  w_q: ArrayLike, w_k: ArrayLike, w_v: ArrayLike, w_o: ArrayLike,
                                  num_heads: int, *, b_q: ArrayLike | None = None,
                                  b_k: ArrayLike | None = None, b_v: ArrayLike | None = None,
                                  b_o: ArrayLike | None = None, num_kv_heads: int | None = None,
                                  variant: _Variant = "softmax", positions: _Positions = None,
                                  **options: Any) -> MultiHeadGradients: ...
def sinusoidal_positions(n: Any, d: Any, base: Any = ...) -> Any: ...
def rotary(x: ArrayLike, positions: ArrayLike | None = ..., base: Any = ...,
           interleaved: Any = ...) -> Any: ...
def rotary_backward(dout: ArrayLike, positions: ArrayLike | None = ..., base: Any = ...,
                    interleaved: Any = ...) -> Any: ...
def block_sparse_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, layout: ArrayLike,
                           block_size: Any, *, scale: Any = ..., causal: Any = ...,
                           mask: Any = ..., bias: Any = ..., window: Any = ..., out: Any = ...,
                           return_lse: Any = ...) -> Any: ...
def block_sparse_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                    out: Any, lse: Any, layout: ArrayLike, block_size: Any, *,
                                    scale: Any = ..., causal: Any = ..., mask: Any = ...,
                                    bias: Any = ..., window: Any = ..., bias_grad: Any = ...,
                                    dq: Any = ..., dk: Any = ..., dv: Any = ...) -> Gradients: ...
def pooled_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, stride: Any, mode: Any = ...,
                     **softmax_options: Any) -> Any: ...
def pooled_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                              out: Any, lse: Any, stride: Any, mode: Any = ..., *,
                              bias_grad: Any = ..., **softmax_options: Any) -> Gradients: ...
def linformer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, E: ArrayLike,
                        F: ArrayLike | None = ..., **softmax_options: Any) -> Any: ...
def linformer_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                 out: Any, lse: Any, E: ArrayLike, F: ArrayLike | None = ...,
                                 *, bias_grad: Any = ..., **softmax_options: Any) -> Gradients: ...

def lsh_attention(q: ArrayLike, v: ArrayLike, n_buckets: int, n_hashes: int = ..., chunk: int = ...,
                  causal: bool | str = ..., seed: int = ..., *, out: NDArray[Any] | None = ...,
                  return_lse: bool = ...) -> Any: ...
def lsh_attention_backward(dout: ArrayLike, q: ArrayLike, v: ArrayLike, out: ArrayLike,
                           lse: ArrayLike, n_buckets: int, n_hashes: int = ..., chunk: int = ...,
                           causal: bool | str = ..., seed: int = ..., *,
                           dq: NDArray[Any] | None = ...,
                           dv: NDArray[Any] | None = ...) -> Gradients: ...
def lsh_buckets(q: ArrayLike, n_buckets: int, n_hashes: int = ...,
                seed: int = ...) -> NDArray[np.int32]: ...
def lsh_rotations(d: int, n_buckets: int, n_hashes: int = ...,
                  seed: int = ...) -> NDArray[np.float64]: ...

from . import layouts as layouts

__all__ = [
    "softmax_attention",
    "gaussian_attention",
    "softmax_attention_backward",
    "gaussian_attention_backward",
    "linear_attention",
    "cosformer_attention",
    "focused_linear_attention",
    "taylor_attention",
    "performer_attention",
    "efficient_attention",
    "linear_attention_backward",
    "cosformer_attention_backward",
    "focused_linear_attention_backward",
    "taylor_attention_backward",
    "performer_attention_backward",
    "efficient_attention_backward",
    "random_features",
    "LinearAttentionState",
    "attention_weights",
    "similarity",
    "multi_head_attention",
    "multi_head_attention_backward",
    "MultiHeadGradients",
    "sinusoidal_positions",
    "rotary",
    "rotary_backward",
    "block_sparse_attention",
    "block_sparse_attention_backward",
    "pooled_attention",
    "pooled_attention_backward",
    "linformer_attention",
    "linformer_attention_backward",
    "lsh_attention",
    "lsh_attention_backward",
    "lsh_buckets",
    "lsh_rotations",
    "delta_rule_attention",
    "delta_rule_attention_backward",
    "DeltaRuleState",
    "DeltaRuleGradients",
    "layouts",
    "Gradients",
    "vjp",
    "get_num_threads",
    "set_num_threads",
    "set_output_cache",
    "show_config",
    "cpu_dispatch",
]

# delta rule --------------------------------------------------------------------

@overload
def delta_rule_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike,
                         g: ArrayLike | None = None, *, scale: float | None = None,
                         qk_l2norm: bool = False,
                         method: Literal["chunk", "recurrent"] = "chunk", chunk: int = 64,
                         initial_state: DeltaRuleState | ArrayLike | None = None,
                         return_state: Literal[False] = False,
                         out: _Array | None = None) -> _Array: ...
@overload
def delta_rule_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike,
                         g: ArrayLike | None = None, *, scale: float | None = None,
                         qk_l2norm: bool = False,
                         method: Literal["chunk", "recurrent"] = "chunk", chunk: int = 64,
                         initial_state: DeltaRuleState | ArrayLike | None = None,
                         return_state: Literal[True],
                         out: _Array | None = None) -> tuple[_Array, DeltaRuleState]: ...
def delta_rule_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                                  beta: ArrayLike, g: ArrayLike | None = None, *,
                                  scale: float | None = None, qk_l2norm: bool = False,
                                  method: Literal["chunk", "recurrent"] = "chunk",
                                  chunk: int = 64,
                                  initial_state: DeltaRuleState | ArrayLike | None = None,
                                  grad_state: ArrayLike | None = None) -> DeltaRuleGradients: ...
