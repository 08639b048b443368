"""The torch autograd op around the generated kernels."""
from __future__ import annotations

import torch

from . import runtime


class AttentionFunction(torch.autograd.Function):
    """out, lse = attention(q, k, v) through a generated forward module."""

    @staticmethod
    def forward(ctx, q, k, v, module, interpret, scale, *captures):
        out, lse = runtime.forward(module, q, k, v, captures, scale, interpret)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        raise NotImplementedError("attncc's backward pass is not implemented yet (tracked in the "
                                  "backward issue); run the forward under torch.no_grad() for now")
