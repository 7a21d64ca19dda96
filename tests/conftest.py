"""Shared fixtures: one per kernel family (attnx.cpu_dispatch), each running
a test once on every kernel set that family can run on this CPU, from the
best down to plain C + BLAS (csrc/dispatch.c's tables; docs/architecture.md).

    def test_x(softmax_forward_kernels): ...   # "avx512_bf16", "avx512", ..., "plain"

The fixture holds its family to the set (attnx._C._set_dispatch, the code
import runs) and checks that the table chose it, so a test asks the table
what ran instead of assuming the CPU. The other families keep their choice:
ATTNX_DISABLE_CPU_FEATURES (the CI runs tests/test_dispatch.py's subset
under each level, .ci/run) moves them all at once."""

import pytest

import attnx
from helpers import backward_blocks, dispatched, kernels_here


def _family_fixture(family):
    @pytest.fixture(name=f"{family}_kernels", params=kernels_here(family))
    def kernels(request):
        with dispatched(**{family: request.param}) as chosen:
            assert chosen[family] == request.param
            yield request.param

    kernels.__doc__ = f"Each kernel set the {family} family can run here, best first."
    return kernels


softmax_forward_kernels = _family_fixture("softmax_forward")
softmax_backward_kernels = _family_fixture("softmax_backward")
linear_forward_kernels = _family_fixture("linear_forward")
linear_backward_kernels = _family_fixture("linear_backward")
decode_kernels = _family_fixture("decode")
lsh_kernels = _family_fixture("lsh")
convert_kernels = _family_fixture("convert")
delta_rule_kernels = _family_fixture("delta_rule")


@pytest.fixture(params=[64, 128])
def softmax_backward_side(request):
    """Each side of the softmax backward's blocks: 64 on CPUs whose cores have
    less than 1 MiB of L2, 128 on the others (csrc/softmax_backward.c)."""
    with backward_blocks(request.param):
        assert attnx._C.build_info()["softmax_backward_block"] == request.param
        yield request.param


assert set(attnx.cpu_dispatch()) == {"softmax_forward", "softmax_backward", "linear_forward",
                                     "linear_backward", "decode", "lsh", "convert",
                                     "delta_rule"}
