"""Small Triton helpers shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dot"]


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """acc + a·b. F32: both operands in fp32 with IEEE products (fp32 inputs, or dtypes the
    interpreter's matmul cannot take); otherwise the tensor-core dot in the operands' dtype."""
    if F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
