"""The kernelised ("linear") family's variants, as the C binding defines them.

One table, ``linear_variants`` in csrc/py_linear.c, names each variant
(the front end's name: "linear", "cosformer", "focused", "taylor",
"performer", "efficient"), its numpy function and the feature map it fixes;
the same file holds the rule r(d) for the features and the checks of every
option (parse_options, resolve_method, check_period), used alike by the
forward, the backward and a decoding step. Python passes these names and
never an enum number. attnx.torch and attnx.dask ask `resolve` (the C
checks, without arrays) instead of checking again.
"""
from typing import NamedTuple, Optional

from . import _C


class Variant(NamedTuple):
    """A row of the variant table."""

    function: str                 # the numpy front end, an attribute of attnx
    feature_map: Optional[str]    # the feature map it fixes; None: its feature_map= chooses

    @property
    def backward(self):
        """The name of its gradients' function in attnx."""
        return self.function + "_backward"


VARIANTS = {front: Variant(*row) for front, row in _C.linear_variants().items()}

# resolve(front, *, feature_map=..., causal=..., window=..., method=...,
# chunk_size=..., eps=..., p=..., M=..., projection=..., mask=..., d=...,
# n=..., m=..., streaming=...) -> {"feature_map", "features", "method", "M"}
resolve = _C.linear_resolve
