"""The torch autograd op around the generated kernels."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import blocks, runtime
from .log import logger


@dataclass
class Launch:
    """What the autograd op needs to run a variant's kernels for one call."""
    compiled: object        # CompiledAttention: gives the generated modules
    spec: object            # plan.Spec of the forward
    scale: float
    rng: tuple = ()         # (seed, offset, dropout_p) when dropout is on
    deterministic: bool = False

    @property
    def interpret(self) -> bool:
        return self.spec.target == "interpreter"

    def blocks(self, module, q, k, captures):
        """Tile lists for a data-dependent mask (None when the kernels derive their own bounds)."""
        if not module.BLOCK_SPARSE:
            return None
        fwd = self.compiled.module("fwd", self.spec)
        caps = runtime.interp_captures(captures) if self.interpret else captures
        return blocks.for_module(module, fwd, caps, q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                 fwd.CLASS_PER_HEAD, q.device)


_shrink: dict = {}  # (variant, kernel, spec) -> the tile shrink level that fits the GPU


def with_fallback(compiled, kernel: str, spec, run):
    """run(module) with the kernel's chosen tiles; if they need more shared memory than the GPU
    has (a heavy mod can), regenerate with smaller tiles and remember the level that fits."""
    key = (compiled.variant.ir_key, kernel, spec)
    level = _shrink.get(key, 0)
    while True:
        try:
            result = run(compiled.module(kernel, dataclasses.replace(spec, shrink=level)))
            _shrink[key] = level
            return result
        except Exception as e:  # triton.runtime.errors.OutOfResources; triton is imported lazily
            if type(e).__name__ != "OutOfResources" or level >= 4:
                raise
            level += 1
            logger.info("%s kernel out of resources (%s); retrying with smaller tiles (level %d)", kernel, e, level)


class AttentionFunction(torch.autograd.Function):
    """out, lse = attention(q, k, v; captured tensors) through generated kernels.

    Backward follows FlashAttention-2: a preprocess kernel computes Delta = rowsum(dO * O) - dlse,
    the dK/dV kernel and the dQ kernel recompute P from lse tile by tile; learnable captured
    tensors receive float32 gradients by atomic adds, cast to their dtype at the end."""

    @staticmethod
    def forward(ctx, q, k, v, launch: Launch, *captures):
        out, lse = with_fallback(launch.compiled, "fwd", launch.spec, lambda module: runtime.forward(
            module, q, k, v, captures, launch.scale, launch.interpret, launch.rng, launch.blocks(module, q, k, captures)))
        ctx.launch = launch
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, *captures)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *captures = ctx.saved_tensors
        launch = ctx.launch
        learnable = tuple(i for i, c in enumerate(captures) if ctx.needs_input_grad[4 + i])
        spec = launch.compiled.bwd_spec(launch.spec, learnable, launch.deterministic)
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dcaps = with_fallback(launch.compiled, "bwd", spec, lambda module: runtime.backward(
            module, q, k, v, out, lse, dout, dlse, captures, learnable, launch.scale, launch.interpret,
            launch.rng, spec.deterministic, launch.blocks(module, q, k, captures)))
        grads = [None] * len(captures)
        for i, g in zip(learnable, dcaps):
            grads[i] = g.to(captures[i].dtype)
        return (dq, dk, dv, None, *grads)
