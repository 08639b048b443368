"""context_parallel: attention of a compiled variant over a sequence sharded across ranks.

Each rank passes its shards of q, k and v (attncc.distributed.shard) and gets its rows of the
attention over the whole sequence: the mods see global positions. Before anything is sent,
every rank's call is compared (an all-gather of a digest of its signature; where they differ, of
the signatures): a bad input on any rank is an AttnccError on every rank, naming the rank, never
a hang. The comparison's all-gather runs on the host while the first local kernel is launched
(Setup.verified: at 128k on 4 H200s it took a few ms with the GPUs idle). Then ``method`` runs
(attncc.distributed.ring), inside one autograd.Function whose backward runs the same method.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from functools import lru_cache

import torch

from .. import autograd, checks, runtime, tiers
from ..errors import AttnccError
from ..log import logger
from ..spec import Spec
from . import ring
from .comm import as_comm
from .layout import make_layout

METHODS = ("auto", "ring", "allgather")
# the cost model's machine, fitted to runs on 4 H200s (NVLink, NCCL 2.28, multicast off; causal and
# sliding-window masks, 32k-512k, 2 and 4 ranks, GQA: "auto" picks the method measured faster in 9 of
# 10, the tenth within 5 %; docs/context-parallelism.md): bytes/s a rank moves by one ring send and
# receive, and by a collective (all-gather, reduce-scatter: the bytes a rank receives), the kernels'
# FLOP/s, and what a forward kernel call on one chunk pair costs beside its FLOPs (a backward call
# twice as much: its launch path on the host, the waves it leaves part-empty). The interpreter and
# gloo are far slower but in about the same proportion, except calls, which the interpreter makes costly.
P2P_BYTES_S = {"nccl": 120e9, "gloo": 1e9, "threads": 1e12}
GATHER_BYTES_S = {"nccl": 150e9, "gloo": 1e9, "threads": 1e12}
FLOPS = {"gpu": 550e12, "interpreter": 2e8}
PAIR_S = {"gpu": 300e-6, "interpreter": 0.05}
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_chosen: set = set()  # decisions logged once each


def context_parallel(compiled, query, key, value, *, group=None, layout="zigzag", method="auto",
                     enable_gqa=False, return_lse=False, training=True, generator=None):
    """This rank's rows of ``compiled``'s attention over the sharded sequence; see the module."""
    how, grad = prepare(compiled, query, key, value, group=group, layout=layout, method=method,
                        enable_gqa=enable_gqa, training=training, generator=generator)
    captures = [c.tensor for c in compiled.variant.captures]
    if grad:
        out, lse = _ContextParallel.apply(query, key, value, how, *captures)
    else:
        out, lse = forward(how, query, key, value, captures)
    return (out, lse) if return_lse else out


def prepare(compiled, query, key, value, *, group, layout, method, enable_gqa, training, generator):
    """((Setup, communicator, method), whether gradients are needed) of a call, after the
    collective check; ``forward`` and ``backward`` take the first."""
    comm = as_comm(group)
    variant = compiled.variant
    captures = [c.tensor for c in variant.captures]
    dropout = training and variant.dropout_p > 0
    rng = autograd.draw_rng(generator).tolist() if dropout else [0, 0]  # advances each rank's generator alike
    local_error, lay, sig = _local_check(compiled, comm, query, key, value, captures, layout, method, enable_gqa,
                                         dropout)
    tensors = (query, key, value, *captures)
    grad = all(isinstance(t, torch.Tensor) for t in tensors) and autograd.needs_grad(tensors)
    digest = int.from_bytes(hashlib.sha1(repr((sig, grad)).encode()).digest()[:8], "little", signed=True)
    pending = comm.gather_ints([int(local_error is not None), digest, *rng], wait=False)

    def check():
        table = pending.wait()
        if any(row[0] for row in table) or any(row[1] != digest for row in table):
            _disagreement(comm, local_error, sig, grad)  # every rank sees the same table: all of them come here
        return table

    verdict = None
    if local_error is not None or dropout:  # the error to report, or rank 0's draw: the verdict first
        verdict, check = check(), None
    rng = verdict[0][2:] if dropout else None  # rank 0's draw: one dropout mask for the whole sequence
    setup = None
    try:
        setup = _setup(compiled, comm, lay, query, key, value, captures, rng, variant.dropout_p if dropout else 0.0,
                       check)
    finally:  # a call that stops here (a capture too small for the whole sequence) still takes the verdict
        if setup is None and check is not None:
            check()
    chosen, _ = choose_method(setup, comm, query, key, value, method, grad)
    return (setup, comm, chosen), grad


def _disagreement(comm, local_error, sig, grad):
    """Raise the AttnccError that names what went wrong on which rank (every rank calls it)."""
    views = comm.gather_objects((local_error, sig, grad))
    errors = [f"rank {r}: {e}" for r, (e, *_) in enumerate(views) if e]
    if errors:
        raise AttnccError("context_parallel: " + "; ".join(errors))
    for r, (_, other, other_grad) in enumerate(views):
        if other != sig or other_grad != grad:
            diff = [f"{name} {a!r} vs {b!r}" for (name, a), (_, b) in zip(sig + (("needs grad", grad),),
                                                                            other + (("needs grad", other_grad),))
                    if a != b]
            raise AttnccError(f"context_parallel: rank {r} disagrees with rank {comm.rank}: {', '.join(diff)}; "
                              "every rank must call with the same variant, layout, method and shard shapes")
    raise AttnccError("context_parallel: the ranks' calls differ (their signatures' digests do); every rank must "
                      "call with the same variant, layout, method and shard shapes")


def _local_check(compiled, comm, q, k, v, captures, layout, method, enable_gqa, dropout):
    """(error message or None, Layout, signature): what this rank alone can tell."""
    variant = compiled.variant
    lay, error, shapes = None, None, ()
    try:
        if method not in METHODS:
            raise AttnccError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
        lay = make_layout(layout, comm.world)
        checks.check_qkv(q, k, v, enable_gqa)
        checks.check_captures(variant.captures, q.device)
        shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        n = lay.per_rank
        for name, t in (("query", q), ("key", k)):
            if t.shape[2] % n or t.shape[2] == 0:
                raise AttnccError(f"the {name} shard's length {t.shape[2]} is not a positive multiple of the "
                                  f"{n} chunks each rank holds in the {lay.name!r} layout; pad the sequence to a "
                                  f"multiple of {lay.n_chunks}")
        if dropout and (q.shape[2] // n % 16 or k.shape[2] // n % 32):
            raise AttnccError(f"dropout keys its random numbers by tiles of 16 queries x 32 keys: chunks must "
                              f"start on that grid, but the query chunks have {q.shape[2] // n} rows and the key "
                              f"chunks {k.shape[2] // n}; make the whole length a multiple of {32 * lay.n_chunks}")
    except AttnccError as e:
        error = str(e)
    key = hashlib.sha1(variant.ir_key.encode()).hexdigest()[:16]
    sig = (("variant", key), ("scale", variant.scale), ("dropout_p", variant.dropout_p if dropout else 0.0),
           ("layout", None if lay is None else lay.chunks), ("method", method), ("shapes", shapes),
           ("dtype", str(getattr(q, "dtype", None))), ("captures", tuple(tuple(t.shape) for t in captures)))
    return error, lay, sig


def _setup(compiled, comm, lay, q, k, v, captures, rng, dropout_p, check=None) -> ring.Setup:
    variant = compiled.variant
    n = lay.per_rank
    cq, ck = q.shape[2] // n, k.shape[2] // n
    lq, lkv = cq * lay.n_chunks, ck * lay.n_chunks
    B, Hq, _, D = q.shape
    # the kernels' positions reach each chunk's offset plus its length rounded up to whole tiles
    whole = lambda c: -(-c // checks.WHOLE_TILE) * checks.WHOLE_TILE  # noqa: E731
    reach_q, reach_kv = max(lq, lq - cq + whole(cq)), max(lkv, lkv - ck + whole(ck))
    meta = lambda length: torch.empty(B, Hq, length, D, device="meta")  # noqa: E731 - shapes only
    checks.check_capture_indices(variant, meta(lq), meta(lkv))
    in_range = checks.captures_in_range(variant, meta(reach_q), meta(reach_kv), captures)
    target = runtime.target_for(q.device)
    scale = variant.scale if variant.scale is not None else 1.0 / math.sqrt(D)
    # no TMA or warp-specialised loop in the Triton tier (they take no position offsets); the Gluon tier
    # where tiers.choose_chunks takes it, its kernels rendered with Q_OFF and KV_OFF (plan.offsets)
    tier = "triton"
    if target.startswith("cuda-sm9"):
        tier = tiers.choose_chunks(variant, target, _DTYPES[q.dtype], D, v.shape[-1], rng is not None,
                                   (q[:, :, :cq], k[:, :, :ck], v[:, :, :ck]))[0]
    spec = Spec(_DTYPES[q.dtype], D, v.shape[-1], Hq // k.shape[1], target, rng is not None,
                positive_scale=scale > 0, in_range=in_range, tier=tier, offsets=tier == "gluon")
    seeds = (*rng, dropout_p) if rng is not None else ()
    empty = _empty_pairs(compiled, cq, ck, lay.n_chunks)
    steps = ring.ring_steps(lay, empty)
    late = ring.late_pairs(lay, comm.rank, empty, steps, _pair_work(compiled, cq, ck, lay.n_chunks))
    return ring.Setup(compiled, spec, scale, seeds, variant.deterministic, lay, comm.rank, cq, ck, lq, lkv, empty,
                      steps, late, check=check)


@lru_cache(maxsize=256)
def _bounds_fn(compiled_key, mask):
    """(q_lo, q_hi) -> (first, last) key a query tile may reach (floats, infinite where unbounded),
    from the mask's derived bounds, or None when they depend on b, h or tensors."""
    import sympy as sp

    from ..passes import bounds as bounds_pass
    from ..passes import symbolic
    lo, hi = sp.symbols("cp_lo cp_hi", integer=True)
    reach = bounds_pass.derive(mask, symbolic.Q, symbolic.KV, lo, hi).reach
    if (reach.first.free_symbols | reach.last.free_symbols) - {lo, hi}:
        return None
    first, last = (sp.lambdify((lo, hi), e, modules="math") for e in (reach.first, reach.last))
    return lambda a, b: (float(first(a, b)), float(last(a, b)))


def _empty_pairs(compiled, cq, ck, n) -> frozenset:
    """(query chunk, key chunk) pairs whose keys lie outside the mask's reach for the chunk's
    queries: derived from the mask (attncc.passes.bounds), never assumed."""
    if compiled.variant.analysis.facts.mask_trivial:
        return frozenset()
    return _empty_pairs_of(compiled.variant.ir_key, compiled.variant.analysis.mask, cq, ck, n)


@lru_cache(maxsize=256)
def _empty_pairs_of(compiled_key, mask, cq, ck, n) -> frozenset:
    """_empty_pairs, once per variant and chunking."""
    reach = _bounds_fn(compiled_key, mask)
    if reach is None:
        return frozenset()
    empty = set()
    for i in range(n):
        first, last = reach(i * cq, (i + 1) * cq - 1)
        for j in range(n):
            if last < j * ck or first > (j + 1) * ck - 1:
                empty.add((i, j))
    return frozenset(empty)


def _pair_work(compiled, cq, ck, n) -> dict:
    """(i, j) -> the fraction of the pair's scores in blocks the mask may keep, by its derived
    bounds on a grid of (up to) 64 x 64 blocks per pair: what the kernels' tile bounds leave to
    compute there (1 for every pair where the bounds are not known)."""
    if compiled.variant.analysis.facts.mask_trivial:
        return {(i, j): 1.0 for i in range(n) for j in range(n)}
    return _pair_work_of(compiled.variant.ir_key, compiled.variant.analysis.mask, cq, ck, n)


@lru_cache(maxsize=256)
def _pair_work_of(compiled_key, mask, cq, ck, n) -> dict:
    reach = _bounds_fn(compiled_key, mask)
    if reach is None:
        return {(i, j): 1.0 for i in range(n) for j in range(n)}
    sq, sk = min(64, cq), min(64, ck)
    starts = [b * ck // sk for b in range(sk)]  # the key blocks of a chunk, relative to its first key
    ends = [(b + 1) * ck // sk - 1 for b in range(sk)]
    kept = dict.fromkeys(((i, j) for i in range(n) for j in range(n)), 0)
    for i in range(n):
        for a in range(sq):
            first, last = reach(i * cq + a * cq // sq, i * cq + (a + 1) * cq // sq - 1)
            for j in range(n):  # the blocks that start at or before `last` and end at or after `first`
                kept[i, j] += max(0, bisect.bisect_right(starts, last - j * ck) - bisect.bisect_left(ends, first - j * ck))
    return {pair: c / (sq * sk) for pair, c in kept.items()}


def method_costs(setup: ring.Setup, world: int, backend: str, q_shape, kv_bytes: int, element_size: int,
                 dv: int, grad: bool = True) -> tuple:
    """(ring s, allgather s) the cost model gives a call on its slowest rank (every rank computes
    the same figures: the layout, the derived pairs). Per ring step the larger of its pairs' compute
    and the next shard's transfer (the backward moves the shard's float32 dK/dV with it, one step
    behind, and after the last step sends them home exposed), plus each kernel call's cost; the
    all-gather's transfers (K/V before the forward and again before the backward, dK/dV's float32
    reduce-scatter after it) are all exposed, its calls one per query chunk."""
    kind = "interpreter" if setup.interpret else "gpu"
    p2p, gather = P2P_BYTES_S.get(backend, 10e9), GATHER_BYTES_S.get(backend, 10e9)
    flops, pair_s = FLOPS[kind], PAIR_S[kind]
    B, Hq, _, D = q_shape
    lay = setup.layout
    full_pair = 2 * B * Hq * setup.cq * setup.ck * (D + dv) / flops  # a forward pair whose every score is kept
    work = _pair_work(setup.compiled, setup.cq, setup.ck, lay.n_chunks)
    move, move32 = kv_bytes / p2p, kv_bytes * 4 / element_size / p2p  # a shard, its float32 gradients
    ring_s = gather_s = 0.0
    for r, mine in enumerate(lay.chunks):
        t, total = 0.0, 0.0
        for step in range(setup.steps):
            kept = [(i, j) for i in mine for j in lay.chunks[(r - step) % world] if (i, j) not in setup.empty]
            f = sum(work[pair] for pair in kept) * full_pair
            last = step == setup.steps - 1
            t += max(f, 0.0 if last else move) + len(kept) * pair_s
            if grad:
                t += max(2.5 * f, 0.0 if last else move + move32) + 2 * len(kept) * pair_s
            total += f
        g = (world - 1) * kv_bytes / gather + total + len(mine) * pair_s
        if grad:
            t += move
            g += (world - 1) * kv_bytes * (1 + 4 / element_size) / gather + 2.5 * total + 2 * len(mine) * pair_s
        ring_s, gather_s = max(ring_s, t), max(gather_s, g)
    return ring_s, gather_s


def choose_method(setup: ring.Setup, comm, q, k, v, method="auto", grad=True) -> tuple:
    """(method, why). "auto" takes the cheaper of the two by method_costs (forward and, where
    gradients are wanted, backward)."""
    if method != "auto":
        return method, "asked for"
    W, lay = comm.world, setup.layout
    if W == 1:
        return "allgather", "one rank: nothing to move"
    kv_bytes = k.numel() * k.element_size() + v.numel() * v.element_size()
    ring_s, gather_s = method_costs(setup, W, comm.backend, tuple(q.shape), kv_bytes, k.element_size(), v.shape[-1],
                                    grad)
    chosen = "ring" if ring_s < gather_s else "allgather"
    why = (f"modelled {'forward+backward' if grad else 'forward'}: ring {ring_s * 1e3:.3g} ms, all-gather "
           f"{gather_s * 1e3:.3g} ms ({kv_bytes / 2**20:.3g} MiB K/V per rank, {W} ranks, {comm.backend})")
    key = (setup.compiled.variant.ir_key, chosen, W, setup.lq, setup.lkv, lay.chunks, comm.backend, grad)
    if key not in _chosen:
        _chosen.add(key)
        logger.info("context_parallel(%s): %s (%s)", setup.compiled.variant.name, chosen, why)
    return chosen, why


def forward(how, q, k, v, caps):
    """(out, lse) of this rank's query rows (float32 lse)."""
    setup, comm, method = how
    fwd = ring.ring_forward if method == "ring" else ring.allgather_forward
    try:
        return fwd(setup, comm, q, k, v, runtime.interp_captures(caps) if setup.interpret else list(caps))
    finally:
        setup.verified()  # where nothing was exchanged, or a kernel failed, the check's verdict all the same


def backward(how, q, k, v, out, lse, caps, dout, dlse, learnable):
    """dq, dk, dv of this rank's shards and the gradients of captures[i], i in learnable, summed
    over the ranks. Every rank must call it (the autograd Function does; so can code that runs
    ranks as threads of one process on a GPU, where autograd's one worker thread per device
    would run the ranks' backwards one inside the other)."""
    setup, comm, method = how
    # the Gluon backward where the forward took the Gluon tier and tiers.choose_backward takes it at the
    # key chunks' length (its kernels at chunk positions, plan.offsets), else the Triton tier's
    bwd_spec = setup.compiled.bwd_spec(setup.spec, learnable, setup.deterministic, setup.ck)
    if not setup.spec.offsets:
        bwd_spec = dataclasses.replace(bwd_spec, tier="triton")
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is not None:
        dlse = dlse.float()
    run_caps = runtime.interp_captures(caps) if setup.interpret else caps
    bwd = ring.ring_backward if method == "ring" else ring.allgather_backward
    dq, dk, dv, dcaps = bwd(setup, comm, bwd_spec, q, k, v, out, lse, dout, dlse, run_caps, learnable)
    grads = []
    for i, g in zip(learnable, dcaps):
        comm.all_reduce(g)  # the capture's gradient from every rank's rows (int64 when deterministic)
        grads.append(runtime._float_grads([g])[0].to(caps[i].dtype))
    dense = torch.contiguous_format  # the all-gather's dK and dV are views of a sequence-major block
    return (dq.to(q.dtype, memory_format=dense), dk.to(k.dtype, memory_format=dense),
            dv.to(v.dtype, memory_format=dense), grads)


class _ContextParallel(torch.autograd.Function):
    """(out, lse) of the local query rows; backward gives this rank's dq, dk, dv and the capture
    gradients summed over the ranks."""

    @staticmethod
    def forward(ctx, q, k, v, how, *caps):
        out, lse = forward(how, q, k, v, caps)
        ctx.how = how
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, *caps)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *caps = ctx.saved_tensors
        learnable = tuple(i for i in range(len(caps)) if ctx.needs_input_grad[4 + i])
        dq, dk, dv, dcaps = backward(ctx.how, q, k, v, out, lse, caps, dout, dlse, learnable)
        grads = [None] * len(caps)
        for i, g in zip(learnable, dcaps):
            grads[i] = g
        return (dq, dk, dv, None, *grads)
