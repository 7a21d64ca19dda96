# Type stubs of the C extension (csrc/module.c and the py_*.c bindings).
# The public functions are re-exported and documented by attnx/__init__.pyi;
# the others are the front ends' plumbing.
from typing import Any, Callable, Sequence, TypeVar, overload

from numpy.typing import ArrayLike, NDArray

_Arrays = TypeVar("_Arrays", bound=Sequence[NDArray[Any]])

def softmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None = None,
                      causal: bool | str = False, mask: ArrayLike | None = None,
                      bias: ArrayLike | None = None, window: Any = None,
                      dropout_p: float = 0.0, seed: int | None = None,
                      out: NDArray[Any] | None = None, return_lse: bool = False) -> Any: ...
def gaussian_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, sigma: float = 1.0, *,
                       causal: bool | str = False, mask: ArrayLike | None = None,
                       bias: ArrayLike | None = None, window: Any = None,
                       dropout_p: float = 0.0, seed: int | None = None,
                       out: NDArray[Any] | None = None, return_lse: bool = False) -> Any: ...
def softmax_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike, out: ArrayLike,
                     lse: ArrayLike, *, scale: float | None = None, sigma: float | None = None,
                     causal: bool | str = False, mask: ArrayLike | None = None,
                     bias: ArrayLike | None = None, window: Any = None,
                     dropout_p: float | None = None, seed: int | None = None,
                     bias_grad: bool = False, dq: NDArray[Any] | None = None,
                     dk: NDArray[Any] | None = None, dv: NDArray[Any] | None = None) -> Any: ...
def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, variant: str,
                     feature_map: str = "elu", causal: bool | str = False,
                     key_mask: ArrayLike | None = None, mask: ArrayLike | None = None,
                     window: Any = None, method: str | None = None,
                     chunk_size: int | None = None, eps: float = 1e-06,
                     projection: ArrayLike | None = None, p: float = 3, M: float | None = None,
                     initial_state: Any = None, return_state: bool = False,
                     out: NDArray[Any] | None = None, normalise: bool = True,
                     features: Callable[[Any, Any, Any], tuple[Any, Any]] | None = None) -> Any: ...

class LinearAttentionState:
    z: NDArray[Any]
    offset: int
    def __init__(self, S: NDArray[Any], z: NDArray[Any], offset: int) -> None: ...
    @property
    def S(self) -> NDArray[Any]: ...
    @S.setter
    def S(self, value: NDArray[Any]) -> None: ...
    def step(self, q: ArrayLike, k: ArrayLike, v: ArrayLike,
             out: NDArray[Any] | None = None) -> NDArray[Any]: ...
def linear_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                              front: str, feature_map: str, causal: bool | str,
                              key_mask: ArrayLike | None, mask: ArrayLike | None, window: Any,
                              method: str | None, chunk_size: int | None, eps: float, p: float,
                              M: float | None, projection: ArrayLike | None, S0: Any, z0: Any,
                              dS: Any, dz: Any, offset: int, projection_grad: bool,
                              dq: NDArray[Any] | None = None, dk: NDArray[Any] | None = None,
                              dv: NDArray[Any] | None = None) -> Any: ...
def linear_variants() -> dict[str, tuple[str, str | None]]: ...
def linear_resolve(front: str, *, feature_map: Any = None, causal: Any = False,
                   window: Any = None, method: str | None = None, chunk_size: int | None = None,
                   eps: float = 1e-6, p: float = 3, M: float | None = None,
                   projection: Any = None, mask: bool = False, d: int = 0, n: int | None = None,
                   m: int | None = None, streaming: bool = False) -> dict[str, Any]: ...
def lsh_attention(q: ArrayLike, v: ArrayLike, rotations: ArrayLike, *, chunk: int,
                  causal: bool | str = False, out: NDArray[Any] | None = None) -> Any: ...
def lsh_backward(dout: ArrayLike, q: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                 rotations: ArrayLike, *, chunk: int, causal: bool | str = False) -> Any: ...
def lsh_buckets(q: ArrayLike, rotations: ArrayLike) -> NDArray[Any]: ...
def delta_rule(q: ArrayLike, k: ArrayLike, v: ArrayLike, beta: ArrayLike, *,
               g_scalar: Any = None, g_channel: Any = None, initial_state: Any = None,
               out: NDArray[Any] | None = None, want_state: bool = False, in_place: bool = False,
               scale: float, l2norm: bool = False, recurrent: bool, chunk: int) -> Any: ...
def delta_rule_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                        beta: ArrayLike, *, g_scalar: Any = None, g_channel: Any = None,
                        initial_state: Any = None, grad_state: Any = None, scale: float,
                        l2norm: bool = False, chunk: int) -> Any: ...
def causal_conv1d_update(x: NDArray[Any], state: NDArray[Any], weight: NDArray[Any],
                         bias: Any = None, *, silu: bool = False) -> NDArray[Any]: ...
def get_num_threads() -> int: ...
def set_num_threads(num_threads: int, /) -> None: ...
def set_output_cache(limit: int, /) -> int: ...
def _output_cache_held() -> tuple[int, int]: ...
def build_info() -> dict[str, Any]: ...
def _set_dispatch(disabled: str, limits: dict[str, str] | None = None, /) -> tuple[str, dict[str, str]]: ...
@overload
def _convert_half(src: NDArray[Any], dst: NDArray[Any], /) -> NDArray[Any]: ...
@overload
def _convert_half(src: Sequence[NDArray[Any]], dst: _Arrays, /) -> _Arrays: ...
