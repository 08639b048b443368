"""attncc.flex_attention: FlexAttention's entry point on attncc's kernels.

``flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
return_lse=False, kernel_options=None, *, return_aux=None)`` has the signature and semantics of
``torch.nn.attention.flex_attention.flex_attention``, so switching is one import. What a call
does, in order:

    mods       each mod is traced once per *mod key*: its code and, recursively, what its
               closure cells, defaults and the globals it names hold (tensors and other objects
               by identity, numbers and strings by value). A training loop that passes the same
               mods (or rebuilds a closure over the same tensors) neither retraces nor re-hashes
               them; a new tensor object in a new closure gets a new trace, sharing kernels.
    BlockMask  its mask_mod becomes the variant's mask. Its blocks (kv_num_blocks / kv_indices,
               full_kv_*) become a class table, 0 left out, 1 partial (mask_mod applies), 2 full;
               when the table agrees with mask_mod (checked once per BlockMask for masks that read
               no tensors: every full block all True, every left-out block all False) the mask is
               mask_mod alone and attncc's derived tile bounds skip tiles; otherwise the mask reads
               the table, ``(cls == 2) | ((cls == 1) & mask_mod)``, and attncc's block
               classification rebuilds its tile lists from it (``explain`` says which).
    outputs    out, and lse / max_scores as torch returns them. max_scores (the row max of the
               scaled, modified, masked scores) is not a kernel output: it is computed exactly by
               a dense pass over query chunks (the reference evaluator, float32).

float64 inputs run attncc's dense reference (``attncc.reference``), as FlexAttention's eager path
materialises the scores too. Under ``torch.compile`` a call traces to one ``attncc::attention`` op:
the plan (trace, variant key, where each captured tensor lives) is made once per compiled graph
and guarded on the mods' code and constants; the captured tensors and the BlockMask's class table
are graph values, and the mask always reads the table (its agreement with mask_mod cannot be
checked while tracing).
"""
from __future__ import annotations

import math
import types

import torch

from . import ir, reference
from .api import CompiledAttention
from .blockmask import LARGE_BLOCK, block_use, check_block_mask, class_table, table_mask, unwrap_mask_mod
from .checks import check_qkv
from .errors import AttnccError
from .modkeys import LRU, SCALARS, lock, leaves, resolve, traced
from .variant import Variant

_compiled = LRU(64)   # (score node, mask node, scale, name, BlockMask use) -> FlexCompiled


# ---------------------------------------------------------------------------------------------
# The compiled variant of a call


class FlexCompiled(CompiledAttention):
    """A CompiledAttention built by flex_attention; ``explain()`` adds what the BlockMask became."""

    def __init__(self, variant: Variant, blocks: tuple = ()):
        super().__init__(variant)
        self.blocks = blocks

    def explain(self) -> str:
        text = super().explain()
        if not self.blocks:
            return text + "\n\nBlockMask: none (every key is attended but for the mask_mod's own)"
        return text + "\n\nBlockMask (attncc.flex_attention):\n" + "\n".join("  " + line for line in self.blocks)


def _name(score_mod, mask_mod) -> str:
    parts = [getattr(f, "__name__", None) for f in (score_mod, mask_mod) if f is not None]
    return "+".join(p for p in parts if p and p != "<lambda>") or "flex"


def compiled_for(score_mod=None, block_mask=None, *, scale=None, lengths=None, batch_heads=None) -> FlexCompiled:
    """The FlexCompiled that flex_attention runs for these mods and BlockMask (eager calls).
    ``lengths`` (Lq, Lkv) default to the BlockMask's, ``batch_heads`` (B, Hq) to its own sizes."""
    score = None if score_mod is None else traced(score_mod, "score_mod")
    mask, blocks = None, ()
    if block_mask is not None and tuple(block_mask.BLOCK_SIZE) != (LARGE_BLOCK, LARGE_BLOCK):
        mask_mod = unwrap_mask_mod(block_mask)
        mask = traced(mask_mod, "mask_mod")
        Lq, Lkv = lengths or tuple(block_mask.seq_lengths)
        B, H = batch_heads or tuple(block_mask.kv_num_blocks.shape[:2])
        use = block_use(block_mask, mask, Lq, Lkv, B, H)
        mask, blocks = use.mask, use.text
    elif block_mask is not None:
        mask = traced(unwrap_mask_mod(block_mask), "mask_mod")
    if mask is not None and mask.op == "const" and mask.value is True:
        mask = None
    name = _name(score_mod, None if block_mask is None else getattr(block_mask, "mask_mod", None))
    key = (score, mask, scale, name, blocks)
    with lock:
        hit = _compiled.get(key)
        if hit is None:
            hit = _compiled.put(key, FlexCompiled(Variant(score, mask, scale=scale, name=name), blocks))
    return hit


def explain(score_mod=None, block_mask=None, *, scale=None) -> str:
    """``explain()`` of the variant flex_attention(q, k, v, score_mod, block_mask) runs, with what
    the BlockMask became (mask_mod alone, or a mask reading its block table, and why)."""
    return compiled_for(score_mod, block_mask, scale=scale).explain()


# ---------------------------------------------------------------------------------------------
# max_scores


@torch.no_grad()
def max_scores(variant: Variant, query, key, scale: float, group: int) -> torch.Tensor:
    """float32 (B, Hq, Lq): the row max of the scaled, modified, masked scores (-inf for a row with
    every key masked), exactly as the kernels' scores, by a dense pass over query chunks."""
    B, H, Lq, D = query.shape
    Lkv = key.shape[2]
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    out = torch.full((B, H, Lq), float("-inf"), dtype=dtype, device=query.device)
    if out.numel() == 0 or Lkv == 0:
        return out.float() if dtype != torch.float64 else out
    k = key.to(dtype)
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
    dev = query.device
    rows = max(1, (1 << 24) // max(1, B * H * Lkv))
    for start in range(0, Lq, rows):
        q = query[:, :, start:start + rows].to(dtype)
        n = q.shape[2]
        env = {"score": (q @ k.transpose(-1, -2)) * scale,
               "b": torch.arange(B, device=dev).view(B, 1, 1, 1), "h": torch.arange(H, device=dev).view(1, H, 1, 1),
               "q_idx": (start + torch.arange(n, device=dev)).view(1, 1, n, 1),
               "kv_idx": torch.arange(Lkv, device=dev).view(1, 1, 1, Lkv)}
        s = reference.evaluate(variant.score_ir, env, dtype, dev).expand(B, H, n, Lkv)
        if variant.mask_ir is not None:
            s = s.masked_fill(~reference.evaluate(variant.mask_ir, env, dtype, dev).expand(B, H, n, Lkv), float("-inf"))
        out[:, :, start:start + n] = s.amax(dim=-1)
    return out if dtype == torch.float64 else out.float()


@torch.library.custom_op("attncc::flex_max_scores", mutates_args=())
def _max_scores_op(q: torch.Tensor, k: torch.Tensor, captures: list[torch.Tensor], variant: str, scale: float,
                   group: int) -> torch.Tensor:
    """max_scores inside a compiled graph: the variant found by its key, reading ``captures``."""
    from .autograd import lookup
    v = lookup(variant).variant
    if captures and any(c.tensor is not t for c, t in zip(v.captures, captures)):
        swap = {c: ir.Capture(t, c.name) for c, t in zip(v.captures, captures)}
        v = Variant(_swap(v.score_ir, swap), None if v.mask_ir is None else _swap(v.mask_ir, swap), scale=v.scale)
    return max_scores(v, q, k, scale, group)


@_max_scores_op.register_fake
def _(q, k, captures, variant, scale, group):
    return q.new_empty(q.shape[:3], dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


def _remember_captures(ctx, inputs, output):
    ctx.n_captures = len(inputs[2])


def _no_gradient(ctx, grad):
    """max_scores is not differentiable (nor in torch): no gradient reaches its inputs."""
    return None, None, [None] * ctx.n_captures, None, None, None


_max_scores_op.register_autograd(_no_gradient, setup_context=_remember_captures)


def _swap(root: ir.Node, swap: dict) -> ir.Node:
    """``root`` with its captures replaced (``swap``: Capture -> Capture)."""
    memo = {}
    for n in ir.walk(root):
        args = tuple(memo[a] for a in n.args)
        value = swap.get(n.value, n.value) if n.op == "load" else n.value
        memo[n] = n if value is n.value and args == n.args else ir.Node(n.op, args, value, n.type)
    return memo[root]


# ---------------------------------------------------------------------------------------------
# torch.compile: one plan per compiled graph


_plans: dict = {}  # plan -> FlexCompiled, alive as long as the process (graphs refer to the key)


def _leaf_sources(root_name, fn) -> tuple:
    return tuple((root_name, p, v) for p, v in leaves(fn)) if fn is not None else ()


def _compile_plan(score_mod, mask_mod, qb, kvb, per_batch, per_head, has_blocks, scale):
    """Made while torch.compile traces a call (plain Python, run once per graph): trace the mods,
    build the variant with a stand-in class table, and say where each captured tensor lives."""
    score = None if score_mod is None else traced(score_mod, "score_mod")
    mask = None if mask_mod is None else traced(mask_mod, "mask_mod")
    stand_in = None
    if has_blocks:
        stand_in = ir.Capture(torch.zeros(2 if per_batch else 1, 2 if per_head else 1, 1, 1, dtype=torch.int8),
                              "block_mask")
        mask = table_mask(stand_in, mask, qb, kvb)
    elif mask is not None and mask.op == "const" and mask.value is True:
        mask = None
    variant = Variant(score, mask, scale=scale, name=_name(score_mod, mask_mod))
    found = _leaf_sources("score_mod", score_mod) + _leaf_sources("mask_mod", mask_mod)
    sources = []
    for cap in variant.captures:
        if stand_in is not None and cap.tensor is stand_in.tensor:
            sources.append(("table", ()))
            continue
        source = next(((root, path) for root, path, v in found if v is cap.tensor), None)
        if source is None:
            source = _attribute_source(cap.tensor, found)
        if source is None:
            raise AttnccError(
                f"under torch.compile, attncc.flex_attention passes the tensors a mod reads into the graph, and "
                f"cannot find {cap!r} among the mods' closure cells, defaults, globals or their attributes; "
                "capture it in a closure (or as a default argument) of the mod")
        sources.append(source)
    checks = tuple((root, path, v) for root, path, v in found
                   if isinstance(v, (bool, int, float, str, type(None), types.CodeType, type)))
    compiled = FlexCompiled(variant, ("under torch.compile: the mask reads the BlockMask's block table "
                                      "(its agreement with mask_mod is not checked while tracing)",)
                            if has_blocks else ())
    _plans[variant.ir_key, variant.name] = compiled  # the op finds it by the key while the process lives
    return (variant.ir_key, tuple(sources), checks)


# torch._dynamo.assume_constant_result, without importing torch._dynamo (which imports triton,
# and attncc must be first to import triton on a CPU machine to switch its interpreter on)
_compile_plan._dynamo_marked_constant = True


def _attribute_source(tensor, leaves):
    """The path to ``tensor`` as an attribute of an object a mod holds (``self.bias``)."""
    for root, path, v in leaves:
        if isinstance(v, torch.Tensor) or isinstance(v, SCALARS) or isinstance(v, types.CodeType):
            continue
        for name, attr in _attributes(v):
            if attr is tensor:
                return root, path + (("attr", name),)
    return None


def _attributes(obj):
    if isinstance(obj, torch.nn.Module):
        yield from obj.named_parameters(recurse=False)
        yield from obj.named_buffers(recurse=False)
    yield from getattr(obj, "__dict__", {}).items()


def _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, want_max):
    """flex_attention inside torch.compile: one attncc::attention op (and the max_scores op)."""
    mask_mod = None
    has_blocks = False
    qb = kvb = 0
    per_batch = per_head = False
    Lq, Lkv = query.shape[2], key.shape[2]
    if block_mask is not None:
        mask_mod = unwrap_mask_mod(block_mask)
        if tuple(block_mask.BLOCK_SIZE) != (LARGE_BLOCK, LARGE_BLOCK):
            has_blocks = True
            qb, kvb = block_mask.BLOCK_SIZE
            per_batch = block_mask.kv_num_blocks.shape[0] != 1
            per_head = block_mask.kv_num_blocks.shape[1] != 1
    check_qkv(query, key, value, enable_gqa)
    ir_key, sources, checks = _compile_plan(score_mod, mask_mod, qb, kvb, per_batch, per_head, has_blocks, scale)
    roots = {"score_mod": score_mod, "mask_mod": mask_mod}
    for root, path, v in checks:  # guards: a plan holds while what it read is unchanged
        now = resolve(roots[root], path)
        if (now is not v) if isinstance(v, (types.CodeType, type)) else (now != v):
            raise AttnccError("internal: a compiled flex_attention plan is stale")
    table = class_table(block_mask, Lq, Lkv) if has_blocks else None
    captures = [table if src[0] == "table" else resolve(roots[src[0]], src[1]) for src in sources]
    group = query.shape[1] // key.shape[1]
    out, lse = torch.ops.attncc.attention.default(query, key, value, captures, None, ir_key, scale, 0.0, False)
    mx = torch.ops.attncc.flex_max_scores.default(query, key, captures, ir_key,
                                                  scale if scale is not None else 1.0 / math.sqrt(query.shape[-1]),
                                                  group) if want_max else None
    return out, lse, mx


# ---------------------------------------------------------------------------------------------
# The entry point


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """``torch.nn.attention.flex_attention.flex_attention`` on attncc's kernels (same arguments,
    same results): query (B, Hq, Lq, E), key (B, Hkv, Lkv, E), value (B, Hkv, Lkv, Ev) ->
    (B, Hq, Lq, Ev); ``return_aux=AuxRequest(lse=True, max_scores=True)`` adds an AuxOutput,
    ``return_lse=True`` (deprecated in torch) the lse. ``kernel_options`` are FlexAttention's Triton
    knobs and are accepted and ignored: attncc picks its own tiles (ATTNCC_TILES, ATTNCC_AUTOTUNE).
    Differentiable, GQA with ``enable_gqa=True``; float64 inputs run attncc's dense reference."""
    if return_lse and return_aux is not None:
        raise AttnccError("pass return_lse or return_aux, not both (return_lse is deprecated in torch: use "
                          "return_aux=AuxRequest(lse=True))")
    if return_aux is not None and not (hasattr(return_aux, "lse") and hasattr(return_aux, "max_scores")):
        raise AttnccError(f"return_aux must be an AuxRequest(lse=..., max_scores=...), got {type(return_aux).__name__}")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise AttnccError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    want_max = return_aux is not None and return_aux.max_scores
    if scale is not None and not isinstance(scale, (int, float)):
        scale = float(scale)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise AttnccError(f"{name} must be a 4-D tensor (batch, heads, seq_len, head_dim), as in FlexAttention")
    if block_mask is not None:
        if not all(hasattr(block_mask, a) for a in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "mask_mod")):
            raise AttnccError(f"block_mask must be a torch.nn.attention.flex_attention.BlockMask (create_block_mask, "
                              f"BlockMask.from_kv_blocks), got {type(block_mask).__name__}; for a mask function "
                              "alone use attncc.attention(q, k, v, mask_mod=...)")
        check_block_mask(block_mask, query, key)
    if torch.compiler.is_compiling():
        out, lse, mx = _compiled_call(query, key, value, score_mod, block_mask, scale, enable_gqa, want_max)
    else:
        out, lse, mx = _eager_call(query, key, value, score_mod, block_mask, scale, enable_gqa, want_max)
    if return_aux is not None:
        from torch.nn.attention.flex_attention import AuxOutput
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=mx if want_max else None)
    return (out, lse) if return_lse else out


def _eager_call(query, key, value, score_mod, block_mask, scale, enable_gqa, want_max):
    B, H, Lq, _ = query.shape
    compiled = compiled_for(score_mod, block_mask, scale=scale, lengths=(Lq, key.shape[2]), batch_heads=(B, H))
    variant = compiled.variant
    if query.dtype == torch.float64:
        out, lse = reference.attention_variant(variant, query, key, value, enable_gqa=enable_gqa, return_lse=True)
    else:
        out, lse = compiled(query, key, value, enable_gqa=enable_gqa, return_lse=True)
    mx = None
    if want_max:
        s = variant.scale if variant.scale is not None else 1.0 / math.sqrt(query.shape[-1])
        mx = max_scores(variant, query, key, s, query.shape[1] // max(1, key.shape[1]))
    return out, lse, mx
