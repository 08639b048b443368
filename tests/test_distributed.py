"""Context parallelism (attncc.distributed) on CPU: 2 and 4 gloo ranks spawned by the tests.

Each case shards q, k, v (and the output gradient) over the ranks, runs
kernel.context_parallel with each layout and method, gathers out, lse and every gradient, and
rank 0 compares them with single-process attncc on the unsharded tensors (same kernels, same
dropout seed): they must agree to float32 rounding of the merges. Bad inputs must raise the same
AttnccError on every rank.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch

import attncc
from attncc import AttnccError
from attncc.distributed import ThreadGroup, balanced_layout, shard, unshard

B, D = 1, 16


def _case(name, L, H=2, device="cpu"):
    """(Variant, H, Hkv, learnable captures): the variants of the issue, built identically on every rank."""
    g = torch.Generator().manual_seed(1234)
    Hkv, learn = H, []
    if name == "causal":
        v = attncc.Variant(None, lambda b, h, q, kv: q >= kv)
    elif name == "sliding_window":
        v = attncc.Variant(None, lambda b, h, q, kv: (q >= kv) & (q - kv < 40))
    elif name == "document":
        doc = torch.sort(torch.randint(0, 5, (L,), generator=g)).values.to(device)
        v = attncc.Variant(None, lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv))
    elif name == "prefix_lm":
        v = attncc.Variant(None, lambda b, h, q, kv: (kv < 40) | (q >= kv))
    elif name == "alibi":
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=device)
        v = attncc.Variant(lambda s, b, h, q, kv: s + slopes[h] * (kv - q), lambda b, h, q, kv: q >= kv)
    elif name == "softcap":
        v = attncc.Variant(lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0))
    elif name == "rel_bias":
        table = (0.1 * torch.randn(H, 2 * L - 1, generator=g)).to(device).requires_grad_()
        learn = [table]
        v = attncc.Variant(lambda s, b, h, q, kv: s + table[h, q - kv + L - 1], lambda b, h, q, kv: q >= kv)
    elif name == "gqa":
        H, Hkv = 2 * H, H
        v = attncc.Variant(None, lambda b, h, q, kv: q >= kv)
    elif name == "dropout":
        v = attncc.Variant(None, lambda b, h, q, kv: q >= kv, dropout_p=0.25)
    elif name == "window":  # one-sided and shorter than a chunk of 4 contiguous ranks: the ring stops early
        v = attncc.Variant(None, lambda b, h, q, kv: (q >= kv) & (q - kv < 12))
    elif name == "holes":  # rows with no key at all, in every pair they meet (both merge sides empty)
        v = attncc.Variant(None, lambda b, h, q, kv: (q >= kv) & (q % 7 != 3))
    elif name == "band":  # empties every chunk pair off the diagonal, on both sides
        v = attncc.Variant(None, lambda b, h, q, kv: (q - kv <= 6) & (kv - q <= 6))
    else:
        raise KeyError(name)
    return v, H, Hkv, learn


def _inputs(H, Hkv, L, batch=B, dim=D, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(batch, H, L, dim, generator=g)
    k, v = (torch.randn(batch, Hkv, L, dim, generator=g) for _ in range(2))
    do = torch.randn(batch, H, L, dim, generator=g)
    dl = torch.randn(batch, H, L, generator=g)
    return [t.to(device, dtype if t is not dl else torch.float32) for t in (q, k, v, do, dl)]


def _single(kernel, q, k, v, do, dl, learn, gqa):
    """Single-process attncc on the whole sequence: out, lse, dq, dk, dv, d(learnable)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(99)  # the dropout draw
    out, lse = kernel(q, k, v, enable_gqa=gqa, return_lse=True)
    grads = torch.autograd.grad((out * do).sum() + (lse * dl).sum(), (q, k, v, *learn))
    return (out.detach(), lse.detach(), *grads)


def _sharded(kernel, comm, q, k, v, do, dl, learn, gqa, layout, method):
    """The same through context_parallel on this rank's shards, unsharded again."""
    qs, ks, vs, dos, dls = (shard(t, comm, layout=layout).requires_grad_(t is not do and t is not dl)
                            for t in (q, k, v, do, dl))
    torch.manual_seed(99)
    out, lse = kernel.context_parallel(qs, ks, vs, group=comm, layout=layout, method=method, enable_gqa=gqa,
                                       return_lse=True)
    grads = torch.autograd.grad((out * dos).sum() + (lse * dls).sum(), (qs, ks, vs, *learn))
    whole = [unshard(t.detach().contiguous(), comm, layout=layout) for t in (out, lse, *grads[:3])]
    return (*whole, *grads[3:])  # capture gradients are summed over the ranks already


NAMES = ("out", "lse", "dq", "dk", "dv", "dcapture")


def _compare(got, want, what):
    for name, a, b in zip(NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {name}: {m}")


def _run_cases(comm, cases, runs, L):
    """Each case under each (layout, method) of runs, the whole sequence L long."""
    for name in cases:
        variant, H, Hkv, learn = _case(name, L)
        kernel = attncc.compile(variant)
        q, k, v, do, dl = _inputs(H, Hkv, L)
        want = _single(kernel, q, k, v, do, dl, learn, H != Hkv) if comm.rank == 0 else None
        for layout, method in runs:
            lay = balanced_layout(kernel, L, comm.world) if layout == "balanced" else layout
            got = _sharded(kernel, comm, q, k, v, do, dl, learn, H != Hkv, lay, method)
            if comm.rank == 0:
                _compare(got, want, f"{name}, {layout}, {method}, {comm.world} ranks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, job, args):
    import torch.distributed as dist
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from attncc.distributed.comm import Comm
        job(Comm(), *args)
    finally:
        dist.destroy_process_group()


def _spawn(world, job, *args):
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(world, _free_port(), job, args), nprocs=world, join=True)


MASKS = ("causal", "sliding_window", "document", "prefix_lm", "alibi")
MODS = ("softcap", "rel_bias", "gqa", "band", "holes")
ALL_RUNS = tuple((layout, method) for layout in ("contiguous", "zigzag") for method in ("ring", "allgather"))
RING = (("contiguous", "ring"), ("zigzag", "ring"))


# Lengths: 16 query rows per chunk on two ranks (their 4 zigzag chunks: 64), 8 on four; dropout
# needs chunks of 32 (its tile grid). Kept small: each kernel launch costs ~0.1 s interpreted.
@pytest.mark.parametrize("cases", [MASKS, MODS], ids=["masks", "mods"])
def test_two_ranks_every_variant_layout_and_method(cases):
    _spawn(2, _run_cases, cases, ALL_RUNS, 64)


def test_two_ranks_dropout_draws_the_single_process_mask():
    _spawn(2, _run_cases, ("dropout",), ALL_RUNS, 128)


def test_four_ranks():
    """Three ring hops (the dK/dV accumulators travel all the way home), learnable captures summed
    over four ranks, tile classes of a data-dependent mask at offsets, dropout."""
    _spawn(4, _four_ranks_job)


def _four_ranks_job(comm):
    _run_cases(comm, ("causal",), ALL_RUNS, 64)
    _run_cases(comm, ("document", "rel_bias", "band", "window"), RING, 64)
    _run_cases(comm, ("dropout",), (("contiguous", "ring"),), 128)


def test_balanced_layout_document_mask():
    _spawn(2, _run_cases, ("document",), (("balanced", "ring"), ("balanced", "allgather")), 64)


def _expect_error(fn, *needles):
    try:
        fn()
    except AttnccError as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return
    raise AssertionError(f"no AttnccError (expected one naming {needles})")


def _bad_inputs(comm):
    """Every rank must raise, whichever rank is wrong; afterwards the group still works."""
    r = comm.rank
    causal = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q >= kv))
    x = lambda L, H=2, d=D: torch.randn(1, H, L, d)  # noqa: E731
    # shard shapes differ between the ranks
    L = 64 if r == 0 else 32
    _expect_error(lambda: causal.context_parallel(x(L), x(L), x(L), group=comm), "disagrees", "shapes")
    # a length that the layout cannot split (zigzag: two chunks per rank), on every rank
    _expect_error(lambda: causal.context_parallel(x(33), x(33), x(33), group=comm, layout="zigzag"),
                  "rank 0:", "multiple")
    # a bad input on one rank only: the others name it too
    kk = x(32, d=8) if r == 1 else x(32)
    _expect_error(lambda: causal.context_parallel(x(32), kk, x(32), group=comm), "rank 1:", "head dims differ")
    # ranks disagree on the variant
    other = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q > kv))
    _expect_error(lambda: (other if r == 1 else causal).context_parallel(x(32), x(32), x(32), group=comm),
                  "disagrees", "variant")
    # dropout: chunks must start on its 16 x 32 tile grid
    drop = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q >= kv, dropout_p=0.5))
    _expect_error(lambda: drop.context_parallel(x(48), x(48), x(48), group=comm, layout="contiguous"),
                  "16 queries x 32 keys")
    # a captured tensor sized for one shard, not for the whole sequence (global positions)
    doc = torch.zeros(64, dtype=torch.int64)
    docs = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: doc[q] == doc[kv]))
    _expect_error(lambda: docs.context_parallel(x(64), x(64), x(64), group=comm, layout="contiguous"),
                  "too small")
    _expect_error(lambda: causal.context_parallel(x(32), x(32), x(32), group=comm, method="tree"), "unknown method")
    out = causal.context_parallel(x(32), x(32), x(32), group=comm, layout="contiguous", method="ring")
    assert out.shape == (1, 2, 32, D) and torch.isfinite(out).all()


def _bad_inputs_and_host_check(comm):
    _bad_inputs(comm)
    r = comm.rank
    # a NCCL group's call check runs on the host, through a gloo group of its ranks made once (the
    # backend's name faked here: a NCCL all-gather would have the host wait for every queued kernel)
    from attncc.distributed import comm as comm_module
    fake = comm_module.Comm()
    fake.backend = "nccl"
    assert fake.gather_ints([r, 7]) == [[0, 7], [1, 7]] and fake.gather_ints([5 * r]) == [[0], [5]]
    import torch.distributed as dist
    assert comm_module._SIDE_GROUPS[dist.group.WORLD]["gloo"]() is not None
    # the ring's high-priority NCCL group: where NCCL is missing (this CPU build), the group itself
    assert fake._ring_group() is fake.group


def test_bad_inputs_raise_on_every_rank():
    _spawn(2, _bad_inputs_and_host_check)


def test_bad_inputs_in_process_group():
    ThreadGroup(3).run(_bad_inputs)


def test_empty_chunk_pairs_are_derived_from_the_mask():
    """Which (query chunk, key chunk) pairs the ring skips comes from the mask's tile bounds."""
    from attncc.distributed.attention import _empty_pairs
    n, c = 4, 32
    band = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: (q - kv <= 6) & (kv - q <= 6)))
    assert _empty_pairs(band, c, c, n) == {(i, j) for i in range(n) for j in range(n) if abs(i - j) > 1}
    causal = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q >= kv))
    assert _empty_pairs(causal, c, c, n) == {(i, j) for i in range(n) for j in range(n) if j > i}
    anti = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: kv >= q + 40))
    assert _empty_pairs(anti, c, c, n) == {(i, j) for i in range(n) for j in range(n) if j <= i}
    assert _empty_pairs(attncc.compile(attncc.Variant()), c, c, n) == frozenset()


def test_ring_skips_pairs_of_a_data_dependent_mask(monkeypatch):
    """Documents: pairs of chunks of different documents run no kernel; results stay exact."""
    from attncc.distributed import ring
    L, calls = 128, []
    doc = torch.arange(L) // 32  # one document per contiguous chunk of 2 ranks x 2 chunks
    kernel = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: doc[q] == doc[kv]))
    q, k, v, do, dl = _inputs(2, 2, L)
    want = _single(kernel, q, k, v, do, dl, [], False)
    real = ring.forward_pair
    monkeypatch.setattr(ring, "forward_pair", lambda s, *a: calls.append(a[4:6]) or real(s, *a))  # (i, kv_off)
    got = ThreadGroup(2).run(lambda comm: _sharded(kernel, comm, q, k, v, do, dl, [], False, "zigzag", "ring"))
    _compare(got[0], want, "documents")
    assert sorted(calls) == [(i, i * 32) for i in range(4)]  # only the diagonal pairs ran


@pytest.mark.parametrize("late", [True, False], ids=["late-pairs", "no-late-pairs"])
def test_ring_in_bfloat16_rounds_once(late, monkeypatch):
    """bf16 shards on three ranks (the interpreter computes on float32 copies): the ring's dK/dV
    accumulators are rounded to bf16 once, after their last addition, as single-process attncc
    rounds once: on their last move home, or, where local pairs are left for last
    (ring.late_pairs), after those are added at home (the move is then float32). The kernels sum in
    float32 in another order, so the rounded results equal single-process attncc's but where a
    float32 sum lies within its rounding error of a bf16 rounding boundary (an injected second
    rounding, before the late pairs' add, changed 14 % of dK)."""
    from attncc.distributed import ring
    if not late:
        monkeypatch.setattr(ring, "late_pairs", lambda *args: frozenset())
    L = 96  # 6 zigzag chunks of 16
    variant, H, Hkv, learn = _case("alibi", L)
    kernel = attncc.compile(variant)
    q, k, v, do, dl = _inputs(H, Hkv, L, dtype=torch.bfloat16)
    want = _single(kernel, q, k, v, do, dl, learn, False)
    sent = [[] for _ in range(3)]  # per rank: the dtypes of each ring move

    def rank(comm):
        start = comm.ring_start
        comm.ring_start = lambda ts, shift=1: sent[comm.rank].append({t.dtype for t in ts}) or start(ts, shift)
        return _sharded(kernel, comm, q, k, v, do, dl, learn, False, "zigzag", "ring")

    got = ThreadGroup(3).run(rank)[0]
    last = torch.float32 if late else torch.bfloat16
    for moves in sent:  # K/V (float32 copies here) and the accumulators in float32, the last move as said
        assert moves[-1] == {last} and all(m == {torch.float32} for m in moves[:-1]), moves
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"bf16 {name}: {m}")
        if name in ("dk", "dv"):
            differ = (a != b).float().mean().item()
            assert differ < 0.02, f"{name}: {differ:.1%} of the elements differ from single-process attncc's rounding"


def test_call_check_completes_under_the_first_local_kernel(monkeypatch):
    """The ring forward launches its first local pair, then waits for the call check's verdict,
    then sends: the host all-gather of the check runs while the GPU computes; a disagreement
    still raises on every rank before anything is sent."""
    from attncc.distributed import ring
    variant, H, Hkv, _ = _case("causal", 32)
    kernel = attncc.compile(variant)
    q, k, v, _, _ = _inputs(H, Hkv, 32)
    events = [[] for _ in range(2)]
    pair, verified = ring.forward_pair, ring.Setup.verified
    monkeypatch.setattr(ring, "forward_pair", lambda s, *a, **kw: events[s.rank].append("pair") or pair(s, *a, **kw))
    monkeypatch.setattr(ring.Setup, "verified",
                        lambda s: (events[s.rank].append("verdict") if s.check else None) or verified(s))

    def rank(comm):
        start = comm.ring_start
        comm.ring_start = lambda ts, shift=1: events[comm.rank].append("send") or start(ts, shift)
        shards = [shard(t, comm, layout="zigzag") for t in (q, k, v)]
        return kernel.context_parallel(*shards, group=comm, method="ring")

    ThreadGroup(2).run(rank)
    for e in events:
        assert e[:3] == ["pair", "verdict", "send"], e
    events[:] = [[], []]  # rank 1 calls another variant: both raise, neither sends
    other = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q > kv))

    def mixed(comm):
        start = comm.ring_start
        comm.ring_start = lambda ts, shift=1: events[comm.rank].append("send") or start(ts, shift)
        shards = [shard(t, comm, layout="zigzag") for t in (q, k, v)]
        _expect_error(lambda: (other if comm.rank else kernel).context_parallel(*shards, group=comm, method="ring"),
                      "disagrees", "variant")

    ThreadGroup(2).run(mixed)
    assert "send" not in events[0] + events[1], events


def test_ring_stops_after_the_last_step_anyone_needs():
    """A one-sided window over four contiguous ranks: each rank needs its own shard and the one
    before, so the ring runs two steps (one K/V move each way) and the dK/dV accumulators go
    home in one move of three ranks back; results as single-process attncc's."""
    from attncc.distributed.ring import ring_steps
    from attncc.distributed.layout import make_layout
    from attncc.distributed.attention import _empty_pairs
    L = 64
    variant, H, Hkv, learn = _case("window", L)
    kernel = attncc.compile(variant)
    lay = make_layout("contiguous", 4)
    assert ring_steps(lay, _empty_pairs(kernel, 16, 16, 4)) == 2
    assert ring_steps(make_layout("zigzag", 4), _empty_pairs(kernel, 8, 8, 8)) == 4  # chunk 7 - r needs 5 - r
    q, k, v, do, dl = _inputs(H, Hkv, L)
    want = _single(kernel, q, k, v, do, dl, learn, False)
    shifts = [[] for _ in range(4)]

    def rank(comm):
        start = comm.ring_start
        comm.ring_start = lambda ts, shift=1: shifts[comm.rank].append(shift) or start(ts, shift)
        return _sharded(kernel, comm, q, k, v, do, dl, learn, False, "contiguous", "ring")

    got = ThreadGroup(4).run(rank)[0]
    assert shifts == [[1, 1, 1, 3]] * 4, shifts  # forward K/V; backward K/V, dK/dV on, dK/dV home
    _compare(got, want, "window, contiguous ring of 4")

    def auto(comm):  # rank 0 has the fewest pairs here: "auto" still picks alike on every rank
        from attncc.distributed.attention import prepare
        shards = [shard(t, comm, layout="contiguous") for t in (q, k, v)]
        return prepare(kernel, *shards, group=comm, layout="contiguous", method="auto", enable_gqa=False,
                       training=False, generator=None)[0][2]
    assert len(set(ThreadGroup(4).run(auto))) == 1


def test_context_parallel_inside_torch_compile():
    """A compiled function that calls context_parallel (either form) runs it eagerly, a graph
    break (Dynamo used to trace into the kernels with fake tensors and fail): the same out and
    gradients as without torch.compile."""
    from attncc import runtime
    from attncc.distributed import context_parallel
    runtime._triton(for_cpu=True)  # before torch.compile imports triton (without its interpreter)
    L = 64
    variant, H, Hkv, learn = _case("alibi", L)
    kernel = attncc.compile(variant)
    q, k, v, do, dl = _inputs(H, Hkv, L)

    def rank(comm):
        def loss(fn, a, b, c):
            return (fn(a, b, c) * shard(do, comm)).sum()
        results = []
        for fn in (lambda a, b, c: kernel.context_parallel(a, b, c, group=comm),
                   lambda a, b, c: context_parallel(a, b, c, variant.score_mod, variant.mask_mod, group=comm)):
            for run in (loss, torch.compile(loss, backend="aot_eager")):
                qs, ks, vs = (shard(t, comm).requires_grad_() for t in (q, k, v))
                value = run(fn, qs, ks, vs)
                results.append((value.detach(), *torch.autograd.grad(value, (qs, ks, vs))))
        return results

    for results in ThreadGroup(2).run(rank):
        for got in results[1:]:
            for a, b in zip(got, results[0]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_shard_unshard_round_trip_and_balanced_layout():
    x = torch.arange(2 * 96).view(1, 2, 96, 1).float()
    for layout in ("contiguous", "zigzag"):
        parts = ThreadGroup(3).run(lambda comm: unshard(shard(x, comm, layout=layout), comm, layout=layout))
        assert all(torch.equal(p, x) for p in parts)
    z = ThreadGroup(2).run(lambda comm: shard(x, comm, layout="zigzag"))
    assert torch.equal(z[0], torch.cat([x[:, :, :24], x[:, :, 72:]], 2))
    # documents of very different lengths: each rank's unmasked work comes out within 25% of the other's
    doc = torch.cat([torch.zeros(192), torch.ones(32), torch.full((32,), 2)]).long()
    kernel = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv)))
    lay = balanced_layout(kernel, 256, 2, chunks_per_rank=4)
    qi = torch.arange(256)
    keep = (doc[qi][:, None] == doc[qi][None, :]) & (qi[:, None] >= qi[None, :])
    work = [sum(int(keep[c * 32:(c + 1) * 32].sum()) for c in chunks) for chunks in lay.chunks]
    assert max(work) <= 1.25 * min(work), (lay, work)


def test_in_process_lq_ne_lkv_deterministic_and_no_grad():
    """Queries and keys of different lengths (each cut into the layout's chunks), a deterministic
    variant with a learnable table (int64 fixed-point gradients summed over the ranks), and a
    call without gradients (no autograd node)."""
    Lq, Lkv, H = 64, 128, 2
    g = torch.Generator().manual_seed(3)
    table = (0.1 * torch.randn(H, Lq + Lkv, generator=g)).requires_grad_()
    kernel = attncc.compile(attncc.Variant(lambda s, b, h, q, kv: s + table[h, q - kv + Lkv],
                                           lambda b, h, q, kv: kv <= 2 * q, deterministic=True))
    q = torch.randn(1, H, Lq, D, generator=g)
    k, v = (torch.randn(1, H, Lkv, D, generator=g) for _ in range(2))
    do = torch.randn(1, H, Lq, D, generator=g)
    dl = torch.randn(1, H, Lq, generator=g)
    want_out, want_lse = kernel(q, k, v, return_lse=True)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, l = kernel(qg, kg, vg, return_lse=True)
    want = (want_out, want_lse, *torch.autograd.grad((o * do).sum() + (l * dl).sum(), (qg, kg, vg, table)))

    def rank(comm):
        qs, ks, vs = (shard(t, comm, layout="zigzag").requires_grad_() for t in (q, k, v))
        dos, dls = (shard(t, comm, layout="zigzag") for t in (do, dl))
        with torch.no_grad():
            plain = kernel.context_parallel(qs, ks, vs, group=comm, method="ring")
        assert plain.grad_fn is None
        out, lse = kernel.context_parallel(qs, ks, vs, group=comm, method="ring", return_lse=True)
        grads = torch.autograd.grad((out * dos).sum() + (lse * dls).sum(), (qs, ks, vs, table))
        return (*(unshard(t.detach(), comm, layout="zigzag") for t in (out, lse, *grads[:3])), grads[3],
                unshard(plain, comm, layout="zigzag"))

    got = ThreadGroup(2).run(rank)
    _compare(got[0], want, "Lq != Lkv, deterministic")
    torch.testing.assert_close(got[0][-1], want_out, rtol=2e-4, atol=2e-5)
    assert torch.equal(got[0][5], got[1][5])  # the same capture gradient on every rank


def test_auto_method_says_which_and_why(caplog):
    import logging
    from attncc.distributed import attention
    from attncc.distributed.attention import choose_method
    attention._chosen.clear()  # each decision is logged once per process
    kernel = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q >= kv))
    q, k, v = (torch.randn(1, 2, 64, D) for _ in range(3))
    caplog.set_level(logging.INFO, logger="attncc")
    ThreadGroup(2).run(lambda comm: kernel.context_parallel(shard(q, comm), shard(k, comm), shard(v, comm),
                                                           group=comm, method="auto"))
    assert any("context_parallel" in r.getMessage() and ("ring" in r.getMessage() or "allgather" in r.getMessage())
               for r in caplog.records), caplog.text
    assert callable(choose_method)


def test_context_parallel_backward_keeps_the_triton_tier(monkeypatch):
    """Where the forward's chunk kernels are the Triton tier's (the interpreter here; on sm90 where
    the Gluon tier does not fit), the backward's are too, whatever tier it would choose (forced to
    gluon here): only a Gluon forward's Spec asks for Gluon kernels at chunk positions."""
    from attncc import tiers
    g = torch.Generator().manual_seed(5)
    kernel = attncc.compile(attncc.Variant(mask_mod=lambda b, h, q, kv: kv <= q))
    q, k, v, do = (torch.randn(1, 2, 64, D, generator=g) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(kernel(qg, kg, vg), (qg, kg, vg), do)
    monkeypatch.setattr(tiers, "choose_backward", lambda *args, **kwargs: ("gluon", "forced by the test"))
    kernel._bwd_specs.clear()  # chosen afresh
    from attncc.distributed import ring
    specs, ring_backward = [], ring.ring_backward

    def spy(setup, comm, bwd_spec, *args):
        specs.append(bwd_spec)
        return ring_backward(setup, comm, bwd_spec, *args)
    monkeypatch.setattr(ring, "ring_backward", spy)

    def rank(comm):
        qs, ks, vs = (shard(t, comm, layout="zigzag").requires_grad_() for t in (q, k, v))
        out = kernel.context_parallel(qs, ks, vs, group=comm, method="ring")
        grads = torch.autograd.grad(out, (qs, ks, vs), shard(do, comm, layout="zigzag"))
        return [unshard(t, comm, layout="zigzag") for t in grads]

    got = ThreadGroup(2).run(rank)[0]
    assert len(specs) == 2 and all(spec.tier == "triton" for spec in specs), specs
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5)


def test_late_pairs_split_the_local_work():
    """The ring backward leaves about half of each rank's own pairs (by the mask's kept fraction)
    for last, to run under the accumulators' move home; none where the ring has one step."""
    from attncc.distributed.attention import _empty_pairs, _pair_work
    from attncc.distributed.layout import make_layout
    from attncc.distributed.ring import late_pairs, ring_steps
    causal = attncc.compile(attncc.Variant(None, lambda b, h, q, kv: q >= kv))
    lay, c = make_layout("zigzag", 4), 64
    empty, work = _empty_pairs(causal, c, c, 8), _pair_work(causal, c, c, 8)
    assert work[(1, 0)] == 1.0 and work[(0, 1)] == 0.0 and 0.45 < work[(3, 3)] < 0.55
    for r, mine in enumerate(lay.chunks):
        late = late_pairs(lay, r, empty, ring_steps(lay, empty), work)
        local = {(i, j) for i in mine for j in mine if (i, j) not in empty}
        assert late and late < local, (r, late)
        assert abs(sum(work[p] for p in late) - sum(work[p] for p in local - late)) <= max(work[p] for p in local)
    assert late_pairs(lay, 0, empty, 1, work) == frozenset()  # one step: no move home to hide


@pytest.mark.parametrize("rows", [True, False], ids=["sequence-major", "strided"])
def test_allgather_rows_and_their_fallback(rows, monkeypatch):
    """The all-gather method moves K/V and dK/dV as sequence-major rows (one collective each, the
    chunks reordered by one copy); where a position times such a row would leave int32, as
    (B, H, L, D) slices. Both agree with single-process attncc, GQA and Dv != D included."""
    from attncc.distributed import ring
    monkeypatch.setattr(ring, "_rows_fit", lambda length, row: rows)
    L = 64
    for name in ("causal", "gqa"):
        variant, H, Hkv, learn = _case(name, L)
        kernel = attncc.compile(variant)
        q, k, v, do, dl = _inputs(H, Hkv, L)
        v, do = (torch.cat([t, t[..., :8]], -1) for t in (v, do))  # Dv = D + 8
        want = _single(kernel, q, k, v, do, dl, learn, H != Hkv)
        for layout in ("zigzag", "contiguous"):
            got = ThreadGroup(2).run(lambda comm: _sharded(kernel, comm, q, k, v, do, dl, learn, H != Hkv, layout,
                                                           "allgather"))
            _compare(got[0], want, f"{name} {layout} all-gather, rows {rows}")


@pytest.mark.parametrize("L", [40, 2100])  # rows (2 heads x L): merge_splits (a program each), merge_rows (blocks)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_ring_merge_of_a_chunks_partials(dtype, L):
    """ring.merge (one pass of attncc's merge kernel over a query chunk's partials) against a
    float64 merge: rows without keys in some partials, in all of them (out 0, lse -inf); few rows
    (a program each, as decoding's) and many (blocks of rows, the last one ragged)."""
    from attncc.distributed import ring
    g = torch.Generator().manual_seed(3)
    outs = torch.randn(3, 1, 2, L, 16, generator=g).to(dtype)
    lses = torch.randn(3, 1, 2, L, generator=g) * 3
    lses[1, :, :, :5] = float("-inf")
    lses[:, :, :, 7] = float("-inf")
    out, lse = ring.merge(outs, lses, torch.bfloat16)
    want_lse = torch.logsumexp(lses.double(), 0)
    want = (torch.exp(lses.double() - want_lse).nan_to_num(0.0)[..., None] * outs.double()).sum(0)
    assert torch.isfinite(out).all() and (out[:, :, 7] == 0).all() and (lse[:, :, 7] == float("-inf")).all()
    keep = torch.arange(L) != 7
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[..., keep].double(), want_lse[..., keep], rtol=1e-5, atol=1e-5)
