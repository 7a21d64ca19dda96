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
                             out: _Array | None = None) -> _Array: ...
@overload
def focused_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, p: float = 3, *,
                             causal: _Causal = False, key_mask: ArrayLike | None = None,
                             mask: ArrayLike | None = None, window: _Window = None,
                             method: _Method = None, chunk_size: int | None = None,
                             eps: float = 1e-6, initial_state: LinearAttentionState | None = None,
                             return_state: Literal[True], out: _Array | None = None
                             ) -> tuple[_Array, LinearAttentionState]: ...
@overload
def focused_linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, p: float = 3, *,
                             causal: _Causal = False, key_mask: ArrayLike | None = None,
                             mask: ArrayLike | None = None, window: _Window = None,
                             method: _Method = None, chunk_size: int | None = None,
                             eps: float = 1e-6, initial_state: LinearAttentionState | None = None,
                             return_state: bool = False, out: _Array | None = None
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
                   "performer", "efficient"]

def attention_weights(q: ArrayLike, k: ArrayLike, variant: _Variant = "softmax",
                      **options: Any) -> _Array: ...
def similarity(q: ArrayLike, k: ArrayLike, variant: _Variant = "softmax",
               **options: Any) -> _Array: ...
def vjp(fn: Callable[..., Any], *args: Any,
        **options: Any) -> tuple[Any, Callable[[ArrayLike], Gradients]]: ...
def get_num_threads() -> int: ...
def set_num_threads(num_threads: int, /) -> None: ...
def show_config() -> None: ...

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
    "random_features",
    "LinearAttentionState",
    "attention_weights",
    "similarity",
    "Gradients",
    "vjp",
    "get_num_threads",
    "set_num_threads",
    "show_config",
]
