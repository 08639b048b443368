"""attncc as a Hugging Face transformers attention backend: ``attn_implementation="attncc"``.

    import attncc.integrations.transformers          # registers "attncc"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attncc")

Importing this module registers the name with transformers' ``AttentionInterface`` (the
attention, ``attention_forward``) and ``AttentionMaskInterface`` (``mask_interface``, in
``_hf_masks``): a name registered with the first alone gets ``attention_mask=None``. Every
attention layer then runs attncc kernels, and no dense mask is built:

  mask      once per forward and mask type, an ``AttnccMask``: causal or bidirectional, the
            sliding window, the padding, document ids of packed sequences (read off the mask
            function transformers built from position_ids), the queries' offset among the keys
  variants  one ``attncc.CompiledAttention`` per kind of call (causal, window, softcap, scale,
            dropout, which per-call tensors its mods read, user mods), built once and shared by
            every layer and step; the per-call tensors (padding, document ids, the offset) are
            handed to its kernels as their captured tensors, never copied
  paths     prefill and training: attncc's FlashAttention kernels (autograd, dropout).
            Decoding and chunked prefill over a DynamicCache (queries at the end of the keys):
            the inference kernel, bottom-right aligned, split-KV when few queries meet many
            keys. A StaticCache in eager mode is cut to the keys the queries can see, then the
            same. Under torch.compile: one ``attncc::attention`` op per layer (no graph break),
            the queries' offset a captured tensor
  sinks     gpt-oss's per-head sink logit s_h is a term of the softmax's denominator:
            out * sigmoid(lse - s_h), from the log-sum-exp the kernels return (differentiable)

Your own mods go on top of the model's mask and score: ``register(name, score_mod, mask_mod)``
makes another implementation name, ``set_mods(model, score_mod, mask_mod, layers=...)`` sets them
per attention layer. They see ``q_idx`` and ``kv_idx`` as positions in the layer's keys (with a
cache, the query's position among them; left padding counts).
"""
from __future__ import annotations

import copy
import functools
import itertools
from typing import NamedTuple

import torch

from .. import inference, ir, runtime
from ..api import CompiledAttention
from ..autograd import draw_rng, needs_grad
from ..checks import check_captures, check_index_ranges, check_qkv
from ..errors import AttnccError
from ..variant import Variant

if not torch.cuda.is_available():  # transformers imports triton, whose CPU interpreter must be on before that
    try:
        runtime.target_for(torch.device("cpu"))
    except AttnccError:  # triton came first; the first CPU call says how to fix it
        pass

try:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as e:  # pragma: no cover - exercised without transformers only
    raise ImportError("attncc.integrations.transformers needs transformers>=5: pip install 'attncc[hf]'") from e

from ._hf_masks import AttnccMask, mask_interface  # noqa: E402  (imports transformers' masking_utils)

__all__ = ["AttnccMask", "NAME", "attention_forward", "mask_interface", "register", "set_mods"]

NAME = "attncc"


# ---------------------------------------------------------------------------------------------
# Variants: one CompiledAttention per kind of call, shared by layers and steps


class _Key(NamedTuple):
    causal: bool
    window: int | None
    softcap: float | None
    scale: float | None
    dropout_p: float
    padding: bool             # reads padding[b, kv_idx]
    documents: bool           # reads documents[b, q_idx] and documents[b, kv_idx]
    offset: bool              # queries sit at q_idx + offset among the keys
    dense: str | None         # "bool" (a mask) or "float" (added to the score): dense[b, h, q_idx, kv_idx]
    mods: int | None          # user mods registered under this number


_PER_CALL = ("padding", "documents", "offset", "dense")
_user_mods: dict = {}        # number -> (score_mod, mask_mod, the tensors they read)
_numbers = itertools.count(1)
_variants: dict = {}         # _Key -> (CompiledAttention, slots)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two captures read the same memory the same way: a mod indexing a tensor at a
    constant (``t[0]``) captures a new view of it on every trace."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def _compose(key: _Key):
    """The CompiledAttention of ``key`` and its capture slots: per capture, the name of a
    per-call tensor (``_PER_CALL``) or the number of a user mod's own tensor."""
    stand_in = {"padding": torch.ones(1, 1, dtype=torch.bool), "documents": torch.zeros(1, 1, dtype=torch.int32),
                "offset": torch.zeros((), dtype=torch.int32),
                "dense": torch.zeros(1, 1, 1, 1, dtype=torch.float32 if key.dense == "float" else torch.bool)}
    pad, docs, off, dense = (stand_in[n] for n in _PER_CALL)
    user_score, user_mask, user_tensors = _user_mods.get(key.mods, (None, None, ()))

    def position(q_idx):
        return q_idx + off if key.offset else q_idx

    def score_mod(score, b, h, q_idx, kv_idx):
        if key.softcap is not None:
            score = key.softcap * torch.tanh(score / key.softcap)
        if key.dense == "float":
            score = score + dense[b, h, q_idx, kv_idx]
        if user_score is not None:
            score = user_score(score, b, h, position(q_idx), kv_idx)
        return score

    def mask_mod(b, h, q_idx, kv_idx):
        q = position(q_idx)
        parts = []
        if key.causal:
            parts.append(q >= kv_idx)
        if key.window is not None:
            w = key.window  # transformers: causal kv_idx > q_idx - w; bidirectional |q_idx - kv_idx| <= w
            parts.append(q - kv_idx < w if key.causal else (q - kv_idx <= w) & (kv_idx - q <= w))
        if key.padding:
            parts.append(pad[b, kv_idx])
        if key.documents:
            parts.append(docs[b, q_idx] == docs[b, kv_idx])
        if key.dense == "bool":
            parts.append(dense[b, h, q_idx, kv_idx])
        if user_mask is not None:
            parts.append(user_mask(b, h, q, kv_idx))
        return functools.reduce(lambda a, c: a & c, parts)

    scored = key.softcap is not None or key.dense == "float" or user_score is not None
    masked = (key.causal or key.window is not None or key.padding or key.documents or key.dense == "bool"
              or user_mask is not None)
    named = (("causal", key.causal), (f"window{key.window}", key.window is not None),
             (f"softcap{key.softcap}", key.softcap is not None), ("padding", key.padding),
             ("documents", key.documents), ("offset", key.offset), (f"dense_{key.dense}", key.dense),
             (f"mods{key.mods}", key.mods))
    variant = Variant(score_mod if scored else None, mask_mod if masked else None, scale=key.scale,
                      dropout_p=key.dropout_p, name="hf_" + ("_".join(n for n, on in named if on) or "full"))
    variant.ir_key, variant.index_sites, variant.load_sites  # noqa: B018  (computed once, shared by _bind's views)
    names = {id(t): n for n, t in stand_in.items()}
    slots = []
    for c in variant.captures:
        slot = names.get(id(c.tensor))
        if slot is None:
            slot = next((i for i, t in enumerate(user_tensors) if _same_tensor(t, c.tensor)), None)
        if slot is None:
            raise AttnccError(f"attncc: your mods read {c!r} differently on each trace; index captured tensors "
                              "with the mods' arguments (or capture a 0-d tensor) instead")
        slots.append(slot)
    return CompiledAttention(variant), tuple(slots)


def _variant(key: _Key):
    hit = _variants.get(key)
    if hit is None:
        hit = _variants[key] = _compose(key)
    return hit


@torch.compiler.assume_constant_result
def _traced_variant(*key) -> tuple:
    """Under torch.compile: (variant key, dropout_p, slots) of the variant, built while dynamo
    traces (the mods' tracing stays out of the graph); the op finds the CompiledAttention by
    the key. Constants only: dynamo keeps its own copy of a dict it has read (``_variants``),
    so the graph must not read what this adds. A plain tuple: dynamo passes a NamedTuple to
    this function incompletely."""
    compiled, slots = _variant(_Key(*key))
    return compiled.variant.ir_key, compiled.variant.dropout_p, slots


class _Bound:
    """A variant seen with this call's tensors as its captures; everything else is the variant's."""

    def __init__(self, variant, captures):
        self._variant = variant
        self.captures = tuple(ir.Capture(t, c.name) for c, t in zip(variant.captures, captures))

    def __getattr__(self, name):
        return getattr(self._variant, name)


def _bind(compiled: CompiledAttention, captures: list) -> CompiledAttention:
    """``compiled`` reading ``captures`` (eager calls): its kernels, checks and autograd see the
    call's tensors, the generated modules are the same."""
    if not captures:
        return compiled
    bound = copy.copy(compiled)
    bound.variant = _Bound(compiled.variant, captures)
    return bound


# ---------------------------------------------------------------------------------------------
# The attention


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                      s_aux=None, _mods=None, **kwargs):
    """transformers' attention-interface entry for "attncc": query (B, Hq, Lq, D), key and value
    (B, Hkv, Lkv, D) after the cache update; returns ((B, Lq, Hq, Dv), None) (no attention
    weights). ``softcap`` (Gemma-2) and ``s_aux`` (gpt-oss sinks) as the models pass them."""
    if kwargs.get("position_bias") is not None:
        raise AttnccError("attncc does not take a dense position_bias (T5-style models); express the bias as a "
                          "score_mod (attncc.integrations.transformers.set_mods) or use another implementation")
    mask = _as_mask(attention_mask, module, kwargs, query, key)
    mods = getattr(module, "_attncc_mods", None) or _mods
    user = _user_mods[mods][2] if mods is not None else ()
    B, Hq, Lq, _ = query.shape
    p = float(dropout) if dropout else 0.0
    compiling = torch.compiler.is_compiling()
    padding, documents, dense = mask.padding, mask.documents, mask.dense
    if compiling:
        delta, bottom = mask.q_offset - mask.kv_offset, False
    else:
        delta = mask.host_delta()
        keep = delta + Lq  # keys after the last query are in every query's future: a StaticCache's empty slots
        if mask.causal and dense is None and keep < key.shape[2]:
            key, value = key[:, :, :keep], value[:, :, :keep]
            padding = None if padding is None else padding[:, :keep]
        # queries at the end of the keys (decoding): the inference kernel, when nothing needs training kernels
        bottom = (delta != 0 and delta == key.shape[2] - Lq and p == 0 and documents is None and dense is None
                  and not needs_grad((query, key, value, *user)))
    Lkv = key.shape[2]
    if padding is not None and padding.shape[-1] != Lkv:
        raise AttnccError(f"attncc: the mask covers {padding.shape[-1]} keys but the layer has {Lkv}; the cache "
                          "and the mask transformers built disagree")
    located = mask.causal or mask.window is not None or mods is not None  # the mods read positions
    offset = located and not bottom and not (isinstance(delta, int) and delta == 0)
    dense_kind = None if dense is None else "bool" if dense.dtype == torch.bool else "float"
    k = _Key(mask.causal, mask.window, float(softcap) if softcap else None, scaling, p, padding is not None,
             documents is not None, offset, dense_kind, mods)
    if compiling:
        variant_key, rounded_p, slots = _traced_variant(*k)
    else:
        compiled, slots = _variant(k)
    per_call = {"padding": padding, "documents": documents,
                "dense": None if dense is None else dense.expand(B, Hq, Lq, Lkv),
                "offset": mask.offset_tensor(delta, query.device) if offset else None}
    for name, t in per_call.items():  # layers spread over devices (device_map="auto") read the mask's tensors
        if t is not None and t.device != query.device:
            per_call[name] = t.to(query.device)
    captures = [per_call[s] if isinstance(s, str) else user[s] for s in slots]
    if compiling:  # what attncc.autograd.attend does under torch.compile, without reading _variants
        check_qkv(query, key, value, True)
        rng = draw_rng() if rounded_p > 0 else None
        # dropout through its own op, which CUDA graphs leave out (each step draws a new mask)
        op = torch.ops.attncc.attention.default if rng is None else torch.ops.attncc.attention_dropout.default
        out, lse = op(query, key, value, captures, rng, variant_key, k.scale, rounded_p, False)
    elif bottom:
        out, lse = _bottom_right(_bind(compiled, captures), query, key, value)
    else:
        out, lse = _bind(compiled, captures)(query, key, value, enable_gqa=True, return_lse=True, training=p > 0)
    if s_aux is not None:  # the sink's share of the softmax leaves the keys sigmoid(lse - s_h) of it
        share = torch.sigmoid(lse - s_aux.float()[None, :, None])
        out = (out * share[..., None]).to(query.dtype)
    return out.transpose(1, 2), None


def _as_mask(attention_mask, module, kwargs, query, key) -> AttnccMask:
    """The call's AttnccMask: the one mask_interface built, or one standing for a mask that
    arrived otherwise (None: the module's causality, queries at the end of the keys; a 4-D
    tensor passed to the model: read in place)."""
    if isinstance(attention_mask, AttnccMask):
        return attention_mask
    Lq, Lkv = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        return AttnccMask(causal=bool(causal), window=kwargs.get("sliding_window"), q_offset=Lkv - Lq, kv_length=Lkv)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        dense = attention_mask[..., :Lkv]
        return AttnccMask(causal=False, dense=dense, kv_length=Lkv)
    what = type(attention_mask).__name__
    if isinstance(attention_mask, torch.Tensor):
        what += f" of shape {tuple(attention_mask.shape)}"
    raise AttnccError(f"attncc got an attention mask {what}; it takes the masks transformers' mask interface "
                      "builds for it, None, or a 4-D mask")


def _bottom_right(bound, query, key, value):
    """Queries at the end of the keys (a decode or chunked-prefill step over a DynamicCache)
    through attncc's inference kernel: query i of Lq sits at key position Lkv - Lq + i."""
    check_qkv(query, key, value, True)
    check_captures(bound.variant.captures, query.device)
    B, Hq, Lq, _ = query.shape
    Lkv = key.shape[2]
    check_index_ranges(bound.variant, {"b": (0, B - 1), "h": (0, Hq - 1), "q_idx": (Lkv - Lq, Lkv - 1),
                                       "kv_idx": (0, Lkv - 1)})
    return inference.run(bound, query, key, value, batch=B, packed=False, max_q_len=Lq, max_kv_len=Lkv,
                         bottom_right=1, return_lse=True, heads_last=False)


# ---------------------------------------------------------------------------------------------
# Registration and user mods


def _mods_number(score_mod, mask_mod) -> int | None:
    if score_mod is None and mask_mod is None:
        return None
    for f, what in ((score_mod, "score_mod"), (mask_mod, "mask_mod")):
        if f is not None and not callable(f):
            raise AttnccError(f"{what} must be a function, got {type(f).__name__}")
    number = next(_numbers)
    _user_mods[number] = (score_mod, mask_mod, tuple(c.tensor for c in Variant(score_mod, mask_mod).captures))
    return number


def register(name: str = NAME, score_mod=None, mask_mod=None) -> str:
    """Register ``name`` as an attention implementation (attention and mask interfaces) running
    attncc, with ``score_mod`` / ``mask_mod`` on top of every layer's own score and mask (the
    mods see q_idx and kv_idx as positions in the layer's keys). Returns the name, for
    ``attn_implementation=`` or ``model.set_attn_implementation(...)``."""
    number = _mods_number(score_mod, mask_mod)
    forward = attention_forward if number is None else functools.partial(attention_forward, _mods=number)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, mask_interface)
    return name


def set_mods(model: torch.nn.Module, score_mod=None, mask_mod=None, *, layers=None) -> list:
    """Put ``score_mod`` / ``mask_mod`` on top of the attention of ``model``'s layers (all, or
    those whose ``layer_idx`` is in ``layers``); ``set_mods(model)`` removes them. Returns the
    attention modules changed. Tensors the mods read must be on the model's device; float ones
    created with requires_grad=True receive gradients."""
    number = _mods_number(score_mod, mask_mod)
    wanted = None if layers is None else set(layers)
    found = [m for m in model.modules() if type(m).__name__.endswith("Attention") and isinstance(
        getattr(m, "layer_idx", None), int) and (wanted is None or m.layer_idx in wanted)]
    if not found:
        raise AttnccError("set_mods found no attention module (a module named *Attention with a layer_idx)"
                          + ("" if wanted is None else f" for layers {sorted(wanted)}"))
    for m in found:
        m._attncc_mods = number
    return found


register()
