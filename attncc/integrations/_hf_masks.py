"""The masks of attn_implementation="attncc": what transformers' mask functions describe, read off
without a dense mask (attncc.integrations.transformers registers ``mask_interface``).

transformers calls the mask interface once per forward and mask type (full, sliding) with the
call's sizes and offsets, the 2-D ``attention_mask`` and the mask function it composed. What
attncc needs of that:

  causal / bidirectional   which creator called: bidirectional ones pass allow_is_bidirectional_skip
  window                   local_size, passed by the sliding-window creators
  padding                  the 2-D attention_mask cut to this call's keys (dropped when all True)
  documents                packed sequences: transformers composed the mask function from
                           position_ids; token t starts a document where it may not see t - 1,
                           which the function answers on the (B, L - 1) pairs (t, t - 1)
  offsets                  q_offset - kv_offset: where the queries sit among the keys

Patterns it does not read off (or/and overlays, chunked attention, a causal mask in which a
token sees the next one) are evaluated densely by transformers' own sdpa_mask, with a warning.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function, prepare_padding_mask,
                                        sdpa_mask)

from ..log import logger


@dataclass(eq=False)
class AttnccMask:
    """One forward's mask of one type, as ``mask_interface`` hands it to the layers.

    Key j of batch b is visible to query i (at key position i + q_offset - kv_offset) when the
    pattern allows it (causal: not after the query; ``window``: causal q - kv < window,
    bidirectional |q - kv| <= window), ``padding[b, j]`` is True, and query and key share a
    document (``documents``, packed sequences). ``dense`` replaces all of it by a 4-D mask (bool,
    or float added to the scores; heads may broadcast) when the pattern is not one attncc reads
    off, or when the model was given one."""
    causal: bool = True
    window: int | None = None
    padding: torch.Tensor | None = None      # (B, kv_length) bool
    documents: torch.Tensor | None = None    # (B, L) int32, only when queries and keys are the same tokens
    q_offset: int | torch.Tensor = 0         # a tensor for StaticCache
    kv_offset: int = 0
    kv_length: int = 0
    dense: torch.Tensor | None = None
    offset: torch.Tensor | None = None       # under torch.compile: q_offset - kv_offset as a 0-d int32 tensor
    _memo: dict = field(default_factory=dict, repr=False)  # eager: host values read once per forward
    # a mask built before the forward (generate() with a StaticCache) passes transformers' mask
    # preparation as a prepared 4-D mask does, back to mask_interface, which returns it
    ndim = 4

    def host_delta(self) -> int:
        """q_offset - kv_offset on the host (one read of a StaticCache's offset per forward)."""
        d = self._memo.get("delta")
        if d is None:
            d = self._memo["delta"] = int(self.q_offset) - self.kv_offset
        return d

    def offset_tensor(self, delta, device) -> torch.Tensor:
        """``delta`` as the 0-d int32 tensor the offset variants read: one per forward (under
        torch.compile ``mask_interface`` makes it), so that the layers share its tile classes."""
        if torch.compiler.is_compiling():
            if self.offset is None:  # a mask made by the attention itself (_as_mask)
                return _int32(delta, device)
            return self.offset.to(device)
        key = ("offset", delta, device)
        t = self._memo.get(key)
        if t is None:
            t = _int32(delta, device)
            self._memo[key] = t
        return t


def _int32(delta, device) -> torch.Tensor:
    if isinstance(delta, torch.Tensor):
        return delta.reshape(()).to(device=device, dtype=torch.int32)
    return torch.full((), delta, dtype=torch.int32, device=device)


def mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                   attention_mask=None, local_size=None, use_vmap=False, device="cpu", config=None,
                   **kwargs) -> AttnccMask:
    """transformers' mask-interface entry for "attncc": an ``AttnccMask`` instead of a dense mask.

    Causal or bidirectional and the window come from which creator called (bidirectional ones
    pass ``allow_is_bidirectional_skip``; sliding ones ``local_size``). Packed sequences: the
    mask function answers, for each token t, whether t sees t - 1; where it does not, a
    document starts (transformers built that function from ``position_ids``)."""
    if isinstance(attention_mask, AttnccMask):  # prepared before the forward (generate with a StaticCache)
        return attention_mask
    if isinstance(q_offset, torch.Tensor):  # a StaticCache's length, which its first layer's update raises in place
        q_offset = q_offset.clone()
    compiling = torch.compiler.is_compiling()
    bidirectional = "allow_is_bidirectional_skip" in kwargs or mask_function is bidirectional_mask_function
    plain = mask_function is causal_mask_function or mask_function is bidirectional_mask_function
    chunked = local_size is not None and local_size == getattr(config, "attention_chunk_size", None)
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                local_size=local_size, use_vmap=use_vmap, device=device)
    if use_vmap or chunked:  # or/and overlays (image tokens, ...), chunked attention
        return _dense_mask("chunked attention" if chunked else "a mask with or/and overlays", args)
    padding = None
    if attention_mask is not None:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
        if not compiling and bool(padding.all()):  # one host read, as transformers' own masks do
            padding = None
    documents = None
    same_tokens = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length
    if same_tokens and not plain and not bidirectional and q_length > 1 and (attention_mask is None or not compiling):
        sees_prev, sees_next = _diagonal_neighbours(mask_function, batch_size, q_length, device)
        starts = ~sees_prev
        if compiling:  # no host reads in a graph: the ids are all 0 when nothing is packed
            documents = _document_ids(starts)
        else:
            any_start, any_next = torch.stack([starts.any(), sees_next.any()]).tolist()
            if any_next:  # a causal mask in which a token sees the next one: an overlay we do not know
                return _dense_mask("a mask function attncc does not recognise", args)
            documents = _document_ids(starts) if any_start else None
    offset = None
    if compiling and not same_tokens:  # the queries' offset, once per forward (the layers read it under compile)
        offset = _int32(q_offset - kv_offset, device)
    return AttnccMask(causal=not bidirectional, window=local_size, padding=padding, documents=documents,
                      q_offset=q_offset, kv_offset=kv_offset, kv_length=kv_length, offset=offset)


def _diagonal_neighbours(mask_function, batch_size: int, length: int, device):
    """(B, L - 1) bools: whether token t sees token t - 1, and whether t - 1 sees t (t >= 1)."""
    t = torch.arange(1, length, device=device)[None, :]
    b = torch.arange(batch_size, device=device)[:, None]
    h = torch.zeros(1, 1, dtype=torch.long, device=device)
    prev = mask_function(b, h, t, t - 1).expand(batch_size, length - 1)
    nxt = mask_function(b, h, t - 1, t).expand(batch_size, length - 1)
    return prev, nxt


def _document_ids(starts: torch.Tensor) -> torch.Tensor:
    """(B, L) int32 ids from (B, L - 1) document starts at tokens 1..L-1."""
    first = torch.zeros_like(starts[:, :1], dtype=torch.int32)
    return torch.cat([first, starts.cumsum(-1, dtype=torch.int32)], dim=-1)


_warned: set = set()


def _dense_mask(why: str, args: dict) -> AttnccMask:
    """The fallback: transformers' own dense (B, 1, Lq, Lkv) bool mask, read in place."""
    if why not in _warned and not torch.compiler.is_compiling():
        _warned.add(why)
        logger.warning("attncc: %s is evaluated as a dense mask (read in place by the kernels, without "
                       "attncc's tile skipping from the mask's structure)", why)
    dense = sdpa_mask(allow_is_causal_skip=False, allow_is_bidirectional_skip=False, **args)
    return AttnccMask(causal=False, dense=dense, q_offset=args["q_offset"], kv_offset=args["kv_offset"],
                      kv_length=args["kv_length"])
