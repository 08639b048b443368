"""Autograd around the generated kernels: an autograd.Function for eager calls and torch.library
custom ops for torch.compile, both running the same launch code (run_forward, run_backward).

    attncc::attention(q, k, v, captures, rng, variant, scale, dropout_p, deterministic) -> (out, lse)
    attncc::attention_backward(dout, dlse, q, k, v, out, lse, captures, rng, variant, scale,
                               dropout_p, deterministic, learnable) -> (dq, dk, dv, dcaptures)

To torch.compile each op is one opaque node whose fake implementation gives the output shapes,
so a compiled model has no graph break and a length can be one symbolic size. An op's arguments
are tensors and scalars only, so what a call needs crosses as such:

  variant   the variant's ``ir_key``: it finds a live CompiledAttention of that structure (which
            owns the generated modules) in a process-wide registry; the string is the same for
            every layer of one variant, so compiled layers share graphs and guards
  captures  the captured tensors, passed in: the kernels read the tensors handed over, and the
            float ones that require grad get gradients (parameters of a compiled module too)
  rng       dropout's (seed, offset) as an int64 tensor of 2, drawn by the caller with
            torch.randint, which traces into a compiled graph (``.tolist()`` would break it);
            None when dropout is off. The op reads it on the host.

Eager calls skip the op: its dispatch (schema defaults, pytree flattening of the capture list,
dynamo's disable wrapper) costs ~0.2 ms more per forward + backward than the Function.

Backward follows FlashAttention-2: a preprocess kernel computes Delta = rowsum(dO * O) - dlse,
the dK/dV kernel and the dQ kernel recompute P from lse tile by tile; learnable captured tensors
receive float32 gradients by atomic adds, cast to their dtype at the end.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import blocks, config, runtime, tiers
from .checks import captures_in_range, check_capture_indices, check_captures, check_qkv, check_storage
from .errors import AttnccError
from .log import logger
from .spec import Spec


@dataclass
class Launch:
    """What one call of the op needs to run a variant's kernels."""
    compiled: object        # CompiledAttention: gives the generated modules
    spec: object            # Spec of the forward
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
        fwd = module if hasattr(module, "classify") else self.compiled.module("fwd", self.spec)  # it classifies
        caps = runtime.interp_captures(captures) if self.interpret else captures
        return blocks.for_module(module, fwd, caps, q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                                 fwd.CLASS_PER_HEAD, q.device)


_fitted: dict = {}  # (variant, kernel, spec) -> the spec (tile shrink level) that launched


def with_fallback(compiled, kernel: str, spec, run, q, k):
    """run(module) with the kernel's chosen tiles (under ATTNCC_AUTOTUNE=1, the measured-fastest
    for the call's size class, attncc.tune); if they need more shared memory than the GPU has
    (a heavy mod can), regenerate with smaller tiles and remember the level that fits."""
    if config.autotune():
        from . import tune
        spec = tune.tuned_spec(compiled, kernel, spec, run, q, k)
    key = (compiled.variant.ir_key, kernel, spec)
    fitted = _fitted.get(key)
    if fitted is not None:  # launched before: the tiles fit
        return run(compiled.module(kernel, fitted))
    level = 0
    while True:
        try:
            fitted = spec if level == spec.shrink else dataclasses.replace(spec, shrink=level)
            result = run(compiled.module(kernel, fitted))
            _fitted[key] = fitted
            return result
        except Exception as e:  # triton.runtime.errors.OutOfResources; triton is imported lazily
            if type(e).__name__ != "OutOfResources" or level >= 4:
                raise
            level += 1
            logger.info("%s kernel out of resources (%s); retrying with smaller tiles (level %d)", kernel, e, level)


# ---------------------------------------------------------------------------------------------
# The registry: variant key -> live CompiledAttentions of that structure (weakly held, so that a
# registered variant never keeps its captured tensors alive).

_live: dict = {}


def register(compiled) -> None:
    """Make ``compiled`` findable by the ops under its variant's ir_key (while it is alive)."""
    _live.setdefault(compiled.variant.ir_key, weakref.WeakSet()).add(compiled)


def _find(key: str):
    return next(iter(_live.get(key, ())), None)


def lookup(key: str):
    compiled = _find(key)
    if compiled is not None:
        return compiled
    raise AttnccError("no live attncc.CompiledAttention of this variant in this process; keep a reference "
                      "to the CompiledAttention (or attncc.nn.Attention) while its outputs are in use "
                      f"(variant key {key!r})")


_specs: dict = {}  # the Specs calls have built, by their fields: one object per kind of call
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _launch(compiled, q, k, v, captures, rng, scale, dropout_p, deterministic) -> Launch:
    dropout = rng is not None
    target = runtime.target_for(q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    tma, ws = runtime.descriptor_modes(target, q, k, v)
    in_range = captures_in_range(compiled.variant, q, k, captures)
    dtype = _DTYPES[q.dtype]
    tier = "triton" if not target.startswith("cuda-sm9") else tiers.choose(
        compiled.variant, target, dtype, q.shape[-1], v.shape[-1], dropout, (q, k, v))[0]
    fields = (dtype, q.shape[-1], v.shape[-1], q.shape[1] // k.shape[1], target, dropout, tma, ws, scale > 0,
              in_range, tier)
    spec = _specs.get(fields)
    if spec is None:
        _, d, dv, group, *_ = fields
        spec = _specs[fields] = Spec(dtype, d, dv, group, target, dropout, tma=tma, ws=ws,
                                     positive_scale=scale > 0, in_range=in_range, tier=tier)
    seeds = (*rng.tolist(), dropout_p) if dropout else ()
    return Launch(compiled, spec, scale, seeds, deterministic)


def run_forward(launch: Launch, q, k, v, captures):
    """out (B, H, Lq, Dv) in q's dtype and float32 lse (B, H, Lq): the kernels of both paths."""
    return with_fallback(launch.compiled, "fwd", launch.spec, lambda module: runtime.forward(
        module, q, k, v, captures, launch.scale, launch.interpret, launch.rng, launch.blocks(module, q, k, captures)),
        q, k)


def run_backward(launch: Launch, dout, dlse, q, k, v, out, lse, captures, learnable: tuple):
    """dq, dk, dv and the gradients of captures[i] for i in learnable, in the captures' dtypes."""
    spec = launch.compiled.bwd_spec(launch.spec, learnable, launch.deterministic)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dcaps = with_fallback(launch.compiled, "bwd", spec, lambda module: runtime.backward(
        module, q, k, v, out, lse, dout, dlse, captures, learnable, launch.scale, launch.interpret,
        launch.rng, spec.deterministic, launch.blocks(module, q, k, captures)), q, k)
    return dq, dk, dv, [g.to(captures[i].dtype) for i, g in zip(learnable, dcaps)]


# ---------------------------------------------------------------------------------------------
# Eager

class AttentionFunction(torch.autograd.Function):
    """(out, lse) = attention(q, k, v; captured tensors) in eager mode."""

    @staticmethod
    def forward(ctx, q, k, v, launch: Launch, *captures):
        out, lse = run_forward(launch, q, k, v, captures)
        ctx.launch = launch
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, *captures)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *captures = ctx.saved_tensors
        learnable = tuple(i for i in range(len(captures)) if ctx.needs_input_grad[4 + i])
        dq, dk, dv, dcaps = run_backward(ctx.launch, dout, dlse, q, k, v, out, lse, captures, learnable)
        grads = [None] * len(captures)
        for i, g in zip(learnable, dcaps):
            grads[i] = g
        return (dq, dk, dv, None, *grads)


# ---------------------------------------------------------------------------------------------
# torch.compile: the custom ops, their fake implementations and autograd

@torch.library.custom_op("attncc::attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, captures: List[Tensor], rng: Optional[Tensor], variant: str,
                 scale: Optional[float], dropout_p: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """out (B, H, Lq, Dv) in q's dtype and float32 lse (B, H, Lq); inputs are checked by the caller,
    but for the captured tensors' sizes against this call's lengths, which are checked here."""
    compiled = lookup(variant)
    check_inputs_stored(compiled.variant, q, k, v, captures)
    caps = compiled.variant.captures
    if len(caps) == len(captures) and all(c.tensor is t for c, t in zip(caps, captures)):
        check_capture_indices(compiled.variant, q, k)  # it reads the sizes of the variant's own tensors
    return run_forward(_launch(compiled, q, k, v, captures, rng, scale, dropout_p, deterministic), q, k, v, captures)


@attention_op.register_fake
def _attention_fake(q, k, v, captures, rng, variant, scale, dropout_p, deterministic):
    B, H, Lq, _ = q.shape
    return runtime._like_query_layout(q, v.shape[-1], q.dtype), q.new_empty(B, H, Lq, dtype=torch.float32)


@torch.library.custom_op("attncc::attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                          lse: Tensor, captures: List[Tensor], rng: Optional[Tensor], variant: str,
                          scale: Optional[float], dropout_p: float, deterministic: bool,
                          learnable: List[int]) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
    """dq, dk, dv and the gradients of captures[i] for i in learnable (in the captures' dtypes)."""
    launch = _launch(lookup(variant), q, k, v, captures, rng, scale, dropout_p, deterministic)
    return run_backward(launch, dout, dlse, q, k, v, out, lse, captures, tuple(learnable))


@attention_backward_op.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, out, lse, captures, rng, variant, scale, dropout_p,
                             deterministic, learnable):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            [captures[i].new_empty(captures[i].shape) for i in learnable])


def _setup_context(ctx, inputs, output):
    q, k, v, captures, rng, variant, scale, dropout_p, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, rng, *captures)
    ctx.call = (variant, scale, dropout_p, deterministic)
    ctx.keep = _find(variant)  # a CompiledAttention of the variant lives until backward
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, rng, *captures = ctx.saved_tensors
    grads = [None] * len(captures)
    learnable = [i for i, need in enumerate(ctx.needs_input_grad[3]) if need]
    dq, dk, dv, dcaps = attention_backward_op(dout, dlse, q, k, v, out, lse, captures, rng, *ctx.call, learnable)
    for i, g in zip(learnable, dcaps):
        grads[i] = g
    return dq, dk, dv, grads, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# The entry point of CompiledAttention.__call__ and attncc.nn.Attention.forward: cheap checks,
# the dropout draw, then the op (under torch.compile) or the Function (eager). Everything here
# traces under dynamo.

def draw_rng(generator=None) -> Tensor:
    """(seed, offset) for one dropout call as an int64 tensor: the numbers runtime.draw_rng
    gives, from torch's default generator or ``generator``, without leaving a compiled graph."""
    if generator is None:
        return torch.randint(0, 2**31 - 1, (2,), dtype=torch.int64)
    return torch.randint(0, 2**31 - 1, (2,), generator=generator, device=generator.device)


def attend(compiled, query, key, value, captures, *, enable_gqa: bool, training: bool, generator=None):
    """(out, lse) of ``compiled``'s variant; ``captures`` are the tensors its mods read."""
    variant = compiled.variant
    check_qkv(query, key, value, enable_gqa)
    if any(t.device != query.device or t.layout != torch.strided for t in captures):
        check_captures(variant.captures, query.device)  # names the tensor
        raise AttnccError(f"captured tensors must be dense and on the inputs' device {query.device}")
    dropout = training and variant.dropout_p > 0
    rng = draw_rng(generator) if dropout else None
    dropout_p = variant.dropout_p if dropout else 0.0
    if torch.compiler.is_compiling():
        return torch.ops.attncc.attention.default(query, key, value, captures, rng, variant.ir_key, variant.scale,
                                                  dropout_p, variant.deterministic)
    check_inputs_stored(variant, query, key, value, captures)
    check_capture_indices(variant, query, key)
    launch = _launch(compiled, query, key, value, captures, rng, variant.scale, dropout_p, variant.deterministic)
    if needs_grad((query, key, value, *captures)):
        return AttentionFunction.apply(query, key, value, launch, *captures)
    return run_forward(launch, query, key, value, captures)  # nothing to differentiate: no autograd node


_QKV = ("query", "key", "value")


def check_inputs_stored(variant, query, key, value, captures) -> None:
    """AttnccError naming the input or captured tensor whose storage was freed (check_storage)."""
    check_storage((query, key, value), _QKV.__getitem__)
    if captures:
        check_storage(captures, lambda i: f"captured tensor {variant.captures[i]!r}")


def needs_grad(tensors) -> bool:
    """Whether autograd will want gradients of any of ``tensors`` (grad mode on, one requires grad)."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:  # a loop, not any(<generator>): this runs on every call (host time)
        if t.requires_grad:
            return True
    return False
