"""The torch.library ops that torch.compile sees (attncc.autograd describes them and their
arguments): their schemas, real and fake implementations and autograd formula. The real ones
run the same launch code as eager calls (attncc.autograd.run_forward, run_backward)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import autograd, runtime  # autograd imports this module at its end, its names defined by then
from .checks import check_capture_indices, own_captures, signature


_GRAPH_UNSAFE = getattr(torch._C.Tag, "cudagraph_unsafe", None)
_ATTENTION = ("(Tensor q, Tensor k, Tensor v, Tensor[] captures, Tensor? rng, str variant, float? scale, "
              "float dropout_p, bool deterministic) -> (Tensor, Tensor)")
_ATTENTION_BACKWARD = ("(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
                       "Tensor[] captures, Tensor? rng, str variant, float? scale, float dropout_p, "
                       "bool deterministic, SymInt[] learnable) -> (Tensor, Tensor, Tensor, Tensor[])")
# The ops are defined with torch.library.Library rather than torch.library.custom_op, whose
# wrapper adds Python layers and an output-aliasing check to every call of the op, which is what
# a compiled graph calls: on the CPU-only box the forward op 28.7 -> 25.6 us, the backward op
# 35.7 -> 24.2 us (benchmarks/host_path.py --stat min, causal 4x8x128x64, launches taken out).
# The library lives as long as this module: dropping it would unregister the ops.
_LIB = torch.library.Library("attncc", "FRAGMENT")


def _define(name: str, schema: str, impl, fake, graph_safe: bool = True):
    """Define attncc::<name> with ``impl`` on every backend and ``fake`` for torch.compile's
    tracing; ``graph_safe=False`` tags it cudagraph_unsafe, so that
    torch.compile(mode="reduce-overhead") runs it outside the CUDA graphs (inductor partitions
    the graph around it; a torch without graph partitions or without the tag skips CUDA graphs
    for a graph whose dropout seeds come from a CPU tensor anyway)."""
    tags = [torch.Tag.pt2_compliant_tag]  # as torch.library.custom_op tags its ops
    if not graph_safe and _GRAPH_UNSAFE is not None:
        tags.append(_GRAPH_UNSAFE)
    _LIB.define(name + schema, tags=tags)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"attncc::{name}", fake, lib=_LIB)
    return getattr(torch.ops.attncc, name).default


def _attention(q: Tensor, k: Tensor, v: Tensor, captures: List[Tensor], rng: Optional[Tensor], variant: str,
               scale: Optional[float], dropout_p: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """out (B, H, Lq, Dv) in q's dtype and float32 lse (B, H, Lq); inputs are checked by the caller,
    but for the captured tensors' sizes against this call's lengths, which are checked here."""
    compiled = autograd.lookup(variant)
    autograd.check_inputs_stored(compiled.variant, q, k, v, captures)
    own = own_captures(compiled.variant, captures)
    sig = signature(q, k, v, captures, ("op", own), rng is not None, scale, deterministic)
    call = compiled._calls.get(sig) if sig is not None else None
    if call is not None:
        seeds = autograd._seeds(rng, dropout_p, q)
        launch = autograd.Launch(compiled, call.spec, call.scale, seeds, deterministic, call)
    else:
        if own:
            check_capture_indices(compiled.variant, q, k)  # it reads the sizes of the variant's own tensors
        launch = autograd._launch(compiled, q, k, v, captures, rng, scale, dropout_p, deterministic)
        if sig is not None:
            autograd.remember(compiled, sig, launch)
    return autograd.run_forward(launch, q, k, v, captures)


def _attention_fake(q, k, v, captures, rng, variant, scale, dropout_p, deterministic):
    B, H, Lq, _ = q.shape
    return runtime._like_query_layout(q, v.shape[-1], q.dtype), q.new_empty(B, H, Lq, dtype=torch.float32)


def _attention_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                        lse: Tensor, captures: List[Tensor], rng: Optional[Tensor], variant: str,
                        scale: Optional[float], dropout_p: float, deterministic: bool,
                        learnable: List[int]) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
    """dq, dk, dv and the gradients of captures[i] for i in learnable (in the captures' dtypes)."""
    compiled = autograd.lookup(variant)
    sig = signature(q, k, v, captures, "backward", rng is not None, scale, deterministic)  # no checks here
    call = compiled._calls.get(sig) if sig is not None else None
    if call is not None:
        seeds = autograd._seeds(rng, dropout_p, q)
        launch = autograd.Launch(compiled, call.spec, call.scale, seeds, deterministic, call)
    else:
        launch = autograd._launch(compiled, q, k, v, captures, rng, scale, dropout_p, deterministic)
        if sig is not None:
            autograd.remember(compiled, sig, launch)
    return autograd.run_backward(launch, dout, dlse, q, k, v, out, lse, captures, tuple(learnable))


def _attention_backward_fake(dout, dlse, q, k, v, out, lse, captures, rng, variant, scale, dropout_p,
                             deterministic, learnable):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            [captures[i].new_empty(captures[i].shape) for i in learnable])


def _setup_context(ctx, inputs, output):
    q, k, v, captures, rng, variant, scale, dropout_p, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, rng, *captures)
    ctx.call = (variant, scale, dropout_p, deterministic)
    ctx.keep = autograd._find(variant)  # a CompiledAttention of the variant lives until backward
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, rng, *captures = ctx.saved_tensors
    grads = [None] * len(captures)
    learnable = [i for i, need in enumerate(ctx.needs_input_grad[3]) if need]
    op = attention_backward_op if rng is None else attention_dropout_backward_op
    dq, dk, dv, dcaps = op(dout, dlse, q, k, v, out, lse, captures, rng, *ctx.call, learnable)
    for i, g in zip(learnable, dcaps):
        grads[i] = g
    return dq, dk, dv, grads, None, None, None, None, None


# Without dropout a call is device work only (no host read, no CPU tensor, no state a replay
# would miss): CUDA graphs capture it. With dropout the seeds are read on the host
# (``_seeds``) and the kernels take them as numbers, which a graph would replay unchanged: those
# calls are the same code under ops that torch.compile keeps out of CUDA graphs.
attention_op = _define("attention", _ATTENTION, _attention, _attention_fake)
attention_backward_op = _define("attention_backward", _ATTENTION_BACKWARD, _attention_backward,
                                _attention_backward_fake)
attention_dropout_op = _define("attention_dropout", _ATTENTION, _attention, _attention_fake, graph_safe=False)
attention_dropout_backward_op = _define("attention_dropout_backward", _ATTENTION_BACKWARD, _attention_backward,
                                        _attention_backward_fake, graph_safe=False)
for _name in ("attention", "attention_dropout"):
    torch.library.register_autograd(f"attncc::{_name}", _backward, setup_context=_setup_context, lib=_LIB)
del _name
