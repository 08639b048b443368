"""The per-rank computation of context-parallel attention: kernel calls on (query chunk, key
chunk) pairs at their global positions, and the two ways K/V reach every rank.

    ring        K/V shards travel around the ranks (rank r sends to r + 1) while the shard at
                hand computes; each query chunk's partials (out, lse) are merged exactly in one
                pass at the end (merge). Pairs the mask empties are skipped, and the ring stops
                after the last step anyone needs (ring_steps). The backward sends each shard's
                dK/dV accumulators along with it, one step behind, recomputes P from the global
                lse, and leaves some local pairs for last (late_pairs) to cover the final move.
    allgather   K/V gathered as sequence-major rows; each query chunk runs one call over all keys
                (the kernel's tile bounds skip what the mask empties); dK/dV reduce-scattered to
                the ranks that hold the keys at the end.

Every call passes the chunk's first query and key positions (q_off, kv_off) and the whole key
length to the generated kernels, so mods, tile bounds and dropout see global positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .. import autograd, blocks, runtime
from ..inference import merge_stacked


@dataclass
class Setup:
    """What one context-parallel call needs; the same on every rank but ``rank`` and ``mine``."""
    compiled: object   # CompiledAttention
    spec: object       # forward Spec (no TMA / warp specialisation; Gluon tier: offsets=True)
    scale: float
    rng: tuple         # (seed, offset, dropout_p) or ()
    deterministic: bool
    layout: object     # Layout
    rank: int
    cq: int            # query chunk length
    ck: int            # key chunk length
    lq: int            # whole query length
    lkv: int           # whole key length
    empty: frozenset   # (query chunk, key chunk) pairs the mask empties (ring skips them)
    steps: int         # ring steps that bring some rank a shard it needs (ring_steps)
    late: frozenset = frozenset()  # local pairs the ring backward computes last (late_pairs)
    tile_empty: frozenset | None = None  # this rank's pairs whose tile classes keep nothing (pair_is_empty)
    check: object = None  # the call check in flight (attention.prepare): verified() waits for its verdict

    @property
    def interpret(self) -> bool:
        return self.spec.target == "interpreter"

    @property
    def mine(self) -> tuple:
        return self.layout.chunks[self.rank]

    def verified(self) -> None:
        """Wait for the call check's verdict (an AttnccError where the ranks' calls differ): before
        the first exchange, as a collective would hang on a rank that has stopped."""
        if self.check is not None:
            check, self.check = self.check, None
            check()


@lru_cache(maxsize=256)
def ring_steps(layout, empty) -> int:
    """1 + the last ring step at which some rank gets a shard with a pair the mask keeps (by the
    derived bounds, so every rank counts alike): the steps after it move nothing anyone needs. A
    one-sided window over the contiguous layout needs two, whatever the ranks."""
    world, last = len(layout.chunks), 0
    for r, mine in enumerate(layout.chunks):
        for step in range(1, world):
            if any((i, j) not in empty for i in mine for j in layout.chunks[(r - step) % world]):
                last = max(last, step)
    return last + 1


def late_pairs(layout, rank: int, empty, steps: int, work: dict) -> frozenset:
    """The pairs of this rank's own query and key chunks that the ring backward leaves for last:
    it computes them while the dK/dV accumulators of its shard travel home (float32, as these pairs
    are added after the move), so that move runs under compute rather than exposed, as the first
    K/V move runs under the other local pairs. About half the local work by ``work`` (the mask's
    kept fraction per pair), the heaviest pair first into the lighter half, ties to the late one;
    none where there is no final move (one step)."""
    mine = layout.chunks[rank]
    pairs = sorted(((i, j) for i in mine for j in mine if (i, j) not in empty), key=lambda p: (-work[p], p))
    if steps < 2 or len(pairs) < 2:
        return frozenset()
    late, loads = [], [0.0, 0.0]  # early, late
    for p in pairs:
        side = 0 if loads[0] < loads[1] else 1
        if side:
            late.append(p)
        loads[side] += work[p]
    return frozenset(late)


def _work(s: Setup, *tensors):
    """The interpreter computes bf16 on raw bits: it gets float32 copies (as attncc.runtime does)."""
    if s.interpret:
        return [t.float() if t is not None and t.dtype == torch.bfloat16 else t for t in tensors]
    return list(tensors)


def _blocks(s: Setup, module, caps, q, i, j, kv_len, kv_off):
    if not module.BLOCK_SPARSE:
        return None
    fwd = s.compiled.classifier(s.spec)
    return blocks.for_module(module, fwd, caps, q.shape[0], q.shape[1], q.shape[2], kv_len, fwd.CLASS_PER_HEAD,
                             q.device, (i * s.cq, kv_off))


def pair_is_empty(s: Setup, caps, q, i: int, j: int) -> bool:
    """Whether the mask removes every (query of chunk i, key of chunk j): from the derived tile
    bounds (Setup.empty) or, for a mask that reads captured tensors, from its tile classes."""
    if (i, j) in s.empty:
        return True
    if s.tile_empty is None:
        s.tile_empty = _tile_empty(s, caps, q)
    return (i, j) in s.tile_empty


def _tile_empty(s: Setup, caps, q) -> frozenset:
    """The pairs this rank meets (its query chunks, the ring's steps) that a mask reading captured
    tensors empties, from their tile classes, read on the host once for all of them (the forward
    and the backward of the call ask again and again); none for other masks."""
    fwd = s.compiled.classifier(s.spec)
    world = len(s.layout.chunks)
    met = sorted({j for step in range(s.steps) for j in s.layout.chunks[(s.rank - step) % world]})
    todo = [(i, j) for i in s.mine for j in met if (i, j) not in s.empty]
    if not fwd.BLOCK_SPARSE or not todo:
        return frozenset()
    kept = torch.stack([blocks.fine_classes(fwd, caps, q.shape[0], q.shape[1], s.cq, s.ck, fwd.CLASS_PER_HEAD,
                                            q.device, (i * s.cq, j * s.ck)).any() for i, j in todo]).tolist()
    return frozenset(pair for pair, any_kept in zip(todo, kept) if not any_kept)


def forward_pair(s: Setup, q, k, v, caps, i: int, kv_off: int, out=None, lse=None):
    """(out, lse) of query chunk i (q) against keys k, v starting at position kv_off: lse float32,
    out float32 from the Triton tier and in q's dtype from the Gluon tier (its TMA store takes
    that dtype). out, lse: where to write them (a slot of the chunk's partials), else new."""
    B, H, L, _ = q.shape
    if out is None:
        out = torch.empty(B, H, L, v.shape[-1], dtype=partial_dtype(s, q), device=q.device)
        lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)

    def run(module):
        runtime.launch(module, q, k, v, out, lse, caps, s.scale, *s.rng,
                       blocks=_blocks(s, module, caps, q, i, None, k.shape[2], kv_off),
                       q_off=i * s.cq, kv_off=kv_off, n_kv_all=s.lkv)
    autograd.with_fallback(s.compiled, "fwd", s.spec, run, q, k)
    return out, lse


def partial_dtype(s: Setup, q):
    """The dtype of a pair's partial output: q's from the Gluon tier (its TMA store's), float32 else."""
    return q.dtype if s.spec.tier == "gluon" else torch.float32


def backward_pair(s: Setup, bwd_spec, q, k, v, out, lse, dout, dlse, caps, dcaps, i: int, kv_off: int,
                  dq_sum=None, dkv_sum=None, dkv_out=None, rows=None, dq_out=None):
    """float32 (dq, dk, dv) of one pair; capture gradients are added into dcaps. dq_sum, dkv_sum:
    float32 sums of earlier pairs (dq; dk and dv) that this pair's gradients are added to and that
    come back as the result: the Gluon tier's chunk kernels add dK and dV in place (no tensor of
    their own, no extra pass: H200, the ring's adds took ~3 ms of a 120 ms forward+backward at
    128k on 4 GPUs), other kernels write new ones, added here. dkv_out: new (dk, dv) to write
    (views of a larger buffer) where there is no sum. rows (Gluon chunk kernels, which take it in
    place of dq_sum): the query chunk's state that its pairs share, their dQ sum among it, written
    to dq_out, in any dtype, by the pair that passes it (the chunk's last); dq comes back as None
    before."""
    def run(module):
        adds = getattr(module, "TIER", "") == "gluon" and s.spec.offsets  # chunk kernels that add in place
        if rows is not None:
            if not adds:
                raise RuntimeError("backward_pair: a query chunk's shared rows need the Gluon chunk kernels")
            dq = dq_out
        else:
            dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if dkv_sum is not None:
            dk, dv = dkv_sum if adds else [torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in (k, v)]
        else:
            dk, dv = dkv_out or [torch.empty(t.shape, dtype=torch.float32, device=q.device) for t in (k, v)]
        extra = {}
        if adds:
            extra = dict(add_dkv=dkv_sum is not None and dk is dkv_sum[0])
            if rows is not None:
                extra.update(rows=rows, write_dq=dq is not None)
        runtime.launch(module, q, k, v, out, lse, dout, dlse, dq, dk, dv, caps, dcaps, s.scale, *s.rng,
                       blocks=_blocks(s, module, caps, q, i, None, k.shape[2], kv_off),
                       q_off=i * s.cq, kv_off=kv_off, n_kv_all=s.lkv, **extra)
        return dq, dk, dv
    dq, dk, dv = autograd.with_fallback(s.compiled, "bwd", bwd_spec, run, q, k)
    if dq_sum is not None and dq is not dq_sum:
        dq = dq_sum.add_(dq)
    if dkv_sum is not None and dk is not dkv_sum[0]:
        torch._foreach_add_(list(dkv_sum), [dk, dv])
        dk, dv = dkv_sum
    return dq, dk, dv


def merge(outs, lses, dtype):
    """(out, lse) of the keys of a query chunk's partials (outs (S, B, H, L, Dv), lses (S, B, H, L),
    natural log, -inf for rows without keys) in one pass of attncc's merge kernel (merge_states's,
    decoding's), out in ``dtype`` (float32 in the interpreter). Merged pair by pair in torch
    before (a float32 copy of each partial and a lerp: six passes over a chunk's rows a pair;
    2.7 ms of a 128k forward+backward on 4 H200s)."""
    S, B, H, L, dv = outs.shape
    out, lse = merge_stacked(outs.view(S, -1, dv), lses.view(S, -1), dtype)
    return out.view(B, H, L, dv), lse.view(B, H, L)


def _joined(parts: list, like, n: int):
    """The chunks of ``parts`` in order along the sequence, zeros where none was added: float32."""
    B, H, _, D = like.shape
    return torch.cat([p if p is not None else like.new_zeros(B, H, n, D, dtype=torch.float32) for p in parts], 2)


def _qchunks(s: Setup, t):
    return [t[:, :, a * s.cq:(a + 1) * s.cq] for a in range(len(s.mine))]


def _kvchunks(s: Setup, t):
    return [t[:, :, a * s.ck:(a + 1) * s.ck] for a in range(s.layout.per_rank)]


def _finish(s: Setup, parts, q, dv: int, dtype):
    """(out, lse) of the local queries from each chunk's merged partials (None: no key at all)."""
    B, H = q.shape[:2]
    outs, lses = [], []
    for p in parts:
        if p is None:  # every key masked: out 0, lse -inf, as single-GPU attention
            p = (q.new_zeros(B, H, s.cq, dv, dtype=torch.float32),
                 q.new_full((B, H, s.cq), float("-inf"), dtype=torch.float32))
        outs.append(p[0])  # a single partial may be in q's dtype
        lses.append(p[1])
    return torch.cat(outs, 2).to(dtype), torch.cat(lses, 2)


def ring_forward(s: Setup, comm, q, k, v, caps):
    """Each local query chunk's partials of the pairs the mask keeps go into slots of one buffer
    per chunk (the kernels write them there) and are merged once at the end (merge). The first
    local pair is launched before the call check's verdict (Setup.verified), the first send after
    it: NCCL's stream waits for that pair's kernel, a small part of the first step's compute."""
    dtype = q.dtype
    q, k, v = _work(s, q, k, v)
    qs = _qchunks(s, q)
    B, H, _, _ = q.shape
    dv = v.shape[-1]
    met = [[(step, b) for step in range(s.steps) for b, j in enumerate(s.layout.chunks[(s.rank - step) % comm.world])
            if not pair_is_empty(s, caps, qc, i, j)] for i, qc in zip(s.mine, qs)]  # per chunk: its pairs
    slots = [(torch.empty(len(m), B, H, s.cq, dv, dtype=partial_dtype(s, q), device=q.device),
              torch.empty(len(m), B, H, s.cq, dtype=torch.float32, device=q.device)) for m in met]
    cur = [k, v]
    for step in range(s.steps):
        ks, vs = _kvchunks(s, cur[0]), _kvchunks(s, cur[1])
        src = s.layout.chunks[(s.rank - step) % comm.world]
        pairs = [(a, b, i, qc, j) for a, (i, qc) in enumerate(zip(s.mine, qs)) for b, j in enumerate(src)
                 if (step, b) in met[a]]
        first = pairs[:1] if s.check is not None else []  # computes while the call check completes
        for a, b, i, qc, j in first:
            slot = met[a].index((step, b))
            forward_pair(s, qc, ks[b], vs[b], caps, i, j * s.ck, slots[a][0][slot], slots[a][1][slot])
        s.verified()
        pending = comm.ring_start(cur) if step < s.steps - 1 else None  # the next shard, while this computes
        for a, b, i, qc, j in pairs[len(first):]:
            slot = met[a].index((step, b))
            forward_pair(s, qc, ks[b], vs[b], caps, i, j * s.ck, slots[a][0][slot], slots[a][1][slot])
        if pending is not None:
            cur = pending.wait()
    parts = [None if not m else (o[0], l[0]) if len(m) == 1 else merge(o, l, dtype) for m, (o, l) in zip(met, slots)]
    return _finish(s, parts, q, dv, dtype)


def _rank_order(s: Setup) -> list:
    """The chunks in the order collectives lay the ranks' shards out: every rank's in turn."""
    return [c for chunks in s.layout.chunks for c in chunks]


def _reordered(s: Setup, rows, to_sequence: bool):
    """``rows`` (chunks of s.ck rows each) from the ranks' order into sequence order, or back: one
    copy of whole rows, none where the two orders agree (the contiguous layout)."""
    order = _rank_order(s)
    if order == sorted(order):
        return rows
    blocks = rows.split(s.ck)
    if to_sequence:
        at = {c: p for p, c in enumerate(order)}
        return torch.cat([blocks[at[c]] for c in range(len(order))])
    return torch.cat([blocks[c] for c in order])


def _rows_fit(length: int, row: int) -> bool:
    """Whether a sequence-major buffer of ``length`` rows of ``row`` elements keeps every offset
    the kernels compute from a position in int32 (position * row stride)."""
    return length * row < 2**31


def gather_kv(s: Setup, comm, k, v):
    """The whole K and V in sequence order from every rank's shard. Both shards go as one block of
    rows (sequence-major: a row is one position's keys and values of every batch and head) through
    one all-gather, and the chunks into sequence order by one copy of whole rows; K and V are
    (B, H, L, D) views of it (rows of B * H * (D + Dv) elements: the kernels take any strides).
    Slices of (B, H, L, D) shards, as gathered before, made two all-gathers and two copies through
    torch's strided cat, 0.24 ms each for K of 4 x 16 x 8192 x 128 bf16 on an H200. Where a
    position times that row would leave int32, the (B, H, L, D) way."""
    B, H, Lr, D = k.shape
    Dv, n = v.shape[-1], s.layout.n_chunks * s.ck
    if not _rows_fit(n, B * H * (D + Dv)):
        whole = []
        for t in (k, v):
            chunks = [None] * s.layout.n_chunks
            for r, part in enumerate(comm.all_gather(t)):
                for c, piece in zip(s.layout.chunks[r], _kvchunks(s, part)):
                    chunks[c] = piece
            whole.append(torch.cat(chunks, 2))
        return whole
    local = torch.empty(Lr, B * H * (D + Dv), dtype=k.dtype, device=k.device)
    local[:, :B * H * D].unflatten(1, (B, H, D)).copy_(k.permute(2, 0, 1, 3))
    local[:, B * H * D:].unflatten(1, (B, H, Dv)).copy_(v.permute(2, 0, 1, 3))
    rows = _reordered(s, comm.all_gather_rows(local), to_sequence=True)
    return (rows[:, :B * H * D].unflatten(1, (B, H, D)).permute(1, 2, 0, 3),
            rows[:, B * H * D:].unflatten(1, (B, H, Dv)).permute(1, 2, 0, 3))


def allgather_forward(s: Setup, comm, q, k, v, caps):
    dtype = q.dtype
    q, k, v = _work(s, q, k, v)
    s.verified()
    kw, vw = gather_kv(s, comm, k, v)
    parts = [forward_pair(s, qc, kw, vw, caps, i, 0) for i, qc in zip(s.mine, _qchunks(s, q))]
    return _finish(s, parts, q, v.shape[-1], dtype)


def _grad_buffers(s: Setup, bwd_spec, caps, learnable, device):
    acc = torch.int64 if bwd_spec.deterministic else torch.float32
    return [torch.zeros(caps[i].shape, dtype=acc, device=device) for i in learnable]


def _row_stats(s: Setup, lse, dlse):
    """Per query chunk: its lse and dlse rows, contiguous (the kernels read them as rows)."""
    lses = [c.contiguous() for c in _qchunks(s, lse)]
    dlses = [None] * len(lses) if dlse is None else [c.contiguous() for c in _qchunks(s, dlse)]
    return lses, dlses


def ring_backward(s: Setup, comm, bwd_spec, q, k, v, out, lse, dout, dlse, caps, learnable):
    """dq (float32; in q's dtype from the Gluon chunk kernels), dk, dv (in k's dtype) and the
    capture gradients of this rank's shards (summed over its pairs). A step collects its pairs'
    dK/dV per key chunk (the first pair's buffers as they come); the shard's accumulators arrive
    from rank - 1 while it computes, take those, and leave for rank + 1 while the next step
    computes, so their transfer is hidden as the K/V shards' is (added in place at the end of the
    step they would wait for it, exposed). After the last step (Setup.steps) one move takes them
    home, exposed: rounded to k's dtype, as nothing is added to them after it (half the bytes, the
    same result), or, where local pairs are left for last (Setup.late, late_pairs), in float32 while
    those compute, added in when it lands. Sending each chunk's as soon as its pairs were done
    measured no faster (H200 x4): a batched send waits for its receiver to reach the same point,
    which stalled the steps instead."""
    dtype = k.dtype
    q, k, v, out, dout = _work(s, q, k, v, out, dout)
    qs, outs, douts = _qchunks(s, q), _qchunks(s, out), _qchunks(s, dout)
    lses, dlses = _row_stats(s, lse, dlse)
    dcaps = _grad_buffers(s, bwd_spec, caps, learnable, q.device)
    n = s.layout.per_rank
    order = _backward_order(s, caps, qs, comm.world)
    last = {a: at for at, (_, a, _, _) in enumerate(order)}  # each query chunk's last pair
    # the Gluon chunk kernels keep a query chunk's dQ in their float32 buffer across its pairs (and
    # its rows' statistics: one preprocess per chunk), written out in q's dtype by its last pair
    rows = [{} for _ in qs] if bwd_spec.tier == "gluon" else None
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if rows else None
    dqs = _qchunks(s, dq) if rows else [None] * len(qs)

    def compute(at, a, b, j, ks, vs, sums):  # (dk, dv) of pair `at` of the order, added to sums (dk, dv)
        dsum = None if sums[b] is None else (sums[b], sums[n + b])
        i = s.mine[a]
        if rows:
            _, sums[b], sums[n + b] = backward_pair(
                s, bwd_spec, qs[a], ks[b], vs[b], outs[a], lses[a], douts[a], dlses[a], caps, dcaps, i, j * s.ck,
                dkv_sum=dsum, rows=rows[a], dq_out=dqs[a] if last[a] == at else None)
        else:
            dqs[a], sums[b], sums[n + b] = backward_pair(s, bwd_spec, qs[a], ks[b], vs[b], outs[a], lses[a], douts[a],
                                                         dlses[a], caps, dcaps, i, j * s.ck, dqs[a], dsum)

    cur, moved = [k, v], None
    for step in range(s.steps):
        pending = comm.ring_start(cur) if step < s.steps - 1 else None
        ks, vs = _kvchunks(s, cur[0]), _kvchunks(s, cur[1])
        part = [None] * (2 * n)  # this step's dK of each key chunk, then dV
        for at, (st, a, b, j) in enumerate(order):
            if st == step:
                compute(at, a, b, j, ks, vs, part)
        if moved is None:  # the first step: this step's sums start the accumulators (zeros where none)
            acc = [p if p is not None else torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                   for p, t in zip(part, ks + vs)]
        else:  # the shard's accumulators from the ranks before, sent under this step: add what this step has
            acc = moved.wait()
            added = [c for c, p in enumerate(part) if p is not None]
            if added:
                torch._foreach_add_([acc[c] for c in added], [part[c] for c in added])
        if step < s.steps - 1:
            moved = comm.ring_start(acc)  # on to rank + 1, under the next step's compute
        else:  # complete but for this rank's late pairs: home (rank - step; rank + 1 after W steps)
            moved = comm.ring_start(acc if s.late else [t.to(dtype) for t in acc], shift=comm.world - step)
        if pending is not None:
            cur = pending.wait()
    tail = [None] * (2 * n)  # the late local pairs' dK, dV, while the accumulators travel
    ks, vs = _kvchunks(s, k), _kvchunks(s, v)
    for at, (st, a, b, j) in enumerate(order):
        if st == s.steps:
            compute(at, a, b, j, ks, vs, tail)
    acc = moved.wait()  # this rank's own shard, every rank's pairs in it
    added = [c for c, t in enumerate(tail) if t is not None]
    if added:
        torch._foreach_add_([acc[c] for c in added], [tail[c] for c in added])
    if s.late:  # rounded once, after the last addition
        acc = [t.to(dtype) for t in acc]
    if rows:
        for a in set(range(len(qs))) - set(last):  # chunks whose every pair the mask empties
            dqs[a].zero_()
    else:
        dq = _joined(dqs, q, s.cq)
    return dq, torch.cat(acc[:n], 2), torch.cat(acc[n:], 2), dcaps


def _backward_order(s: Setup, caps, qs, world: int) -> list:
    """The ring backward's pairs in the order it computes them, as (step, query chunk a, key
    chunk b of the shard at hand, its chunk number j): step s.steps for the late local pairs
    (late_pairs), computed after the last step; none that the mask empties."""
    order = []
    for step in range(s.steps):
        src = s.layout.chunks[(s.rank - step) % world]
        for a, i in enumerate(s.mine):
            order += [(step, a, b, j) for b, j in enumerate(src)
                      if not pair_is_empty(s, caps, qs[a], i, j) and not (step == 0 and (i, j) in s.late)]
    for a, i in enumerate(s.mine):
        order += [(s.steps, a, b, j) for b, j in enumerate(s.mine)
                  if (i, j) in s.late and not pair_is_empty(s, caps, qs[a], i, j)]
    return order


def allgather_backward(s: Setup, comm, bwd_spec, q, k, v, out, lse, dout, dlse, caps, learnable):
    """dq, dk, dv (float32) and the capture gradients of this rank's shards: every key's dK and dV
    from this rank's query chunks, summed onto the ranks that hold the keys by a reduce-scatter.
    They are written sequence-major (one row: a position's dK and dV of every batch and head) where
    the offsets fit int32, so the reduce-scatter takes every rank's chunks in one copy of whole rows
    and one collective (torch's strided cat took 0.07 ms per chunk at 32k keys on an H200)."""
    q, k, v, out, dout = _work(s, q, k, v, out, dout)
    kw, vw = gather_kv(s, comm, k, v)
    lses, dlses = _row_stats(s, lse, dlse)
    dcaps = _grad_buffers(s, bwd_spec, caps, learnable, q.device)
    B, H, L, D = kw.shape
    Dv = vw.shape[-1]
    seq = _rows_fit(L, B * H * (D + Dv))

    def buffers():  # float32 rows (position-major) and the (dk, dv) views of them the kernels write
        rows = torch.empty(L, B * H * (D + Dv), dtype=torch.float32, device=q.device)
        return rows, (rows[:, :B * H * D].unflatten(1, (B, H, D)).permute(1, 2, 0, 3),
                      rows[:, B * H * D:].unflatten(1, (B, H, Dv)).permute(1, 2, 0, 3))

    rows, dkv = buffers() if seq else (None, None)
    dqs, dsum = [], None  # dK and dV of every key: the first query chunk's, the others' added to them
    for a, (i, qc, oc, doc) in enumerate(zip(s.mine, _qchunks(s, q), _qchunks(s, out), _qchunks(s, dout))):
        dq, dk, dv = backward_pair(s, bwd_spec, qc, kw, vw, oc, lses[a], doc, dlses[a], caps, dcaps, i, 0,
                                   dkv_sum=dsum, dkv_out=dkv)
        dqs.append(dq)
        dsum = (dk, dv)
    if seq:  # dsum: views of rows  # every rank's contribution to every key, summed on the rank that holds the key (half the
        # bytes an all-reduce moves)
        mine = comm.reduce_scatter_rows(_reordered(s, rows, to_sequence=False))
        dk = mine[:, :B * H * D].unflatten(1, (B, H, D)).permute(1, 2, 0, 3)
        dv = mine[:, B * H * D:].unflatten(1, (B, H, Dv)).permute(1, 2, 0, 3)
    else:
        held = lambda t, r: torch.cat([t[:, :, c * s.ck:(c + 1) * s.ck] for c in s.layout.chunks[r]], 2)  # noqa: E731
        dk, dv = (comm.reduce_scatter([held(t, r) for r in range(comm.world)]) for t in dsum)
    return torch.cat(dqs, 2), dk, dv, dcaps

