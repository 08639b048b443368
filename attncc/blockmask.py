"""torch's BlockMask in attncc's terms: a class table, and the mask the variant gets.

A BlockMask lists, per (batch, head, query block), the key blocks to visit: partial ones
(kv_num_blocks / kv_indices, mask_mod applies) and full ones (full_kv_*, mask_mod skipped); blocks
it leaves out are never attended. ``class_table`` turns that into an int8 table (0 left out,
1 partial, 2 full); ``block_use`` decides what the variant's mask is:

    mask_mod alone      when the table agrees with mask_mod (every full block all True, every
                        left-out block all False: ``disagreement`` evaluates mask_mod densely, a
                        chunk of query blocks at a time, once per BlockMask); attncc then skips
                        tiles by its own derived bounds (create_block_mask's outputs land here)
    the table's mask    otherwise (and for masks that read tensors): (cls == 2) | (cls == 1 &
                        mask_mod), a captured tensor of the variant (``table_mask``). When the
                        BlockMask's block sizes are multiples of attncc's finest tile (32), the
                        kernels' tile classes are read off the table itself (``fine_table``: a
                        full block's tiles are full, a left-out block's empty, a partial block's
                        partial) and the mask is never evaluated for them; otherwise attncc's
                        classification kernel rebuilds them from the table's mask
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import ir, reference
from .errors import AttnccError
from .modkeys import LRU, lock

LARGE_BLOCK = 1 << 30  # torch's "no block mask" BlockMask (_create_empty_block_mask)
_blocks = LRU(64)     # (id(BlockMask), versions, lengths, mask node) -> (weakref, BlockUse)
_tables = LRU(64)     # id(class table) -> (weakref, (Q_BLOCK, KV_BLOCK)): tables that table_mask reads


def unwrap_mask_mod(block_mask):
    """The BlockMask's mask_mod as a function (torch may wrap it after a pytree round trip)."""
    fn = getattr(block_mask, "mask_mod", None)
    inner = getattr(fn, "fn", None)
    if type(fn).__name__ == "_MaskModWrapper" and callable(inner):
        fn = inner
    if getattr(fn, "__name__", "") == "_sliced_mask_mod_error":
        raise AttnccError("the BlockMask was sliced, which resets its mask_mod (torch raises here too): set "
                          "sliced.mask_mod from the original BlockMask's mask_mod")
    return fn


def _dense(num, idx, n: int) -> torch.Tensor:
    """bool (..., rows, n): block j of row i is listed among the first num[..., i] of idx[..., i, :]."""
    slots = torch.arange(idx.shape[-1], device=idx.device)
    valid = (slots < num.unsqueeze(-1)) & (idx >= 0) & (idx < n)
    target = torch.where(valid, idx.long(), n)
    dense = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.int8, device=idx.device)
    return dense.scatter_(-1, target, 1)[..., :n] != 0


def class_table(block_mask, Lq: int, Lkv: int) -> torch.Tensor:
    """int8 (B', H', ceil(Lq / Q_BLOCK), ceil(Lkv / KV_BLOCK)) of a BlockMask: 0 for a block it
    leaves out, 1 for a partial block (mask_mod applies), 2 for a full one. Plain tensor ops
    (they trace under torch.compile)."""
    qb, kvb = block_mask.BLOCK_SIZE
    nq, nkv = -(-Lq // qb), -(-Lkv // kvb)
    cls = _dense(block_mask.kv_num_blocks, block_mask.kv_indices, nkv).to(torch.int8)
    if block_mask.full_kv_num_blocks is not None:
        cls = torch.where(_dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nkv), 2, cls)
    rows = cls.shape[-2]
    if rows < nq:
        cls = torch.nn.functional.pad(cls, (0, 0, 0, nq - rows))
    return cls[..., :nq, :].to(torch.int8).contiguous()


def table_mask(table, mask: ir.Node | None, qb: int, kvb: int) -> ir.Node:
    """The mask of a BlockMask whose blocks the variant reads: (cls == 2) | (cls == 1 & mask_mod);
    a dimension of size 1 of the table is broadcast (index 0)."""
    cap = table if isinstance(table, ir.Capture) else ir.Capture(table, "block_mask")
    b = ir.b if cap.tensor.shape[0] > 1 else 0
    h = ir.h if cap.tensor.shape[1] > 1 else 0
    cls = ir.load(cap, b, h, ir.q_idx // qb, ir.kv_idx // kvb)
    if mask is None or (mask.op == "const" and mask.value is True):
        return ir.ne(cls, 0)
    return ir.eq(cls, 2) | (ir.eq(cls, 1) & mask)


def fine_table(captures, B: int, H: int, Lq: int, Lkv: int, per_head: bool, fine: int) -> torch.Tensor | None:
    """Tile classes (X, ceil(Lq / fine), ceil(Lkv / fine)) of a variant whose mask is a BlockMask's
    table_mask, read off the table when its block sizes are multiples of ``fine`` (each fine tile
    inside one block); None otherwise (attncc.blocks then classifies the mask). A tile past the end
    of a length is partial at most: full tiles run without bounds checks."""
    found = None
    for c in captures:
        with lock:
            hit = _tables.get(id(c))
        if hit is not None and hit[0]() is c:
            if found is not None:
                return None
            found = (c, *hit[1])
    if found is None or found[1] % fine or found[2] % fine:
        return None
    table, qb, kvb = found
    nq, nkv = -(-Lq // fine), -(-Lkv // fine)
    rows = (torch.arange(nq, device=table.device) * fine // qb).clamp_max(table.shape[2] - 1)
    cols = (torch.arange(nkv, device=table.device) * fine // kvb).clamp_max(table.shape[3] - 1)
    cls = table.index_select(2, rows).index_select(3, cols)
    if Lq % fine:
        cls[:, :, -1] = cls[:, :, -1].clamp_max(1)
    if Lkv % fine:
        cls[:, :, :, -1] = cls[:, :, :, -1].clamp_max(1)
    X = B * H if per_head else 1
    return cls.expand(B, H, nq, nkv).reshape(X, nq, nkv).contiguous() if per_head else cls[:1, :1].reshape(1, nq, nkv)


def _reads(node: ir.Node | None) -> set:
    return set() if node is None else {n.op for n in ir.walk(node)}


def disagreement(mask: ir.Node | None, table, qb: int, kvb: int, Lq: int, Lkv: int, B: int, H: int) -> str | None:
    """None when the BlockMask's blocks mean nothing beyond ``mask`` (every full block is all True
    under it, every left-out block all False); else the first block that differs, as text.
    Evaluates the mask densely (attncc.reference), a chunk of query blocks at a time."""
    reads = _reads(mask)
    Bm = B if "b" in reads else 1
    Hm = H if "h" in reads else 1
    nq, nkv = table.shape[-2], table.shape[-1]
    device = table.device
    per_row = max(1, Bm * Hm * qb * nkv * kvb)
    step = max(1, (1 << 24) // per_row)
    for i0 in range(0, nq, step):
        i1 = min(nq, i0 + step)
        rows = min(i1 * qb, Lq) - i0 * qb
        if rows <= 0:
            break
        if mask is None:
            m = torch.ones(1, 1, rows, Lkv, dtype=torch.bool, device=device)
        else:
            env = {"b": torch.arange(Bm, device=device).view(Bm, 1, 1, 1),
                   "h": torch.arange(Hm, device=device).view(1, Hm, 1, 1),
                   "q_idx": (i0 * qb + torch.arange(rows, device=device)).view(1, 1, rows, 1),
                   "kv_idx": torch.arange(Lkv, device=device).view(1, 1, 1, Lkv)}
            m = reference.evaluate(mask, env, torch.float32, device)
        m = m.expand(Bm, Hm, rows, Lkv)
        pad = (0, nkv * kvb - Lkv, 0, (i1 - i0) * qb - rows)
        shape = (Bm, Hm, i1 - i0, qb, nkv, kvb)
        some = torch.nn.functional.pad(m, pad, value=False).view(shape).any(dim=5).any(dim=3)
        every = torch.nn.functional.pad(m, pad, value=True).view(shape).all(dim=5).all(dim=3)
        cls = table[:, :, i0:i1]
        bad = ((cls == 2) & ~every) | ((cls == 0) & some)
        if bad.any():
            b, h, i, j = (int(x) for x in bad.nonzero()[0])
            what = "listed full but mask_mod is False in it" if int(cls[min(b, cls.shape[0] - 1), min(
                h, cls.shape[1] - 1), i, j]) == 2 else "left out but mask_mod is True in it"
            return f"block (b={b}, h={h}, q block {i0 + i}, kv block {j}) is {what}"
    return None


@dataclass(frozen=True)
class BlockUse:
    """What attncc made of a BlockMask: the variant's mask and why (for explain)."""
    mask: ir.Node | None     # the variant's mask
    table: torch.Tensor | None  # the class table the mask reads (None: mask_mod alone)
    block_size: tuple
    text: tuple              # lines for explain


def _describe(block_mask, table) -> str:
    qb, kvb = block_mask.BLOCK_SIZE
    listed = int((table > 0).sum())
    full = int((table == 2).sum())
    return (f"BLOCK_SIZE (Q, KV) = ({qb}, {kvb}), block table {tuple(table.shape)} (B, H, Q blocks, KV blocks): "
            f"{listed} of {table.numel()} blocks listed, {full} of them full")


def block_use(block_mask, mask: ir.Node | None, Lq: int, Lkv: int, B: int, H: int) -> BlockUse:
    """The mask a BlockMask gives the variant (cached per BlockMask object and mask)."""
    key = (id(block_mask), _versions(block_mask), Lq, Lkv, B, H, mask)
    with lock:
        hit = _blocks.get(key)
        if hit is not None and hit[0]() is block_mask:
            return hit[1]
    qb, kvb = block_mask.BLOCK_SIZE
    table = class_table(block_mask, Lq, Lkv)
    head = _describe(block_mask, table)
    why = None
    if any(n.op == "load" for n in ir.walk(mask)) if mask is not None else False:
        why = "mask_mod reads captured tensors, so its agreement with the blocks is not checked"
    else:
        why = disagreement(mask, table, qb, kvb, Lq, Lkv, B, H)
    if why is None:
        use = BlockUse(mask, None, (qb, kvb), (head, (
            "used as: mask_mod alone. The blocks agree with it (checked once for this BlockMask: every full "
            "block is all True under mask_mod, every block left out all False), so the kernels skip tiles by "
            "attncc's own bounds and tile classes derived from mask_mod; kv_indices and the q-direction "
            "tables are not read.")))
    else:
        fits = qb % 32 == 0 and kvb % 32 == 0
        how = ("its block sizes are multiples of attncc's 32x32 tile classes, so the classes are read off the "
               "table (a full block's tiles full, a left-out block's empty, a partial block's partial) without "
               "evaluating the mask" if fits else
               f"{qb}x{kvb} is not a multiple of attncc's 32x32 tile classes, so attncc's block classification "
               "kernel rebuilds them by evaluating that mask")
        with lock:
            _tables.put(id(table), (weakref.ref(table), (qb, kvb)))
        use = BlockUse(table_mask(table, mask, qb, kvb), table, (qb, kvb), (head, (
            f"used as: the mask reads the block table, (cls == full) | (cls == partial & mask_mod), because {why}. "
            f"The kernels' tile lists come from 32x32 tile classes coarsened to each kernel's tiles; {how}. "
            "Blocks the BlockMask leaves out are skipped and tiles inside full blocks run without mask code; "
            "the dK/dV kernel transposes the same classes (the q-direction tables are not read).")))
    with lock:
        _blocks.put(key, (weakref.ref(block_mask), use))
    return use


def _versions(block_mask) -> tuple:
    return tuple((t.data_ptr(), t._version) if isinstance(t, torch.Tensor) else None for t in (
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices))



def check_block_mask(block_mask, query, key) -> None:
    """torch's checks of a BlockMask against the inputs, with its messages' advice."""
    if tuple(block_mask.BLOCK_SIZE) == (LARGE_BLOCK, LARGE_BLOCK):
        return
    Lq, Lkv = query.shape[2], key.shape[2]
    mq, mkv = block_mask.seq_lengths
    if (Lq, Lkv) != (mq, mkv):
        bigger = Lq > mq or Lkv > mkv
        raise AttnccError(
            f"block_mask was created for lengths (Lq, Lkv) = ({mq}, {mkv}) but got q_len={Lq} and kv_len={Lkv}: "
            + ("create a new block mask for these lengths" if bigger else
               "create a new block mask with the correct lengths, or crop it with block_mask._adjust(q_len, kv_len) "
               "(which keeps the upper left corner; not right for every mask_mod)"))
    Bm, Hm = block_mask.kv_num_blocks.shape[:2]
    B, H = query.shape[0], query.shape[1]
    if Bm not in (1, B) or Hm not in (1, H):
        raise AttnccError(f"block_mask has batch/heads ({Bm}, {Hm}); they must be 1 (broadcast) or the query's "
                          f"({B}, {H})")
    if block_mask.kv_num_blocks.device != query.device:
        raise AttnccError(f"block_mask is on {block_mask.kv_num_blocks.device} but the inputs are on {query.device}; "
                          "move it with block_mask.to(device)")


