"""The whole Gluon backward as rendered (producer warp, two consumer warp groups, the Q / dO ring
with its row statistics, the dS^T meeting, dQ's hand-over to the producer and its TMA reduce-adds),
run in Python on the CPU, where Triton cannot run Gluon: every mbarrier wait yields until its phase
completes (arrivals and expected bytes, as the hardware counts them), the warps of several programs
are interleaved at random, TMA copies land in any order, products and reduce-adds complete some
turns after they are issued. The values are provenance, not numbers: each carries the set of tiles
it was computed from, so every product must combine one query tile's Q, dO, lse and Delta with the
program's K and V (a slot refilled too early, or read before it landed, mixes two tiles); the dQ
product must read both warp groups' dS^T of its step; each dQ half must be added once, into its
tile's block, and be intact until the add completes; each warp group's dK and dV must hold every
step of its program once, staged in K's and V's buffers only once neither warp group's products
read them any more. Broken kernels (MUTATIONS: a wait or a hand-over out of place) must fail it.
The arithmetic is the step tests' (tests/test_gluon_python.py) and the GPU tests'."""
from __future__ import annotations

import inspect
import random
import re
import types

import pytest

import attncc
from attncc import blocks, codegen, plan, runtime
from attncc.spec import Spec
from test_gluon_python import (_Barrier, _CInt, _Gl, _Ptr, _Ring, _arrive, _expect, _in_python, _interleave, _land,
                               _sparse_masks, _wait)
from test_gluon_tier import _variant

runtime._triton(for_cpu=True)
C = _CInt


class _V:
    """A tensor value: the tiles it was computed from (facts) and, for dK / dV accumulators, the
    query tiles added into it in order, with the product's kind ("dk", "dv") (steps)."""

    def __init__(self, facts=(), steps=()):
        self.facts, self.steps = frozenset(facts), tuple(steps)

    def _op(self, *others):
        facts, steps = set(self.facts), self.steps
        for o in others:
            if isinstance(o, _V):
                facts, steps = facts | o.facts, steps + o.steps
        return _V(facts, steps)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _op
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __and__ = __rand__ = __or__ = __ror__ = _op
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __neg__ = __invert__ = _op
    __hash__ = object.__hash__

    def to(self, *a, **k):
        return self

    def tiles(self, kind):
        return {f[1] for f in self.facts if f[0] == kind}


def _union(*xs):
    """Any gl function of tensors: the union of their facts (ints and floats carry none)."""
    vals = [x for x in xs if isinstance(x, _V)]
    return vals[0]._op(*vals[1:]) if vals else _V()


class _Smem:
    """A shared-memory buffer (or a slice of one): its parts' facts, by row range along dim 0, and the
    steps of dK / dV values stored there (the epilogue's staging)."""

    def __init__(self, name, rows, parts=None, lo=0, hi=None, steps=None):
        self.name, self.rows, self.lo, self.hi = name, rows, lo, rows if hi is None else hi
        self.parts = {} if parts is None else parts  # (lo, hi) -> facts stored there
        self.steps = {} if steps is None else steps  # (lo, hi) -> steps of the value stored there

    def slice(self, start, n, dim=0):
        if dim != 0:  # columns of every row (dQ's query rows of dS^T): the same parts
            return self
        return _Smem(self.name, self.rows, self.parts, self.lo + int(start), self.lo + int(start) + int(n), self.steps)

    def permute(self, dims):
        return self

    def reshape(self, shape):
        return self

    def index(self, i):
        raise AssertionError("a ring's slot is a _Ring's item")

    def store(self, value):
        for key in [k for k in self.parts if k[0] < self.hi and self.lo < k[1]]:  # overwritten
            del self.parts[key]
            self.steps.pop(key, None)
        self.parts[(self.lo, self.hi)] = value.facts
        self.steps[(self.lo, self.hi)] = value.steps

    def facts(self):
        """What the slice holds: every row must have been written (a read of rows never stored fails)."""
        covered, facts = 0, set()
        for (lo, hi), f in self.parts.items():
            if lo < self.hi and self.lo < hi:
                covered += min(hi, self.hi) - max(lo, self.lo)
                facts |= f
        assert covered == self.hi - self.lo, f"{self.name}[{self.lo}:{self.hi}] read before it was written"
        return frozenset(facts)

    def load(self, layout=None):
        return _V(self.facts(), self.steps.get((self.lo, self.hi), ()))


class _Out:
    """DK or DV: pointer arithmetic keeps its name and program."""

    def __init__(self, name, pid):
        self.name, self.pid = name, pid

    def __add__(self, other):
        return self

    @property
    def dtype(self):
        return types.SimpleNamespace(element_ty=None)


class _Desc:
    def __init__(self, name):
        self.name, self.dtype, self.block_type = name, None, types.SimpleNamespace(nbytes=1)


def _pipeline(module, p_fields, programs, rng, H, Lq):
    """Run `programs` programs of the rendered backward (p_fields: the Pipeline's scalars and tile
    lists) at random interleavings. Returns the dQ reduce-adds (coordinate, facts of what was added)
    and the dK / dV stores (name, program, query tiles added into them in order)."""
    bm, bn, _, stages = module.LAUNCH_TILES["attn_bwd"]
    copies, adds, pending, stores = [], [], [], []

    def tma_load(desc, coords, bar, slot):
        b, h, row, _ = (int(c) for c in coords)
        fact = (desc.name, (b, h, row)) if desc.name in ("k", "v") else (desc.name, (b * H + h) * Lq + row)
        copies.append((slot, frozenset([fact]), bar, desc.block_type.nbytes))

    def tma_engine():  # lands the copies in flight, in any order
        while True:
            if copies:
                slot, facts, bar, nbytes = copies.pop(rng.randrange(len(copies)))
                slot.parts.clear()  # shared with the slices taken of it
                slot.steps.clear()
                slot.parts[(0, slot.rows)] = facts
                _land(bar, nbytes)
            yield

    def tma_add(desc, coords, slot):
        pending.append((int(coords[0]), slot, slot.facts()))

    def store_wait(pendings):  # the reduce-adds complete some turns later; their sources must be intact
        for _ in range(rng.randrange(4)):
            yield
        while pending:
            coord, slot, facts = pending.pop()
            assert slot.facts() == facts, f"{slot.name} rewritten while its reduce-add read it"
            adds.append((coord, facts))

    def rows_to_smem(ptr, row, n_rows, smem, bar, BLOCK_M):  # row statistics: the rows' first names the tile
        smem.store(_V([(ptr, int(row))]))
        _arrive(bar)
        yield from ()

    def mma(a, b, acc, use_acc=True, is_async=True):
        reads = [x for x in (a, b) if isinstance(x, _Smem)]
        facts = frozenset().union(*(x.facts() if isinstance(x, _Smem) else x.facts for x in (a, b)))
        out = _V(facts | (acc.facts if use_acc else frozenset()))
        rows = set().union(*(out.tiles(kind) for kind in ("q", "do", "lse", "delta")))
        assert len(rows) == 1, f"a product mixes query tiles {sorted(rows)} ({sorted(out.facts)})"
        assert len(out.tiles("k")) <= 1 and len(out.tiles("v")) <= 1, f"a product mixes K/V tiles {sorted(out.facts)}"
        if not isinstance(a, _Smem) and b.name.endswith((".q", ".do")):  # dV += P^T dO, dK += dS^T Q: a step of dK, dV
            out = _V(acc.facts, acc.steps + tuple((row, "dk" if b.name.endswith(".q") else "dv") for row in rows))
        return out, reads, [r.facts() for r in reads]

    def mma_wait(num_outstanding, deps):
        for _ in range(rng.randrange(3)):  # the products run while other warps go on
            yield
        out = []
        for d in deps:
            if isinstance(d, tuple):  # a product: its shared-memory operands still hold what it read
                d, reads, facts = d
                for r, f in zip(reads, facts):
                    assert r.facts() == f, f"{r.name} refilled while a product read it"
            out.append(d)
        return out[0] if len(out) == 1 else tuple(out)

    def load(ptr, mask=None, other=0.0):
        return C(int(ptr.flat[ptr.offset])) if isinstance(ptr, _Ptr) else _V()  # a tile list's entry; dK's sum

    def store(ptr, value, mask=None, sem=None):
        stores.append((ptr.name, ptr.pid, value.steps))

    def ints_or(fn):
        return lambda *xs: _union(*xs) if any(isinstance(x, _V) for x in xs) else fn(*xs)

    gl = dict(constexpr=object, tensor=object, float32="f32", int32="i32", int64="i64", cdiv=ints_or(_Gl.cdiv),
              maximum=ints_or(_Gl.maximum), minimum=ints_or(_Gl.minimum),
              where=lambda c, x, y: _union(c, x, y) if isinstance(c, _V) else (x if c else y),
              NVMMADistributedLayout=lambda **k: None, DotOperandLayout=lambda **k: None, SliceLayout=lambda *a: None,
              BlockedLayout=lambda *a: None, arange=lambda *a, **k: _V(), zeros=lambda *a, **k: _V(), zeros_like=_union,
              full=lambda *a, **k: _V(), expand_dims=lambda x, d: x, convert_layout=lambda x, layout: x,
              reshape=lambda x, s: x, permute=lambda x, d: x, exp2=_union, log2=_union, abs=_union,
              sum=lambda x, axis: x, fma=_union, static_range=range, load=load, store=store, atomic_add=store,
              num_programs=lambda axis: programs)
    env = {"Pipeline": object, "_wait": _wait, "_store_wait": store_wait, "_rows_to_smem": rows_to_smem,
           "warpgroup_mma": mma, "warpgroup_mma_wait": mma_wait, "_tma_load": tma_load, "_tma_add": tma_add,
           "fence_async_shared": lambda: None, "_tanh": _union, "_sigmoid": _union,
           "mbarrier": types.SimpleNamespace(wait=_wait, arrive=_arrive, expect=_expect)}
    waiting = ["consumer", "producer", "_step", "_dq_add", "_rows_to_smem", "warpgroup_mma_wait", "_store_wait"]
    plain = ["_program", "_q_range", "_q_block", "_q_rotation", "_floor_div", "_floor_mod", "_floor_div_or_0",
             "_floor_mod_or_a"]
    sources = []
    for name in plain + waiting[:4]:
        if hasattr(module, name):
            src = inspect.getsource(getattr(module, name).fn)
            src = src[src.index("def "):].replace("mbarrier.wait(", "yield from _wait(").replace("tma.store_wait(",
                                                                                                  "_store_wait(")
            if name in waiting:  # calls of functions that wait: delegate to them
                src = re.sub(r"(?<![\w.])(%s)\(" % "|".join(w for w in waiting if w != name), r"yield from \1(", src)
            sources.append(compile(src, module.__file__, "exec"))
    kernel = module.attn_bwd.fn  # a Launcher (attncc.launcher) holding the Gluon kernel
    kernel = inspect.getsource(getattr(kernel, "fn", kernel))  # the barriers' arrival counts, as the kernel sets them
    counts = {name: int(n) for name, n in re.findall(r"mbarrier\.init\((\w+)\.index\(\w+\), count=(\d+)\)", kernel)}
    assert set(counts) == {"kv_ready", "kv_done", "q_ready", "do_ready", "ds_ready", "dq_bars"}, counts
    tasks = []
    for pid in range(programs):
        penv = dict(env, gl=types.SimpleNamespace(**gl, program_id=lambda axis, pid=pid: C(pid)))
        for code in sources:
            exec(code, penv)
        rings = {n: _Ring([_Barrier(counts[n]) for _ in range(k)])
                 for n, k in [("kv_ready", 1), ("kv_done", 1), ("q_ready", stages), ("do_ready", stages),
                              ("ds_ready", 2), ("dq_bars", 4)]}
        p = types.SimpleNamespace(
            q_desc=_Desc("q"), do_desc=_Desc("do"), k_desc=_Desc("k"), v_desc=_Desc("v"), dq_desc=_Desc("dq"),
            lse_ptr="lse", delta_ptr="delta", k_smem=_Ring([_Smem(f"p{pid}.k", 2 * bn)]), v_smem=_Ring([_Smem(f"p{pid}.v", 2 * bn)]),
            q_smem=_Ring([_Smem(f"p{pid}.slot{i}.q", bm) for i in range(stages)]),
            do_smem=_Ring([_Smem(f"p{pid}.slot{i}.do", bm) for i in range(stages)]),
            lse_smem=_Ring([_Smem(f"p{pid}.slot{i}.lse", bm) for i in range(stages)]),
            delta_smem=_Ring([_Smem(f"p{pid}.slot{i}.delta", bm) for i in range(stages)]),
            ds_smem=_Ring([_Smem(f"p{pid}.ds{i}", 2 * bn) for i in range(2)]),
            dq_smem=_Ring([_Smem(f"p{pid}.dq{i}", bm) for i in range(2)]),
            BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, **p_fields, **rings)
        extra = [True] if hasattr(p, "Q_OFF") else []  # ADD_DKV: the path that adds to earlier pairs' sums
        params = list(inspect.signature(module.consumer.fn).parameters)
        extra += [_V() if n.endswith("_ptr") else C(1) for n in params[12 + len(extra):]]  # captured tensors
        tasks += [penv["producer"](p)] + [penv["consumer"](p, wg, _Out("dk", pid), _Out("dv", pid), *[C(1)] * 8, *extra)
                                          for wg in range(2)]
    _interleave(tasks, tma_engine(), rng)
    assert not copies and not pending
    return adds, stores


CASES = [("causal", 128, 1, None), ("full", 64, 1, None), ("prefix_lm", 128, 2, None), ("causal", 64, 4, None),
         ("sliding_window", 128, 1, (300, 200)), ("document_causal", 128, 1, None), ("block_table", 64, 1, None)]


@pytest.mark.parametrize("name,d,group,offsets", CASES, ids=[f"{n}-d{d}-g{g}-{'cp' if o else 'single'}"
                                                             for n, d, g, o in CASES])
def test_gluon_backward_pipeline(name, d, group, offsets, tmp_path):
    """The backward's producer and consumers as rendered, at random interleavings of all programs of
    small calls: no deadlock; every product combines one query tile's Q, dO, lse and Delta with the
    program's K and V, and its shared-memory operands hold them until it completes; every step's dQ
    halves (both warp groups' dS^T of that step) are added once into their tile's blocks; each warp
    group's dK and dV hold every query tile of its program once, in the schedule's order."""
    _check_pipeline(name, d, group, offsets, tmp_path)


_DK_WAIT = "    dk, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dsT_op))\n"
_DQ_HANDOVER = "    mbarrier.arrive(p.dq_bars.index(WG), count=1)\n"
MUTATIONS = {  # name: (edits of the rendered kernel, what the model must say)
    # dQ handed over while dK's product still reads Q: the producer may refill the slot (FA4's order
    # as first timed, 2026-11-28)
    "dq-before-dk": ([(_DK_WAIT, ""), (_DQ_HANDOVER, _DQ_HANDOVER + _DK_WAIT)], "refilled while a product read it"),
    # dQ's product reads the other warp group's dS^T before it is written
    "no-ds-meeting": ([("    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)\n", "")], "read before it was written"),
    # dK, dV staged in K's buffer while the other warp group's products still read K
    "no-kv-done-wait": ([("        mbarrier.wait(p.kv_done.index(0), 0)\n", "")], "read before it was written"),
    # dQ's buffer rewritten before the producer's reduce-add of the previous step read it
    "no-dq-free-wait": ([("    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)", "    pass  #")],
                        "rewritten while its reduce-add read it"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_gluon_backward_pipeline_catches(mutation, tmp_path):
    """The model is not vacuous: each of these broken kernels fails it."""
    edits, message = MUTATIONS[mutation]
    with pytest.raises(AssertionError, match=message):
        _check_pipeline("causal", 128, 1, None, tmp_path, edits)


def _check_pipeline(name, d, group, offsets, tmp_path, edits=()):
    sparse = _sparse_masks(1000)
    variant = attncc.Variant(None, sparse[name]) if name in sparse else _variant(name, H=2 * group)
    spec = Spec("bfloat16", d, d, group, "cuda-sm90", tier="gluon", offsets=offsets is not None)
    source = codegen.render(plan.build("bwd", variant.analysis, spec, variant.captures))
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    path = tmp_path / "bwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    bm, bn = module.LAUNCH_TILES["attn_bwd"][:2]
    calls = [(1, 2 * group, 300, 500), (2, 2 * group, 200, 130), (1, 2 * group, 1, 1)]  # B, H, Lq, Lkv
    for seed, (B, H, Lq, Lkv) in enumerate(calls):
        heads = 1 if Lkv >= module.SPLIT_HEADS_FROM else group  # query heads per program, as the launcher
        pairs, n_kv, n_q = B * H // heads, -(-Lkv // (2 * bn)), -(-Lq // bm)
        fields = dict(H=C(H), PAIRS=C(pairs), N_CTX_Q=C(Lq), N_CTX_KV=C(Lkv), sm_scale=0.1, lse_to_acc=-0.5, CHUNK=C(2),
                      HEAD_DIM=d, GROUP=group, HEADS=heads, FOLD_LSE="if p.FOLD_LSE:" in source)
        if offsets is not None:
            fields.update(Q_OFF=C(offsets[0]), KV_OFF=C(offsets[1]))
        if module.BLOCK_SPARSE:  # the K/V tiles' query-tile lists (the Triton tier classifies, interpreted)
            classifier = attncc.compile(variant).classifier(Spec("bfloat16", d, d, 1, "interpreter"))
            caps = [c.tensor for c in variant.captures]
            fine = blocks.fine_classes(classifier, caps, B, H, Lq, Lkv, module.CLASS_PER_HEAD, "cpu")
            lists = blocks.tile_lists(fine, *module.TILES["attn_bwd"], True)
            fields.update(cls_partial_cnt=_Ptr(lists[0].reshape(-1)), cls_partial_idx=_Ptr(lists[1].reshape(-1)),
                          cls_full_cnt=_Ptr(lists[2].reshape(-1)), cls_full_idx=_Ptr(lists[3].reshape(-1)),
                          CLS_OUTER=C(lists[4]), CLS_INNER=C(lists[5]), cls_order=_Ptr(blocks.longest_first(lists)))
        adds, stores = _pipeline(module, fields, n_kv * pairs, random.Random(seed), H, Lq)

        # what the schedule asks for: per program, its steps' query tiles (row keys) in order
        p = types.SimpleNamespace(BLOCK_M=bm, BLOCK_N=bn, **fields)
        program = _in_python(module._program)
        want_adds, want_steps = [], {}
        for pid in range(n_kv * pairs):
            _Gl.pid = pid
            b, h0, kv_lo, *sched, n_masked, n = program(p)
            if module.BLOCK_SPARSE:
                order = [int(_in_python(module._q_block)(C(i), *sched, n_masked)) for i in range(int(n))]
            else:
                q_off, kv_off = offsets or (0, 0)
                rot = _in_python(module._q_rotation)(C(kv_off - q_off + int(kv_lo)) if offsets else kv_lo, sched[0], bm)
                order = [int(_in_python(module._q_block)(C(i), *sched, n_masked, rot)) for i in range(int(n))]
            steps = []
            for j in range(int(n) * heads):
                h, tile = int(h0) + j % heads, order[j // heads]
                steps.append((int(b) * H + h) * Lq + tile * bm)
                want_adds += [((int(b) * H + h) * n_q + tile) * 2 + wg for wg in (0, 1)]
            want_steps[pid] = tuple(steps)
        got_adds = []
        for coord, facts in adds:
            block = coord // (bm * d // 128 // 4)  # the rows of 256 floats a warp group's half takes
            bh, tile = divmod(block // 2, n_q)
            rows = {f[1] for f in facts if f[0] in ("q", "do", "lse", "delta")}
            assert rows == {bh * Lq + tile * bm}, f"dQ of query tile {sorted(rows)} added into block {block}"
            got_adds.append(block)
        assert sorted(got_adds) == sorted(want_adds), "dQ halves added more or less than once"
        for pid, steps in want_steps.items():
            for out in ("dk", "dv"):
                got = [s for o, q, s in stores if (o, q) == (out, pid)]
                want = tuple((row, out) for row in steps)  # dK's products into dK, dV's into dV
                assert got == [want, want], (out, pid, got, want)  # each warp group: every step once, in order
