"""Autograd around the generated kernels: an autograd.Function for eager calls and torch.library
ops for torch.compile (defined in attncc.ops), all running the same launch code (run_forward,
run_backward).

    attncc::attention(q, k, v, captures, rng, variant, scale, dropout_p, deterministic) -> (out, lse)
    attncc::attention_backward(dout, dlse, q, k, v, out, lse, captures, rng, variant, scale,
                               dropout_p, deterministic, learnable) -> (dq, dk, dv, dcaptures)
    attncc::attention_dropout, attncc::attention_dropout_backward: the same, for calls with
                               dropout, tagged cudagraph_unsafe (see below)

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

CUDA graphs (torch.compile(mode="reduce-overhead"), torch.cuda.graph): a call without dropout is
device work only -- no host read of a device tensor, no CPU tensor, tile lists of block-sparse
masks classified inside the graph (Launch.blocks) -- so a replay computes what a fresh call
would. Dropout's seeds are host numbers the kernels take as arguments, which a replay would
repeat: its ops are kept out of the graphs, and a capture of a dropout call is refused (_seeds).

Host time per call: the checks and decisions of a call (Spec, tier, descriptor modes, the
module that fits) are kept per signature of its inputs (``signature``, ``Decision``), so a
repeated call pays one key and one lookup; benchmarks/host_path.py measures the path with the
kernel launches taken out. Eager calls skip the op: its dispatch (schema defaults, pytree
flattening of the capture list, dynamo's disable wrapper) costs ~0.2 ms more per forward +
backward than the Function.

Backward follows FlashAttention-2: a preprocess kernel computes Delta = rowsum(dO * O) - dlse,
the dK/dV kernel and the dQ kernel recompute P from lse tile by tile; learnable captured tensors
receive float32 gradients by atomic adds, cast to their dtype at the end.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from . import blocks, config, runtime, tiers
from .checks import (captures_in_range, check_capture_indices, check_captures, check_qkv, check_storage,
                     own_captures, signature)
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
    call: object = None     # the Decision of calls like this one (run_forward fills in its module)

    @property
    def interpret(self) -> bool:
        return self.spec.target == "interpreter"

    def blocks(self, module, q, k, captures):
        """Tile lists for a data-dependent mask (None when the kernels derive their own bounds)."""
        if not module.BLOCK_SPARSE:
            return None
        fwd = self.compiled.classifier(self.spec)
        caps = runtime.interp_captures(captures) if self.interpret else captures
        args = (module, fwd, caps, q.shape[0], q.shape[1], q.shape[2], k.shape[2], fwd.CLASS_PER_HEAD, q.device)
        if q.is_cuda and _graph_pool_call(q.device):
            return _captured_blocks(*args)
        return blocks.for_module(*args)


def _graph_pool_call(device) -> bool:
    """Whether a CUDA call runs for a CUDA graph: captured (torch.cuda.graph, or the recording run
    of torch.compile(mode="reduce-overhead")'s cudagraph trees), or in the trees' warm-up run,
    which allocates from the graphs' memory pool and then checks that nothing but its outputs
    stayed alive there. (The trees' state is read from torch._inductor, where it is private:
    unreadable, the call counts as not for a graph.)"""
    if torch.cuda.is_current_stream_capturing():
        return True
    trees = sys.modules.get("torch._inductor.cudagraph_trees")  # not imported: no trees
    if trees is None:
        return False
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = trees.get_manager(index, create_if_none_exists=False)
        return manager is not None and bool(manager.in_warmup)
    except Exception:  # another torch's private state
        return False


def _captured_blocks(module, fwd, captures, B, H, Lq, Lkv, per_head, device) -> dict:
    """blocks.for_module without its caches, for a call run for a CUDA graph (_graph_pool_call).
    Captured, the classification and the tile lists must be kernels of the graph, so that each
    replay classifies the captured tensors' contents of that replay: a cached table would be read
    as it was at capture time, and a document mask whose ids change between steps would keep the
    first step's tiles. In the warm-up run, a table kept in the cache would be memory of the
    graphs' pool that cudagraph trees find alive and refuse. Device work only (no host sync)."""
    X = B * H if per_head else 1
    table = torch.empty(X, -(-Lq // blocks.FINE), -(-Lkv // blocks.FINE), dtype=torch.int8, device=device)
    if table.numel():
        fwd.classify(table, captures, H, Lq, Lkv, blocks.FINE)
    return blocks.module_lists(module, table)


_fitted: dict = {}  # (variant, kernel, spec) -> the spec (tile shrink level) that launched


def with_fallback(compiled, kernel: str, spec, run, q, k):
    """run(module) with the kernel's chosen tiles (under ATTNCC_AUTOTUNE=1, the measured-fastest
    for the call's size class, attncc.tune); if they need more shared memory than the GPU has
    (a heavy mod can), regenerate with smaller tiles and remember the level that fits."""
    if config.autotune():
        from . import tune
        spec = tune.tuned_spec(compiled, kernel, spec, run, q, k)
    key = (compiled.variant.ir_key, kernel, spec)
    fitted = _fitted.get(key) or spec  # launched before: the level that fitted then
    while True:
        try:
            result = run(compiled.module(kernel, fitted))
        except Exception as e:  # triton.runtime.errors.OutOfResources; triton is imported lazily
            # (also at a level that fitted before: a variant of the same structure whose captured
            # tensors have a wider dtype compiles to another kernel from the same source)
            if type(e).__name__ != "OutOfResources" or fitted.shrink >= 4:
                raise
            fitted = dataclasses.replace(spec, shrink=fitted.shrink + 1)
            logger.info("%s kernel out of resources (%s); retrying with smaller tiles (level %d)", kernel, e,
                        fitted.shrink)
            continue
        if _fitted.get(key) is not fitted:
            _fitted[key] = fitted
        return result


# ---------------------------------------------------------------------------------------------
# The registry: variant key -> live CompiledAttentions of that structure (weakly held, so that a
# registered variant never keeps its captured tensors alive).

_live: dict = {}


def register(compiled) -> None:
    """Make ``compiled`` findable by the ops under its variant's ir_key (while it is alive)."""
    _live.setdefault(compiled.variant.ir_key, weakref.WeakSet()).add(compiled)


_last: dict = {}  # variant key -> weak reference to the CompiledAttention _find returned last


def _find(key: str):
    """A live CompiledAttention registered under ``key``, or None. The op runs this on every call:
    the one found last is kept by weak reference (iterating a WeakSet takes a guard: ~1 us)."""
    ref = _last.get(key)
    compiled = ref() if ref is not None else None
    if compiled is None:
        compiled = next(iter(_live.get(key, ())), None)
        if compiled is not None:
            _last[key] = weakref.ref(compiled)
    return compiled


def lookup(key: str):
    compiled = _find(key)
    if compiled is not None:
        return compiled
    raise AttnccError("no live attncc.CompiledAttention of this variant in this process; keep a reference "
                      "to the CompiledAttention (or attncc.nn.Attention) while its outputs are in use "
                      f"(variant key {key!r})")


_specs: dict = {}  # the Specs calls have built, by their fields: one object per kind of call
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _launch(compiled, q, k, v, captures, rng, scale, dropout_p, deterministic, call=None) -> Launch:
    """The Launch of a call from its inputs: the Spec (target, TMA and warp-specialisation modes,
    captures read in range, tier) and the scale. Callers keep it per signature of the inputs
    (``signature``, ``remember``): a repeated call forms one key instead."""
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
    return Launch(compiled, spec, scale, _seeds(rng, dropout_p, q), deterministic, call)


def _seeds(rng, dropout_p, q) -> tuple:
    """(seed, offset, dropout_p) from the int64 tensor of two draw_rng made; () without dropout.
    The seeds are read on the host and passed as numbers, so a CUDA graph capturing the call
    would replay its mask forever: refused (torch.compile keeps the attncc::attention_dropout
    ops out of its graphs; a hand-made torch.cuda.graph or another op's caller gets this error)."""
    if rng is None:
        return ()
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise AttnccError(
            "attncc dropout cannot run inside a CUDA graph capture: its seeds are read on the host, so every "
            "replay would drop the same attention weights. Capture the model in evaluation (training=False, "
            "model.eval()) or with dropout_p=0, or leave this call outside the graph (torch.compile "
            "does that for attncc's own dropout op under mode=\"reduce-overhead\")")
    return (*rng.tolist(), dropout_p)


# ---------------------------------------------------------------------------------------------
# Decisions per signature. Every call used to check its inputs, find its Spec and the generated
# module that fits: 6.2 us per forward on the CPU-only box (check_qkv 1.5, check_capture_indices
# 1.0, _launch 3.7), more on an sm90 GPU, where the TMA and tier choices inspect q, k and v, plus
# 1-2 us of module lookups in with_fallback per kernel. All of it is a function of the call's
# signature, so a call whose signature was checked and decided before forms the key and looks it
# up: 3.5 us (signature 2.9, the lookup 0.6).

class Decision:
    """What the checks and decisions of one signature concluded: the forward's Spec, the scale,
    the Spec whose forward module launched (None until one did; with_fallback may have shrunk
    the tiles) and those of the backward, by backward Spec (CompiledAttention.bwd_spec). Specs,
    not modules: a call finds the module through CompiledAttention.module (one lookup), so a
    process that forgets its loaded kernels finds and verifies the files again."""
    __slots__ = ("spec", "scale", "fwd", "bwd")

    def __init__(self, spec, scale):
        self.spec, self.scale, self.fwd, self.bwd = spec, scale, None, {}


MAX_DECISIONS = 1024  # signatures one CompiledAttention keeps before it starts over


def remember(compiled, sig, launch: Launch) -> None:
    """Keep ``launch``'s decisions for calls of signature ``sig`` (checked and decided)."""
    calls = compiled._calls
    if len(calls) >= MAX_DECISIONS:  # many lengths (dynamic shapes): start over
        calls.clear()
    launch.call = calls[sig] = Decision(launch.spec, launch.scale)


def run_forward(launch: Launch, q, k, v, captures):
    """out (B, H, Lq, Dv) in q's dtype and float32 lse (B, H, Lq): the kernels of both paths."""
    call = launch.call
    if call is not None and call.fwd is not None:  # launched before under this signature: the tiles fit
        module = launch.compiled.module("fwd", call.fwd)
        return runtime.forward(module, q, k, v, captures, launch.scale, launch.interpret, launch.rng,
                               launch.blocks(module, q, k, captures) if module.BLOCK_SPARSE else None)
    result = with_fallback(launch.compiled, "fwd", launch.spec, lambda module: runtime.forward(
        module, q, k, v, captures, launch.scale, launch.interpret, launch.rng, launch.blocks(module, q, k, captures)),
        q, k)
    if call is not None and not config.autotune():  # the tuner may choose per call
        call.fwd = _fitted.get((launch.compiled.variant.ir_key, "fwd", launch.spec))
    return result


def run_backward(launch: Launch, dout, dlse, q, k, v, out, lse, captures, learnable: tuple):
    """dq, dk, dv and the gradients of captures[i] for i in learnable, in the captures' dtypes."""
    spec = launch.compiled.bwd_spec(launch.spec, learnable, launch.deterministic, k.shape[2])
    if dout is None:
        dout = torch.zeros_like(out)
    call = launch.call
    fitted = call.bwd.get(spec) if call is not None else None
    if fitted is not None:  # launched before for this signature and backward Spec
        module = launch.compiled.module("bwd", fitted)
        dq, dk, dv, dcaps = runtime.backward(
            module, q, k, v, out, lse, dout, dlse, captures, learnable, launch.scale, launch.interpret, launch.rng,
            spec.deterministic, launch.blocks(module, q, k, captures) if module.BLOCK_SPARSE else None)
    else:
        dq, dk, dv, dcaps = with_fallback(launch.compiled, "bwd", spec, lambda module: runtime.backward(
            module, q, k, v, out, lse, dout, dlse, captures, learnable, launch.scale, launch.interpret,
            launch.rng, spec.deterministic, launch.blocks(module, q, k, captures)), q, k)
        if call is not None and not config.autotune():
            fitted = _fitted.get((launch.compiled.variant.ir_key, "bwd", spec))
            if fitted is not None:
                call.bwd[spec] = fitted
    if not learnable:
        return dq, dk, dv, []
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
        needs = ctx.needs_input_grad
        learnable = tuple([i for i in range(len(captures)) if needs[4 + i]]) if captures else ()
        dq, dk, dv, dcaps = run_backward(ctx.launch, dout, dlse, q, k, v, out, lse, captures, learnable)
        grads = [None] * len(captures)
        for i, g in zip(learnable, dcaps):
            grads[i] = g
        return (dq, dk, dv, None, *grads)


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
    """(out, lse) of ``compiled``'s variant; ``captures`` are the tensors its mods read.

    Eager, a call whose signature (``signature``) passed the checks before skips them and
    takes the Spec and module decided then: one key and one lookup. Checks whose inputs a
    signature does not hold run on every call: freed storage (check_inputs_stored)."""
    variant = compiled.variant
    dropout = training and variant.dropout_p > 0
    if torch.compiler.is_compiling():  # traced once per graph: the checks, then one op
        check_call(variant, query, key, value, captures, enable_gqa)
        if not dropout:
            return torch.ops.attncc.attention.default(query, key, value, captures, None, variant.ir_key,
                                                      variant.scale, 0.0, variant.deterministic)
        return torch.ops.attncc.attention_dropout.default(query, key, value, captures, draw_rng(generator),
                                                          variant.ir_key, variant.scale, variant.dropout_p,
                                                          variant.deterministic)
    # captures other than the variant's own: check_capture_indices reads the variant's, which a
    # signature does not hold, so such calls are checked every time
    sig = signature(query, key, value, captures, bool(enable_gqa), dropout, variant.scale,
                    variant.deterministic) if own_captures(variant, captures) else None
    call = compiled._calls.get(sig) if sig is not None else None
    if call is None:
        check_call(variant, query, key, value, captures, enable_gqa)
    rng = draw_rng(generator) if dropout else None
    dropout_p = variant.dropout_p if dropout else 0.0
    check_inputs_stored(variant, query, key, value, captures)
    if call is None:
        check_capture_indices(variant, query, key)
        launch = _launch(compiled, query, key, value, captures, rng, variant.scale, dropout_p, variant.deterministic)
        if sig is not None:
            remember(compiled, sig, launch)
    else:
        launch = Launch(compiled, call.spec, call.scale, _seeds(rng, dropout_p, query), variant.deterministic, call)
    if needs_grad((query, key, value, *captures)):
        return _apply(query, key, value, launch, captures)
    return run_forward(launch, query, key, value, captures)  # nothing to differentiate: no autograd node


def check_call(variant, query, key, value, captures, enable_gqa) -> None:
    """The checks of q, k, v (check_qkv) and of the captured tensors' devices and layouts."""
    check_qkv(query, key, value, enable_gqa)
    for t in captures:  # a loop, not any(<generator>): host time per call
        if t.device != query.device or t.layout != torch.strided:
            check_captures(variant.captures, query.device)  # names the tensor
            raise AttnccError(f"captured tensors must be dense and on the inputs' device {query.device}")


# AttentionFunction.apply is torch's Python wrapper around the C++ apply: it binds arguments and
# passes every argument through functorch's dead-wrapper check, 7.1 -> 5.4 us per call on the
# CPU-only box when called directly. _apply does the same unwrapping for the tensors itself.
_c_apply = vars(torch._C._FunctionBase).get("apply")  # a classmethod of the C++ base
_function_apply = _c_apply.__get__(None, AttentionFunction) if _c_apply is not None else None
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def _apply(query, key, value, launch, captures):
    """AttentionFunction.apply(query, key, value, launch, *captures), without its Python layer
    where that is the same call (no functorch transform active: vmap, grad, ...)."""
    if _function_apply is None or _unwrap_if_dead is None or torch._C._are_functorch_transforms_active():
        return AttentionFunction.apply(query, key, value, launch, *captures)
    unwrap = _unwrap_if_dead
    return _function_apply(unwrap(query), unwrap(key), unwrap(value), launch, *[unwrap(t) for t in captures])


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


from . import ops  # noqa: E402,F401  (defines the attncc:: ops that attend calls; it imports this module)
