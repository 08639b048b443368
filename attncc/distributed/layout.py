"""Which chunks of the sequence each rank holds, and shard / unshard along the sequence.

A sequence of length L is cut into ``n_chunks`` equal chunks; rank r holds ``chunks[r]`` (the
same number on every rank), concatenated in that order. Built-in layouts:

    contiguous   W chunks, rank r holds chunk r
    zigzag       2W chunks, rank r holds chunks r and 2W - 1 - r: under a causal-like mask each
                 rank gets one early (cheap) and one late (expensive) chunk
    balanced     ``balanced_layout(kernel, ...)``: chunks assigned so that every rank's unmasked
                 work, counted from the mask itself, is about even (document masks)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import AttnccError


@dataclass(frozen=True)
class Layout:
    """chunks[r]: the global chunk numbers rank r holds, in local order."""
    name: str
    chunks: tuple

    @property
    def world(self) -> int:
        return len(self.chunks)

    @property
    def n_chunks(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def per_rank(self) -> int:
        return len(self.chunks[0])

    def __post_init__(self):
        flat = sorted(c for cs in self.chunks for c in cs)
        if not self.chunks or flat != list(range(len(flat))) or len({len(c) for c in self.chunks}) != 1:
            raise AttnccError(f"layout {self.name!r}: every rank must hold the same number of chunks and the "
                              f"chunks 0..n-1 exactly once, got {self.chunks}")


def make_layout(layout, world: int) -> Layout:
    """A Layout for ``world`` ranks from a name ("contiguous", "zigzag") or a Layout."""
    if isinstance(layout, Layout):
        if layout.world != world:
            raise AttnccError(f"layout {layout.name!r} was built for {layout.world} ranks, the group has {world}")
        return layout
    if layout == "contiguous":
        return Layout("contiguous", tuple((r,) for r in range(world)))
    if layout == "zigzag":
        return Layout("zigzag", tuple((r, 2 * world - 1 - r) for r in range(world)))
    raise AttnccError(f"unknown layout {layout!r}: use 'contiguous', 'zigzag' or a Layout "
                      "(attncc.distributed.balanced_layout builds one for data-dependent masks)")


def _world_rank(group):
    from .comm import as_comm
    comm = as_comm(group)
    return comm, comm.world, comm.rank


def shard(x: torch.Tensor, group=None, dim: int = 2, layout="contiguous") -> torch.Tensor:
    """This rank's part of the whole ``x`` along ``dim`` (the sequence; 2 for (B, H, L, D)),
    under ``layout``. Every rank passes the same ``x``. Differentiable (slices and a cat)."""
    _, world, rank = _world_rank(group)
    lay = make_layout(layout, world)
    n = x.shape[dim]
    if n % lay.n_chunks:
        raise AttnccError(f"shard: length {n} along dim {dim} is not divisible into the {lay.n_chunks} chunks "
                          f"of the {lay.name!r} layout over {world} ranks; pad the sequence to a multiple of "
                          f"{lay.n_chunks}")
    parts = x.chunk(lay.n_chunks, dim)
    mine = [parts[c] for c in lay.chunks[rank]]
    return mine[0].contiguous() if len(mine) == 1 else torch.cat(mine, dim)


def unshard(x: torch.Tensor, group=None, dim: int = 2, layout="contiguous") -> torch.Tensor:
    """The whole tensor from every rank's ``x`` (the inverse of shard; every rank gets it).
    Not differentiable (an all-gather)."""
    comm, world, _ = _world_rank(group)
    lay = make_layout(layout, world)
    pieces = comm.all_gather(x.contiguous())
    chunks = [None] * lay.n_chunks
    for r, part in enumerate(pieces):
        for c, piece in zip(lay.chunks[r], part.chunk(lay.per_rank, dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim)


def balanced_layout(kernel, length: int, world: int, chunks_per_rank: int = 2, *, batch: int = 1,
                    heads: int = 1, device="cpu", rows_per_step: int = 256) -> Layout:
    """A Layout whose ranks have about the same unmasked work under ``kernel``'s mask (its
    captured tensors as they are now): the sequence is cut into world * chunks_per_rank chunks,
    the work of each (its unmasked (query, key) pairs over all keys, b and h) is counted by
    evaluating the mask, and chunks go, largest first, to the rank with the least work that
    still has room. Cost: the mask evaluated on length^2 positions (in slabs of rows)."""
    from .. import reference
    variant = kernel.variant
    n = world * chunks_per_rank
    if length % n:
        raise AttnccError(f"balanced_layout: length {length} is not divisible into {n} chunks")
    c = length // n
    work = [0] * n
    if variant.mask_ir is None:
        work = [c * length] * n
    else:
        dev = torch.device(device)
        kv = torch.arange(length, device=dev).view(1, 1, 1, -1)
        env = {"b": torch.arange(batch, device=dev).view(-1, 1, 1, 1),
               "h": torch.arange(heads, device=dev).view(1, -1, 1, 1), "kv_idx": kv}
        for i in range(n):
            for r0 in range(i * c, (i + 1) * c, rows_per_step):
                rows = torch.arange(r0, min(r0 + rows_per_step, (i + 1) * c), device=dev).view(1, 1, -1, 1)
                keep = reference.evaluate(variant.mask_ir, {**env, "q_idx": rows}, torch.float32, dev)
                work[i] += int(keep.expand(batch, heads, rows.shape[2], length).sum())
    load, held = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(n), key=lambda i: (-work[i], i)):
        r = min((r for r in range(world) if len(held[r]) < chunks_per_rank), key=lambda r: (load[r], r))
        held[r].append(i)
        load[r] += work[i]
    return Layout("balanced", tuple(tuple(sorted(h)) for h in held))
