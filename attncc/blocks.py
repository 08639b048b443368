"""Tile classes of data-dependent masks (a mask that reads captured tensors, like document ids).

A generated kernel (``block_classes`` in the forward module) classifies every FINE x FINE tile of
the mask as empty (0), partial (1) or full (2), once per mask input: O((L / FINE)^2) int8 per
(b, h) that the mask distinguishes. The table is cached while the captured tensors are unchanged
(same storage and torch version counter) and coarsened to each kernel's tile shape into lists of
partial and full inner tiles per outer tile, which drive the kernels' loops; empty tiles are
never visited.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from .blockmask import fine_table

FINE = 32  # divides every tile size attncc uses (32, 64, 128)
KEYS_OUTER = ("attn_bwd_dkdv", "attn_bwd")  # kernels whose programs own key tiles and loop over query tiles
_lock = threading.RLock()
_cache: OrderedDict = OrderedDict()
_CACHE_SIZE = 16


def _tensor_key(t: torch.Tensor):
    return (t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, t.device)


def fine_classes(fwd_module, captures, B, H, Lq, Lkv, per_head: bool, device, offsets=(0, 0)) -> torch.Tensor:
    """int8 (X, ceil(Lq / FINE), ceil(Lkv / FINE)), X = B * H if per_head else 1; cached.
    offsets: positions of the first query and key (a chunk of a longer sequence, attncc.distributed)."""
    key = (id(fwd_module), tuple(_tensor_key(c) for c in captures), B if per_head else 0,
           H if per_head else 0, Lq, Lkv, *offsets)
    hit = _cache.get(key)
    # the same tensors, not others at their addresses: a tensor made where a freed one lived has
    # its address and version counter (0) too, and another mask
    if hit is not None and all(ref() is c for ref, c in zip(hit[1], captures)):
        _cache.move_to_end(key)
        return hit[0]
    X = B * H if per_head else 1
    # a BlockMask's table mask whose blocks are whole fine tiles: the classes are the table's
    table = fine_table(captures, B, H, Lq, Lkv, per_head, FINE) if offsets == (0, 0) else None
    if table is None:
        table = torch.empty(X, -(-Lq // FINE), -(-Lkv // FINE), dtype=torch.int8, device=device)
        if table.numel():
            fwd_module.classify(table, captures, H, Lq, Lkv, FINE, *offsets)
    _cache[key] = (table, [weakref.ref(c) for c in captures])
    _cache.move_to_end(key)
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return table


def tile_lists(fine: torch.Tensor, outer: int, inner: int, transpose: bool):
    """(partial_cnt, partial_idx, full_cnt, full_idx, n_outer, n_inner) for tiles of
    outer x inner (rows of the table are queries; ``transpose`` makes them keys). Each row of an
    index list holds its tiles first, then the others in order: a row with none starts with tile 0
    (the Gluon forward visits that tile, masked, where a Q tile keeps no key)."""
    t = fine.transpose(1, 2) if transpose else fine
    ro, ri = outer // FINE, inner // FINE
    X, no, ni = t.shape
    po, pi = -(-no // ro) * ro, -(-ni // ri) * ri
    padded = torch.zeros(X, po, pi, dtype=torch.int8, device=t.device)  # past the end: empty
    padded[:, :no, :ni] = t
    blocks = padded.view(X, po // ro, ro, pi // ri, ri)
    lo = blocks.amin(dim=(2, 4))
    hi = blocks.amax(dim=(2, 4))
    cls = torch.where(lo == 2, 2, torch.where(hi == 0, 0, 1))
    out = []
    for c in (1, 2):
        sel = cls == c
        cnt = sel.sum(-1, dtype=torch.int32).contiguous()
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
        out += [cnt, idx]
    return (*out, cls.shape[1], cls.shape[2])


def longest_first(lists) -> torch.Tensor:
    """The outer tiles of ``lists`` (tile_lists) by their number of inner tiles, partial and full,
    the longest first, in index order among equals (int32): with one row for all heads, the outer
    tiles' indices; with a row per (batch, head), row * n_outer + outer tile. A kernel whose
    programs run tiles of unequal work in this order ends with short ones (the Gluon forward:
    a Q tile's work follows where the mask puts it, a document's end, not its index). H200, in
    turn (gluon_fwd_probe.py, 2026-11-29), document causal forward ms index order / this:
    4x16x4096x128 0.269 / 0.227, 1x16x16384x128 0.549 / 0.525, 1x32x16384x64 0.812 / 0.763."""
    partial_cnt, _, full_cnt, _, n_outer, _ = lists
    work = (partial_cnt + full_cnt).view(-1, n_outer)
    flat = work[0] if work.shape[0] == 1 else work.reshape(-1)
    return torch.argsort(flat, descending=True, stable=True).to(torch.int32)


def module_lists(module, fine: torch.Tensor, cache: dict | None = None) -> dict:
    """{kernel: tile lists} for every kernel of ``module`` (its TILES), and {kernel + ":order":
    longest_first} for those it names in LONGEST_FIRST; ``cache`` (keyed by the table's id, the
    kernel and its tiles) keeps them with the table."""
    def kept(key, make):
        hit = cache.get(key) if cache is not None else None
        if hit is None or hit[0] is not fine:  # ids are reused after a table is evicted
            hit = (fine, make())
            if cache is not None:
                cache[key] = hit
        return hit[1]
    out = {}
    for fn, (o, i) in module.TILES.items():
        out[fn] = kept((id(fine), fn, o, i), lambda: tile_lists(fine, o, i, transpose=fn in KEYS_OUTER))
        if fn in getattr(module, "LONGEST_FIRST", ()):
            out[fn + ":order"] = kept((id(fine), fn + ":order", o, i), lambda: longest_first(out[fn]))
    return out


_lists: dict = {}  # (id of a cached fine table, kernel, tiles) -> (that table, its tile lists or their order)
# The last lists handed out per (module, call lengths), with weak references to the captures and
# their version counters and storage addresses: a repeated call with unchanged captures gets them
# back after a few attribute reads, without forming the fine table's key (~13 us per call).
_recent: dict = {}


def for_module(module, fwd_module, captures, B, H, Lq, Lkv, per_head, device, offsets=(0, 0)) -> dict:
    """Tile lists for every kernel of ``module`` (its TILES), from the cached fine table; the
    lists are cached with the table, so a repeated call launches nothing here. offsets: as in
    fine_classes."""
    key = (id(module), id(fwd_module), B if per_head else 0, H if per_head else 0, Lq, Lkv, *offsets)
    versions = [(c._version, c.data_ptr()) for c in captures]
    hit = _recent.get(key)
    if hit is not None and hit[1] == versions:
        for ref, c in zip(hit[0], captures):  # a loop, not all(<generator>): host time per call
            if ref() is not c:
                break
        else:
            return hit[2]
    with _lock:  # the tables' LRU order and the lists' eviction sweep are shared by threads
        out = _lists_for(module, fwd_module, captures, B, H, Lq, Lkv, per_head, device, offsets)
    if len(_recent) >= _CACHE_SIZE:
        _recent.clear()
    _recent[key] = ([weakref.ref(c) for c in captures], versions, out)
    return out


def _lists_for(module, fwd_module, captures, B, H, Lq, Lkv, per_head, device, offsets=(0, 0)) -> dict:
    fine = fine_classes(fwd_module, captures, B, H, Lq, Lkv, per_head, device, offsets)
    live = {id(t) for t, _ in _cache.values()}  # drop the lists of evicted tables
    for stale in [k for k in _lists if k[0] not in live]:
        del _lists[stale]
    return module_lists(module, fine, _lists)
