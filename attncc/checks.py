"""Validation of user inputs per call: every failure names the problem and the fix.

What needs no inputs (a mod's arity, return type and operations; scale; dropout_p) is checked
once, when a Variant is built (attncc.trace, attncc.variant). What depends on the call's
tensors is checked here, before any kernel is generated or launched: the query/key/value
shapes, dtypes and devices (``check_qkv``), the captured tensors' devices and layouts
(``check_captures``) and whether the captured tensors are large enough for the indices the
mods read them at (``check_capture_indices``); ``captures_in_range`` finds the tensors that every
index stays inside, whose loads then compile without bounds masks. ``signature`` is everything
these checks read, as one key: a call whose signature passed them before is not checked again
(attncc.autograd), except for freed storage (``check_storage``), which no key holds.
"""
from __future__ import annotations

import math

import torch

from . import config, ir
from .errors import AttnccError
from .passes.ranges import interval

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_qkv(q, k, v, enable_gqa: bool, dtypes=DTYPES, max_head_dim=MAX_HEAD_DIM) -> int:
    """Validate query/key/value; return the GQA group size Hq // Hkv."""
    # valid inputs pass one expression (host time per call); anything else gets its message below
    if (type(q) is type(k) is type(v) is torch.Tensor and q.dim() == k.dim() == v.dim() == 4
            and q.layout is k.layout is v.layout is torch.strided):
        (B, Hq, _, D), (Bk, Hkv, Lk, Dk), (Bv, Hv, Lv, Dv) = q.shape, k.shape, v.shape
        if (q.dtype in dtypes and q.dtype == k.dtype == v.dtype and B == Bk == Bv and Hkv == Hv and Lk == Lv
                and D == Dk and 0 < D <= max_head_dim and 0 < Dv <= max_head_dim and Hkv and not Hq % Hkv
                and (enable_gqa or Hq == Hkv) and q.device == k.device == v.device):
            return Hq // Hkv
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise AttnccError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_layout(name, t)
        if t.dim() != 4:
            raise AttnccError(
                f"{name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}; "
                "for (batch, seq_len, heads, head_dim) tensors pass x.transpose(1, 2) (no copy needed)")
        if t.dtype not in dtypes:
            raise AttnccError(f"{name} has dtype {t.dtype}; attncc kernels support float16, bfloat16 and float32")
    if not q.dtype == k.dtype == v.dtype:
        raise AttnccError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                          "convert with .to(dtype)")
    if not q.device == k.device == v.device:
        raise AttnccError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise AttnccError(f"batch sizes differ: query {B}, key {k.shape[0]}, value {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise AttnccError(f"key and value must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise AttnccError(f"key and value must have the same sequence length, got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != D:
        raise AttnccError(f"query and key head dims differ ({D} vs {k.shape[3]}); they are dotted together")
    for name, d in (("query/key", D), ("value", v.shape[3])):
        if not 1 <= d <= max_head_dim:
            raise AttnccError(f"{name} head dim {d} is outside the supported range 1..{max_head_dim}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise AttnccError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA/MQA")
    if Hq != Hkv and not enable_gqa:
        raise AttnccError(f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True for "
                          "grouped-query / multi-query attention")
    return Hq // Hkv


def check_layout(name: str, t: torch.Tensor) -> None:
    """An input must be a dense (strided) tensor: the kernels read it in place through its
    strides; sparse and MKL-DNN layouts have none."""
    if t.layout != torch.strided:
        raise AttnccError(f"{name} has layout {t.layout}; attncc reads dense tensors through their strides: "
                          f"pass {name}.to_dense()")


def check_captures(captures, device: torch.device) -> None:
    """Captured tensors must live on the inputs' device and be dense (the kernels read them in
    place through their strides). Their dtypes were checked when the mod was traced."""
    for c in captures:
        t = c.tensor
        if t.device != device:
            raise AttnccError(
                f"captured tensor {c!r} is on {t.device} but the inputs are on {device}; "
                f"create it on {device} (or move it with .to(device) before building the mod)")
        if t.layout != torch.strided:
            raise AttnccError(f"captured tensor {c!r} has layout {t.layout}; the kernels read dense tensors: "
                              "capture t.to_dense() instead")


def check_storage(tensors, name) -> None:
    """Every tensor the kernels read must still have its storage: one freed in place
    (``t.untyped_storage().resize_(0)``, as FSDP does between uses) keeps its shape but points
    nowhere, and a kernel reading it returns garbage or crashes. ``name(i)`` names tensors[i]
    in the error. A loop of cheap reads (host time per call)."""
    for i, t in enumerate(tensors):
        if not t.untyped_storage().nbytes() and t.numel():
            raise AttnccError(
                f"{name(i)} (shape {tuple(t.shape)}) has no storage: it was freed in place (untyped_storage()."
                "resize_(0), as FSDP does with parameters between uses). Call attncc while the tensor holds "
                "its data (inside FSDP's forward / after it gathers the parameters), or pass a tensor that owns "
                "its memory")


_LENGTHS = {"b": "B", "h": "Hq", "q_idx": "Lq", "kv_idx": "Lkv"}
_MEMO_SIZE = 256


def check_capture_indices(variant, query, key) -> None:
    """Raise AttnccError when a captured tensor is too small for an index the mods read it at,
    for attention of ``query`` (B, Hq, Lq, D) over ``key`` (B, Hkv, Lkv, D): b, h, q_idx and
    kv_idx run over [0, B), [0, Hq), [0, Lq) and [0, Lkv).

    Checked (``variant.index_sites``, see attncc.passes.ranges): a dimension indexed by a bare
    ``b``, ``h``, ``q_idx`` or ``kv_idx`` must have at least B, Hq, Lq or Lkv entries; an index
    the mod bounds itself (``clamp``, ``%``, ``&`` with constants) must stay inside its
    dimension at this call's lengths, negative values included. Not checked: indices shifted
    by constants or combining leaves (``kv_idx - 5``, ``q_idx - kv_idx + L - 1``), whose reads
    outside the tensor give 0 by design (padding, or positions a mask removes) --
    ATTNCC_INDEX_CHECK=all checks their upper end too; indices computed from captured tensors'
    values (``bias[doc_ids[q_idx]]``), which would need reading the tensors on every call; and
    loads inside a ``torch.where`` branch, which the condition may guard. Mask_mods do not
    exempt a score_mod's reads: both are evaluated on every position of a visited tile.
    ATTNCC_INDEX_CHECK=off turns the check off.

    Cost: the sites are found once per variant; a call with lengths and capture shapes seen
    before costs one set lookup (about 2 us).
    """
    if not variant.index_sites:
        return
    B, Hq, Lq, _ = query.shape
    Lkv = key.shape[2]
    # a call like one checked before (lengths, capture shapes, the knob) costs this lookup alone
    seen = (B, Hq, Lq, Lkv, config.index_check(), *[c.tensor.shape for c in variant.captures])
    if seen in variant.index_checked:
        return
    check_index_ranges(variant, {"b": (0, B - 1), "h": (0, Hq - 1), "q_idx": (0, Lq - 1), "kv_idx": (0, Lkv - 1)},
                       (B, Hq, Lq, Lkv))
    variant.index_checked.add(seen)  # reached only when the check passed


def check_index_ranges(variant, leaves: dict, lengths: tuple | None = None) -> None:
    """``check_capture_indices`` for any positions: ``leaves`` maps b, h, q_idx and kv_idx to the
    inclusive (first, last) values the kernels give them (a KV cache's queries sit after its
    earlier tokens, say); an empty range (last < first) means nothing is read. ``lengths``
    (B, Hq, Lq, Lkv), when given, names the call's shape in messages."""
    sites = variant.index_sites
    if not sites:
        return
    mode = config.index_check()
    if mode == "off":
        return
    caps = variant.captures
    memo = (tuple(leaves.items()), mode, tuple(tuple(c.tensor.shape) for c in caps))
    if memo in variant.index_checked:
        return
    if all(lo <= hi for lo, hi in leaves.values()):  # with an empty axis no score exists: nothing is read
        described = (", ".join(f"{n}={v}" for n, v in zip(_LENGTHS.values(), lengths)) if lengths else
                     ", ".join(f"{k} in {lo}..{hi}" for k, (lo, hi) in leaves.items()))
        for site in sites:
            if site.kind == "data" or (site.kind == "shifted" and mode != "all"):
                continue
            size = caps[site.capture].tensor.shape[site.dim]
            lo, hi = interval(site.index, leaves)
            if hi >= size or (lo < 0 and site.kind != "shifted"):
                raise AttnccError(_index_message(site, caps[site.capture], lo, hi, size, described))
    if len(variant.index_checked) >= _MEMO_SIZE:
        variant.index_checked.clear()
    variant.index_checked.add(memo)


# ---------------------------------------------------------------------------------------------
# What the checks read, as one key: attncc.autograd runs the checks once per signature

def signature(q, k, v, captures, gqa, dropout: bool, scale, deterministic: bool):
    """Everything the checks and decisions of a call read, as one hashable tuple, or None when
    it cannot be formed (a non-tensor, a layout without strides: such a call takes the checks,
    which name the problem). ``gqa`` says which checks the caller runs on a new signature:
    enable_gqa in eager calls (all of them); ("op", own) in the forward op, which leaves q, k
    and v to its caller and checks capture indices only on the variant's own tensors; "backward"
    in the backward op, which checks nothing -- so the paths never share an entry.

    What reads what: check_qkv the types, layouts, shapes, dtypes and devices of q, k, v and
    enable_gqa; the capture checks their devices and layouts; check_capture_indices and
    captures_in_range the lengths, the captures' shapes, ATTNCC_INDEX_CHECK and ATTNCC_TILES;
    descriptor_modes and tiers.choose the strides, 16-byte alignment of the data pointers,
    dtypes and head dims, ATTNCC_TMA, ATTNCC_WS and ATTNCC_TIER; with_fallback ATTNCC_AUTOTUNE.
    The knobs are read through attncc.config, so a bad value still raises on every call.
    A check that reads something new must add it here (attncc.autograd keeps decisions by this key).
    Storage (freed in place) is not part of a signature: check_inputs_stored runs every call."""
    tiles = config.tile_overrides()
    knobs = (config.index_check(), config.tma(), config.ws(), config.tier(), config.autotune(),
             tuple(tiles.items()) if tiles else ())
    try:
        key = (type(q), type(k), type(v), q.layout, k.layout, v.layout, q.dtype, k.dtype, v.dtype,
               q.device, k.device, v.device, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(),
               q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, gqa, dropout, scale, deterministic, knobs)
        for t in captures:  # a loop, not a generator: host time per call
            key += (type(t), t.layout, t.dtype, t.device, t.shape)
    except (AttributeError, RuntimeError, TypeError, NotImplementedError):
        return None
    return key


def own_captures(variant, captures) -> bool:
    """Whether ``captures`` are the variant's own tensors (check_capture_indices reads those)."""
    caps = variant.captures
    if len(caps) != len(captures):
        return False
    for c, t in zip(caps, captures):  # a loop, not all(<generator>): host time per call
        if c.tensor is not t:
            return False
    return True


WHOLE_TILE = 128  # the largest tile of the training kernels: their positions reach lengths rounded up to it


def captures_in_range(variant, query, key, captures) -> tuple:
    """Numbers of the captured tensors that every index the mods read stays inside for attention
    of ``query`` over ``key``, loads inside a branch of ``torch.where`` included: the training
    kernels read those without bounds masks (``Spec.in_range``). Positions run over the lengths
    rounded up to whole tiles, since a ragged tile evaluates the mods on rows and columns past
    the end before masking them. H200, relative-position table (causal, bf16), forward
    0.561 -> 0.487 ms at 16x16x1024x128 and 1.640 -> 1.382 at 4x16x4096x128 without the masks
    (A/B against d4c3a48; 1.7% slower at head dim 64, README).
    Memoised per lengths and capture shapes: a call like one seen before costs one lookup."""
    if not captures:
        return ()
    B, Hq, Lq, _ = query.shape
    Lkv = key.shape[2]
    overrides = config.tile_overrides()  # ATTNCC_TILES may ask for larger tiles
    memo = (B, Hq, Lq, Lkv, *[t.shape for t in captures], *overrides.values())
    hit = variant.in_range.get(memo)
    if hit is not None:
        return hit
    tile = max([WHOLE_TILE] + [max(t[:2]) for t in overrides.values()])
    whole = lambda n: -(-n // tile) * tile  # noqa: E731
    leaves = {"b": (0, B - 1), "h": (0, Hq - 1), "q_idx": (0, whole(Lq) - 1), "kv_idx": (0, whole(Lkv) - 1)}
    outside = set()
    for site in variant.load_sites:
        lo, hi = interval(site.index, leaves)
        if not 0 <= lo <= hi < captures[site.capture].shape[site.dim]:
            outside.add(site.capture)
    inside = () if 0 in (B, Hq, Lq, Lkv) else tuple(i for i in range(len(captures)) if i not in outside)
    if len(variant.in_range) >= _MEMO_SIZE:
        variant.in_range.clear()
    variant.in_range[memo] = inside
    return inside


def _index_message(site, cap, lo, hi, size, described) -> str:
    name = f"`{cap.name}`" if cap.name else f"cap{site.capture}"
    text = ir.to_text(site.index)
    lo, hi = (int(x) if math.isfinite(x) else x for x in (lo, hi))
    head = (f"captured tensor {name} of shape {tuple(cap.tensor.shape)} is too small for its index `{text}` "
            f"in dimension {site.dim}: ")
    if site.kind == "axis":
        leaf = site.index.op
        return (head + f"{leaf} runs over {lo}..{hi} in this call ({described}), but the dimension has "
                f"{size} entries. Give it {hi + 1} entries, one per {leaf}, or bound the index (e.g. "
                f"torch.clamp({leaf}, max={size - 1})); attncc would read 0 past the end.")
    if hi >= size:
        return (head + f"the index reaches {hi} in this call ({described}), but the dimension has {size} "
                f"entries (0..{size - 1}). Give it at least {hi + 1} entries or bound the index "
                f"(torch.clamp(..., 0, {size - 1})); attncc would read 0 past the end."
                + (" (Shifted indices are checked because ATTNCC_INDEX_CHECK=all.)" if site.kind == "shifted" else ""))
    return (head + f"the index goes down to {lo} in this call ({described}). attncc reads 0 at negative "
            f"indices, where PyTorch indexing would wrap around to the end: add {-lo} so the index starts "
            "at 0, and size the tensor for it.")
