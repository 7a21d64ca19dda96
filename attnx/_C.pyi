# Type stubs of the C extension (csrc/module.c and the py_*.c bindings).
# The public functions are re-exported and documented by attnx/__init__.pyi;
# the others are the front ends' plumbing.
from typing import Any

from numpy.typing import ArrayLike, NDArray

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
                     lse: ArrayLike, scale: float | None, sigma: float | None, causal: bool | str,
                     mask: ArrayLike | None, bias: ArrayLike | None, window: Any,
                     dropout_p: float, seed: int | None, bias_grad: bool,
                     dq: NDArray[Any] | None = None, dk: NDArray[Any] | None = None,
                     dv: NDArray[Any] | None = None) -> Any: ...
def linear_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, variant: str, feature_map: str,
                     causal: bool | str, key_mask: ArrayLike | None, mask: ArrayLike | None,
                     window: Any, method: str | None, chunk_size: int | None, eps: float,
                     projection: ArrayLike | None, p: float, M: float | None,
                     initial_state: Any, return_state: bool, out: NDArray[Any] | None,
                     normalise: bool) -> Any: ...
def linear_attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                              kind: int, causal: bool | str, key_mask: ArrayLike | None,
                              mask: ArrayLike | None, window: Any, method: int, chunk: int,
                              eps: float, power: float, period: float,
                              projection: ArrayLike | None, S0: Any, z0: Any, dS: Any, dz: Any,
                              offset: int, projection_grad: bool,
                              dq: NDArray[Any] | None = None, dk: NDArray[Any] | None = None,
                              dv: NDArray[Any] | None = None) -> Any: ...
def lsh_attention(q: ArrayLike, v: ArrayLike, rotations: ArrayLike, chunk: int,
                  causal: bool | str, out: NDArray[Any] | None) -> Any: ...
def lsh_backward(dout: ArrayLike, q: ArrayLike, v: ArrayLike, out: ArrayLike, lse: ArrayLike,
                 rotations: ArrayLike, chunk: int, causal: bool | str) -> Any: ...
def lsh_buckets(q: ArrayLike, rotations: ArrayLike) -> NDArray[Any]: ...
def linear_step(state: Any, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                out: NDArray[Any] | None = None) -> NDArray[Any]: ...
def linear_flush(state: Any) -> None: ...
def get_num_threads() -> int: ...
def set_num_threads(num_threads: int, /) -> None: ...
def build_info() -> dict[str, Any]: ...
def _set_softmax_backend(name: str, /) -> str: ...
