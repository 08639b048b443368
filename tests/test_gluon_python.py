"""The Gluon kernels' code, as rendered, run in Python on the CPU, where Triton's interpreter
cannot run Gluon: their integer tile schedules (with Gluon's C division) against brute force over
the mask, and the forward's softmax step and the backward's step (torch in place of `gl`, shared
memory as tensors, asynchronous products computed at issue, barriers as no-ops) over the kernels'
tile order against the float64 reference, at single-device and chunk positions (Q_OFF, KV_OFF).
What they cannot see (barriers, asynchrony, TMA, layouts, speed) the GPU tests do
(tests/test_gpu_gluon.py, tests/test_gpu_distributed.py)."""
from __future__ import annotations

import inspect

import pytest
import torch

import attncc
from attncc import codegen, plan, runtime
from attncc.spec import Spec
from test_gluon_tier import _variant

# The generated Gluon modules these tests load import triton; where that import is the process's
# first, the CPU tests after them would find triton without its interpreter: import it as attncc's
# CPU calls do (interpreter on, on a machine without CUDA)
runtime._triton(for_cpu=True)


# The Gluon kernels' tile schedules, run in Python: _block_range / _block (forward) and _q_range /
# _q_rotation / _q_block (backward) are integer code, so they run here with gl's few functions and
# Gluon's division (it truncates, as C) in place of the GPU's, against brute force over the mask:
# every tile with a kept score is visited once, tiles run without the mask code only where every
# score is kept, and with chunk positions (Q_OFF, KV_OFF) the same holds at those positions.
def _ints_only(op):
    """An _CInt operator that leaves other operands (the pipeline model's tensor values) to them."""
    def wrapped(a, b):
        return op(a, b) if isinstance(b, int) else NotImplemented
    return wrapped


class _CInt(int):
    """An int with Gluon's (C's) // and %, which truncate toward zero."""

    @_ints_only
    def __add__(a, b):
        return _CInt(int(a) + int(b))

    __radd__ = __add__

    @_ints_only
    def __sub__(a, b):
        return _CInt(int(a) - int(b))

    @_ints_only
    def __rsub__(a, b):
        return _CInt(int(b) - int(a))

    @_ints_only
    def __mul__(a, b):
        return _CInt(int(a) * int(b))

    __rmul__ = __mul__

    def __neg__(a):
        return _CInt(-int(a))

    def to(a, dtype):
        return a

    @_ints_only
    def __floordiv__(a, b):
        q = abs(int(a)) // abs(int(b))
        return _CInt(q if (int(a) >= 0) == (int(b) > 0) else -q)

    @_ints_only
    def __rfloordiv__(b, a):
        return _CInt(a) // b

    @_ints_only
    def __mod__(a, b):
        return a - b * (a // b)

    @_ints_only
    def __rmod__(b, a):
        return _CInt(a) % b


class _Gl:
    pid = 0  # gl.program_id(0) of the program the test runs
    program_id = staticmethod(lambda axis: _CInt(_Gl.pid))
    int64 = "int64"
    load = staticmethod(lambda ptr: _CInt(int(ptr.flat[ptr.offset])))  # a tile list's entry (_Ptr)
    cdiv = staticmethod(lambda a, b: (_CInt(a) + b - 1) // b)
    maximum = staticmethod(lambda a, b: _CInt(max(int(a), int(b))))
    minimum = staticmethod(lambda a, b: _CInt(min(int(a), int(b))))
    where = staticmethod(lambda c, x, y: x if c else y)


def _in_python(jitted, done=None):
    """A Gluon function as plain Python over _CInt (and the Gluon functions it calls, likewise)."""
    import types
    done = {} if done is None else done
    fn = jitted.fn
    fn = getattr(fn, "fn", fn)  # a kernel the module launches is wrapped (attncc.launcher): its function
    if fn not in done:
        env = dict(fn.__globals__, gl=_Gl)
        done[fn] = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
        for name, value in fn.__globals__.items():
            if hasattr(value, "fn") and callable(value.fn) and name != fn.__name__:
                env[name] = _in_python(value, done)
    return done[fn]


SCHEDULE_MASKS = {  # mask_mod, head dims; windows wider than a tile, both signs of slope, h in the bounds
    "causal": (lambda b, h, q, k: q >= k, (128, 64)),
    "window_300": (lambda b, h, q, k: (q >= k) & (q - k < 300), (128, 64)),
    "symmetric_200": (lambda b, h, q, k: (q - k).abs() <= 200, (128, )),
    "prefix_lm": (lambda b, h, q, k: (k < 70) | (q >= k), (128, 64)),
    "per_head_window": (lambda b, h, q, k: (q >= k) & (q - k < 150 * (h + 1)), (128, )),
    "keys_ahead": (lambda b, h, q, k: k >= q + 90, (128, )),
    "bottom_right": (lambda b, h, q, k: q + 500 >= k, (64, )),
    "full": (None, (64, )),
}
# (Lq, Lkv, Q_OFF, KV_OFF): single-device calls (offsets 0), and chunks of a longer sequence
SCHEDULE_CALLS = [(1, 1, 0, 0), (17, 300, 0, 0), (777, 1000, 0, 0), (1000, 333, 0, 0), (256, 256, 512, 256),
                  (300, 300, 600, 0), (250, 250, 0, 750), (384, 128, 1000, 1152), (200, 640, 64, 64)]


@pytest.mark.parametrize("name", sorted(SCHEDULE_MASKS))
def test_gluon_tile_schedules_visit_every_kept_score(name, tmp_path):
    mask_mod, dims = SCHEDULE_MASKS[name]
    variant = attncc.Variant(None, mask_mod)
    for d in dims:
        for kind in ("fwd", "bwd"):
            for offsets in (False, True):
                spec = Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon", offsets=offsets)
                source = codegen.render(plan.build(kind, variant.analysis, spec, variant.captures))
                path = tmp_path / f"{kind}_{d}_{offsets}.py"
                path.write_text(source)
                module = runtime.load(path, True, source)
                for Lq, Lkv, q_off, kv_off in SCHEDULE_CALLS:
                    if not offsets and (q_off or kv_off):
                        continue
                    for h in (0, 2):
                        _check_schedule(module, kind, mask_mod, Lq, Lkv, q_off, kv_off, h, offsets,
                                        f"{name} {kind} d{d} Lq={Lq} Lkv={Lkv} at {q_off}, {kv_off}, h={h}")


def _check_schedule(module, kind, mask_mod, Lq, Lkv, q_off, kv_off, h, offsets, what):
    q = torch.arange(Lq)[:, None] + q_off
    k = torch.arange(Lkv)[None, :] + kv_off
    keep = torch.ones(Lq, Lkv, dtype=torch.bool) if mask_mod is None else mask_mod(0, torch.tensor(h), q, k)
    keep = keep.expand(Lq, Lkv)
    C = _CInt
    if kind == "fwd":  # a program: query rows [m0, m0 + BQ), key tiles of BN
        bm, bn = module.LAUNCH_TILES["attn_fwd"][:2]
        bq = module.WGS * bm
        block_range, block = _in_python(module._block_range), _in_python(module._block)
        outer, inner = (bq, Lq), (bn, Lkv)

        def ranges(m0):
            return block_range(C(0), C(h), C(q_off + m0), bq, C(Lkv), bn, *([C(kv_off)] if offsets else []))

        def order(it, hi, full_lo, full_hi, n_hi, n_masked, m0):
            return block(C(it), hi, full_lo, full_hi, n_hi, n_masked)
        tile_keep = lambda o, i: keep[o * bq:(o + 1) * bq, i * bn:(i + 1) * bn]  # noqa: E731
    else:  # a program: key rows [kv_lo, kv_lo + 2 BN), query tiles of BM
        bm, bn = module.LAUNCH_TILES["attn_bwd"][:2]
        bk = 2 * bn
        q_range, q_block, q_rotation = (_in_python(f) for f in (module._q_range, module._q_block, module._q_rotation))
        outer, inner = (bk, Lkv), (bm, Lq)
        keep = keep.T

        def ranges(kv_lo):
            full_lo, full_hi, hi, n_hi, n_masked, n = q_range(C(0), C(h), C(kv_off + kv_lo if offsets else kv_lo), bk, C(Lq),
                                                              C(Lkv), bm, *([C(q_off), C(kv_off)] if offsets else []))
            return hi, full_lo, full_hi, n_hi, n_masked, n

        def order(it, hi, full_lo, full_hi, n_hi, n_masked, kv_lo):
            rot = q_rotation(C(kv_off - q_off + kv_lo) if offsets else C(kv_lo), full_lo, bm)
            return q_block(C(it), full_lo, full_hi, hi, n_hi, n_masked, rot)
        tile_keep = lambda o, i: keep[o * bk:(o + 1) * bk, i * bm:(i + 1) * bm]  # noqa: E731
    n_inner = -(-inner[1] // inner[0])
    for o in range(-(-outer[1] // outer[0])):
        start = o * outer[0]
        hi, full_lo, full_hi, n_hi, n_masked, n = ranges(start)
        visits = [int(order(it, hi, full_lo, full_hi, n_hi, n_masked, start)) for it in range(n)]
        masked = set(visits[:max(int(n_masked), 1 if kind == "fwd" else 0)])
        assert len(set(visits)) == len(visits) and all(0 <= t < max(n_inner, 1) for t in visits), (what, o, visits)
        for t in range(n_inner):
            kept = tile_keep(o, t)
            if kept.any():
                assert t in visits, f"{what}: tile {o} never visits tile {t}, which holds kept scores ({visits})"
            if t in visits and t not in masked:  # runs without the mask code: every score kept, none past an end
                rows = outer[0] if kind == "bwd" else kept.shape[0]  # a ragged K/V tile masks every step
                whole = kept.shape == (rows, inner[0]) and bool(kept.all())
                assert whole, (f"{what}: tile {o} runs tile {t} without the mask, which drops scores or ends "
                               f"({visits}, {n_masked})")


def test_gluon_forward_compares_bands_relative_to_the_thread():
    """plan.lane_compares: two warp groups (head dim 128) compare a band's masked steps relative to
    the thread's first key and a causal mask's as kv_idx; the backward never takes lane compares."""
    def build(name, kernel="fwd"):
        variant = _variant(name)
        return plan.build(kernel, variant.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon"),
                          variant.captures)
    band, causal = build("sliding_window"), build("causal")
    assert band.band and band.lane_compares and not causal.lane_compares
    assert not build("sliding_window", "bwd").lane_compares
    assert "relative to the thread's first key" in codegen.render(band)
    assert "relative to the thread's first key" not in codegen.render(causal)


@pytest.mark.parametrize("pack", [1, 4])
def test_gluon_forward_tile_order_takes_every_tile_once(pack, tmp_path):
    """The forward's program tiles (_tile) in sections of (batch, head) pairs: every (b, h, Q tile)
    once for any section size (the last section short), Q tile major inside a section from the
    last tile, head after head for sections of 1; with GQA's query heads packed into the tiles
    (plan.pack_gqa) the pairs are (batch, K/V head) and h the pack's first query head. And the
    launcher's section sizes (_section) from the L2 size and the K/V bytes a pair reads."""
    from types import SimpleNamespace
    variant = _variant("causal", H=2 * pack)
    built = plan.build("fwd", variant.analysis, Spec("bfloat16", 64, 64, pack, "cuda-sm90", tier="gluon"), variant.captures)
    assert built.pack_gqa == pack
    narrow = plan.build("fwd", variant.analysis, Spec("bfloat16", 128, 128, pack, "cuda-sm90", tier="gluon"),
                        variant.captures)
    assert narrow.pack_gqa == 1 and built.lane_compares and not narrow.lane_compares  # two warp groups: slower so
    source = codegen.render(built)
    path = tmp_path / "fwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    tile = _in_python(module._tile)
    C = _CInt
    bq = module.WGS * module.LAUNCH_TILES["attn_fwd"][0] // pack  # query positions a tile spans
    for B, H, n_m in [(1, pack, 1), (2, 3 * pack, 5), (4, 16, 32), (1, 16, 3)]:
        pairs = B * H // pack
        for section in sorted({1, 2, 3, 4, 16, pairs, pairs + 5}):
            p = SimpleNamespace(section=C(section), n_m=C(n_m), n_tiles=C(n_m * pairs), H=C(H), WGS=module.WGS,
                                BLOCK_M=module.LAUNCH_TILES["attn_fwd"][0], N_CTX_KV=C(n_m * bq), BLOCK_N=128,
                                PACK=pack)
            got = [tuple(int(x) for x in tile(p, C(t))[:3]) for t in range(n_m * pairs)]
            want = {(b, h, m * bq) for b in range(B) for h in range(0, H, pack) for m in range(n_m)}
            assert len(got) == len(want) and set(got) == want, (B, H, n_m, section)
            for t, (b, h, m0) in enumerate(got):
                sec, r = divmod(t, section * n_m)
                size = min(pairs - sec * section, section)
                assert (b * H + h) // pack == sec * section + r % size, (B, H, n_m, section, t)
                assert m0 == (n_m - 1 - r // size) * bq, (B, H, n_m, section, t)  # the longest (last) tiles first
    if pack > 1:
        return
    module._PROPS[0] = SimpleNamespace(L2_cache_size=50 * 2 ** 20)  # an H100's L2, as torch would report it
    cuda0 = torch.device("cuda", 0)
    assert module._section(cuda0, 2 * 4096 * 128 * 2) == 6  # 4k keys at head dim 128: 2 MiB a head
    assert module._section(cuda0, 2 * 16384 * 128 * 2) == 1  # 16k: 8 MiB, head after head
    assert module._section(cuda0, 2 * 1024 * 64 * 2) == 16  # at most 16 pairs
    assert module._section(cuda0, 2 * 16384 * 128 * 2 // 4) == 6  # GQA 4:1: a query head's share of K and V


# The forward's tile handoff (DYNAMIC: a program per SM draws its tiles from a global counter, its
# producer hands each to the consumers through a two-slot ring guarded by mbarriers), as rendered:
# _draw_tile, _give_tile and _take_tile run in Python with barriers that keep phases (a wait yields
# until its phase completes), the producer and consumers of several programs interleaved at random.
class _Barrier:
    def __init__(self, count):
        self.count, self.pending, self.completed, self.tx = count, 0, 0, 0


def _wait(bar, parity):
    """mbarrier.wait as a generator: yields while the phase of that parity has not completed."""
    while bar.completed % 2 == parity:
        yield


def _arrive(bar, count=1):
    bar.pending += count
    _complete(bar)


def _expect(bar, nbytes):
    """mbarrier.expect: an arrival (arrive.expect_tx) whose phase also waits for nbytes of copies."""
    bar.tx += nbytes
    _arrive(bar)


def _land(bar, nbytes):
    """A TMA copy of nbytes, landed: its barrier's transaction count falls."""
    bar.tx -= nbytes
    _complete(bar)


def _complete(bar):
    """A phase completes once every arrival is in and every expected byte landed."""
    if bar.pending == bar.count and bar.tx == 0:
        bar.completed, bar.pending = bar.completed + 1, 0


def _interleave(tasks, engine, rng):
    """Resume a random unfinished warp (generator) or the copy engine until every warp is done; a
    deadlock (every warp waiting for good) fails."""
    for _ in range(5_000_000):
        if not tasks:
            break
        task = rng.choice(tasks + [engine])
        try:
            next(task)
        except StopIteration:
            tasks.remove(task)
    assert not tasks, f"deadlock: {len(tasks)} warps left"


class _Ring:
    def __init__(self, items):
        self.items = items

    def index(self, i):
        return self.items[int(i)]


class _Slot:
    def store(self, value):
        self.value = list(value)

    def load(self, layout):
        return self.value


def _handoff_functions(module, programs, counter):
    """_draw_tile, _give_tile, _take_tile of the rendered module, waits turned into yields."""
    import types

    def atomic_add(ptr, value, sem=None):
        counter[0] += value
        return counter[0] - value

    gl = types.SimpleNamespace(num_programs=lambda axis: programs, atomic_add=atomic_add, full=lambda shape, v, *a: [v],
                               int32=None, BlockedLayout=lambda *a: None, max=lambda x, axis: x[0])
    env = {"gl": gl, "mbarrier": types.SimpleNamespace(wait=_wait, arrive=_arrive), "_wait": _wait, "Pipeline": object}
    fns = {}
    for name in ("_draw_tile", "_give_tile", "_take_tile"):
        src = inspect.getsource(getattr(module, name).fn)
        src = src[src.index("def "):].replace("mbarrier.wait(", "yield from _wait(")
        exec(compile(src, module.__file__, "exec"), env)
        fns[name] = env[name]
    return fns["_draw_tile"], fns["_give_tile"], fns["_take_tile"]


@pytest.mark.parametrize("dynamic", [True, False])
def test_gluon_forward_tile_handoff(dynamic, tmp_path):
    """Every tile runs once, on the program whose producer drew it, whose consumers take exactly
    the producer's tiles in its order and stop with it, under random interleavings."""
    import random
    from types import SimpleNamespace
    variant = _variant("causal")
    for d in (128, 64):
        source = codegen.render(plan.build("fwd", variant.analysis, Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon"),
                                           variant.captures))
        path = tmp_path / f"fwd{d}.py"
        path.write_text(source)
        module = runtime.load(path, True, source)
        for programs, n_tiles, seed in [(3, 17, 0), (4, 4, 1), (5, 2, 2), (2, 40, 3)]:
            counter = [0]
            draw, give, take = _handoff_functions(module, programs, counter)
            rng = random.Random(seed)
            drawn, taken, tasks = {}, {}, []
            for pid in range(programs):
                p = SimpleNamespace(DYNAMIC=dynamic, tile_ctr=None, tile_smem=_Ring([_Slot(), _Slot()]),
                                    tile_ready=_Ring([_Barrier(1), _Barrier(1)]),
                                    tile_empty=_Ring([_Barrier(module.WGS), _Barrier(module.WGS)]))

                def producer(p=p, pid=pid):
                    i, t = 0, pid
                    while t < n_tiles:
                        yield from give(p, i, t)
                        drawn.setdefault(pid, []).append(t)
                        yield  # the tile's loads
                        i, t = i + 1, draw(p, t)
                    yield from give(p, i, t)

                def consumer(w, p=p, pid=pid):
                    i = 0
                    t = yield from take(p, i, pid)
                    while t < n_tiles:
                        taken.setdefault((pid, w), []).append(t)
                        yield  # the tile's steps
                        i += 1
                        t = yield from take(p, i, t + programs)

                tasks += [producer()] + [consumer(w) for w in range(module.WGS)]
            for _ in range(100000):  # resume a random unfinished task until all are done
                if not tasks:
                    break
                task = rng.choice(tasks)
                try:
                    next(task)
                except StopIteration:
                    tasks.remove(task)
            assert not tasks, f"deadlock: {len(tasks)} tasks left ({programs} programs, {n_tiles} tiles)"
            assert sorted(t for ts in drawn.values() for t in ts) == list(range(n_tiles))
            for (pid, w), ts in taken.items():
                assert ts == drawn[pid], (pid, w, ts, drawn[pid])
            assert all((pid, w) in taken for pid in drawn for w in range(module.WGS))

# The Gluon forward's softmax step, as rendered (the mods in Gluon's language, the mask's compares,
# the scale folding, the online softmax), run on CPU tensors with torch standing in for gl, over the
# key tiles in the kernel's order with its masked / unmasked choice per tile (only the products and
# the O update are the test's own): against a float64 reference at the call's positions.
class _Ptr:
    """A captured tensor's pointer plus an offset, for the mods' gl.load."""

    def __init__(self, flat, offset=0):
        self.flat, self.offset = flat, offset

    def __add__(self, offset):
        return _Ptr(self.flat, self.offset + offset)

    __radd__ = __add__


def _load(ptr, mask=None, other=0):
    off = torch.as_tensor(ptr.offset)
    inside = torch.ones_like(off, dtype=torch.bool) if mask is None else torch.as_tensor(mask)
    vals = ptr.flat[off.clamp(0, ptr.flat.numel() - 1)]
    return torch.where(inside, vals, torch.as_tensor(other, dtype=vals.dtype))


class _GlTorch:
    float32, int32, int64, bfloat16, float16 = torch.float32, torch.int32, torch.int64, torch.bfloat16, torch.float16
    arange = staticmethod(lambda a, b, layout=None: torch.arange(a, b))
    expand_dims = staticmethod(lambda x, axis: x.unsqueeze(axis))
    SliceLayout = staticmethod(lambda *a, **k: None)
    where = staticmethod(lambda c, x, y: torch.where(torch.as_tensor(c), torch.as_tensor(x), torch.as_tensor(y)))
    maximum = staticmethod(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b)))
    minimum = staticmethod(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b)))
    max = staticmethod(lambda x, axis: x.amax(dim=axis))
    sum = staticmethod(lambda x, axis: x.sum(dim=axis))
    fma = staticmethod(lambda a, b, c: a * b + c)
    reshape = staticmethod(lambda x, shape: x.reshape(shape))
    static_range = staticmethod(range)
    convert_layout = staticmethod(lambda x, layout: x)
    load = staticmethod(_load)

    def __getattr__(self, name):  # gl.exp2, gl.sin, gl.zeros_like, ...: torch's function of that name
        return getattr(torch, name)


def _softmax_step_in_torch(module):
    """The rendered _softmax_step (and the row max it may call) as plain functions over torch tensors."""
    env = {"gl": _GlTorch(), "_tanh": torch.tanh, "_sigmoid": torch.sigmoid, "Pipeline": object,
           "_floor_div": lambda a, b: torch.div(a, b, rounding_mode="floor"),
           "_floor_mod": torch.remainder}
    if hasattr(module, "_row_max"):  # plan.row_max_tree
        env["_halvings"] = module._halvings.fn
    for name in ("_row_max", "_softmax_step"):
        if hasattr(module, name):
            src = inspect.getsource(getattr(module, name).fn)
            src = src[src.index("def "):].replace("qk.type.layout", "None").replace("m_i.type.layout", "None")
            exec(compile(src, module.__file__, "exec"), env)
    return env["_softmax_step"]


SOFTMAX_CASES = [("causal", 128, False), ("sliding_window", 128, True), ("prefix_lm", 64, True), ("alibi", 128, True),
                 ("softcap", 128, False), ("rel_bias", 128, True), ("full", 64, True), ("trig", 128, False)]


def _step_ids(cases):
    return [f"{n}-d{d}-{'cp' if o else 'single'}" for n, d, o in cases]


def _cap_args(caps, dcaps=None):
    """A mod's arguments for each captured tensor: pointer, (size, stride) per dim, and with dcaps
    (learnable) the gradient's pointer and strides."""
    return [a for i, c in enumerate(caps) for a in [_Ptr(c.detach().reshape(-1).float())]
            + [x for d in range(c.dim()) for x in (c.shape[d], c.stride(d))]
            + ([_Ptr(dcaps[i])] + list(c.stride()) if dcaps else [])]


@pytest.mark.parametrize("name,d,offsets", SOFTMAX_CASES, ids=_step_ids(SOFTMAX_CASES))
def test_gluon_forward_softmax_step_matches_reference(name, d, offsets, tmp_path):
    from types import SimpleNamespace
    variant = _variant(name, H=2)
    spec = Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon", offsets=offsets)
    built = plan.build("fwd", variant.analysis, spec, variant.captures)
    source = codegen.render(built)
    path = tmp_path / "fwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    step, block_range, block = _softmax_step_in_torch(module), _in_python(module._block_range), _in_python(module._block)
    bm, bn = module.LAUNCH_TILES["attn_fwd"][:2]
    bq, scale, h = module.WGS * bm, 0.125, 1
    g = torch.Generator().manual_seed(3)
    calls = [(200, 333, 300, 260), (200, 333, 700, 260)] if offsets else [(300, 420, 0, 0), (17, 1, 0, 0)]
    for Lq, Lkv, q_off, kv_off in calls:  # chunks whose positions overlap, and (windows) chunks the mask empties
        q, k, v = (torch.randn(n, d, generator=g) for n in (Lq, Lkv, Lkv))
        caps = [c.tensor for c in variant.captures]
        cap_args = _cap_args(caps)
        p = SimpleNamespace(BLOCK_N=bn, sm_scale=scale, N_CTX_KV=Lkv, KV_OFF=kv_off)
        b_t, h_t = torch.tensor(0), torch.tensor(h)
        out = torch.zeros(Lq, d, dtype=torch.float64)
        for m0 in range(0, Lq, bq):
            q_idx = (m0 + torch.arange(bq))[:, None] + q_off
            hoisted = [eval(text, {"gl": _GlTorch()}, dict(b=b_t, h=h_t, q_idx=q_idx, **dict(zip(
                [a for c in built.captures for a in ", ".join(c.args).split(", ")], cap_args))))
                for _, text in built.mods["attn_fwd"].hoisted]
            C = _CInt
            hi, full_lo, full_hi, n_hi, n_masked, n = block_range(C(0), C(h), C(q_off + m0), bq, C(Lkv), bn,
                                                                   *([C(kv_off)] if offsets else []))
            q_tile = torch.zeros(bq, d)
            q_tile[:min(bq, Lq - m0)] = q[m0:m0 + bq]
            m_i, l_i, o = torch.full((bq,), -float("inf")), torch.zeros(bq), torch.zeros(bq, d)
            for it in range(int(n)):
                kb = int(block(C(it), hi, full_lo, full_hi, n_hi, n_masked))
                k_tile, v_tile = torch.zeros(bn, d), torch.zeros(bn, d)  # TMA zero-fills past the end
                k_tile[:max(0, min(bn, Lkv - kb * bn))] = k[kb * bn:(kb + 1) * bn]
                v_tile[:max(0, min(bn, Lkv - kb * bn))] = v[kb * bn:(kb + 1) * bn]
                probs, m_i, l_i, alpha = step(p, q_tile @ k_tile.T, m_i, l_i, torch.tensor(kb), b_t, h_t, q_idx, *hoisted,
                                              *cap_args, it == 0 or it < n_masked)
                o = o * alpha[:, None] + probs @ v_tile
            rows = min(bq, Lq - m0)
            out[m0:m0 + rows] = torch.where(l_i[:rows, None] == 0, 0.0, o[:rows] / l_i[:rows, None]).double()
        qp, kp = torch.arange(Lq)[:, None] + q_off, torch.arange(Lkv)[None, :] + kv_off
        s = (q.double() @ k.double().T) * scale
        if variant.score_mod is not None:
            s = variant.score_mod(s, b_t, h_t, qp, kp).double()
        if variant.mask_mod is not None:
            s = s.masked_fill(~variant.mask_mod(b_t, h_t, qp, kp).expand(Lq, Lkv), -float("inf"))
        ref = torch.nan_to_num(torch.softmax(s, dim=1), nan=0.0) @ v.double()
        assert torch.isfinite(out).all()
        err = ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err < 1e-5, (name, d, Lq, Lkv, q_off, kv_off, err)


def _sparse_masks(L):
    """Masks that read captured tensors (block-sparse: the kernels' loops run from tile lists):
    causal documents of 600 positions and more, and blocks of 64 kept at random per head (some
    query rows keep no key)."""
    g = torch.Generator().manual_seed(5)
    docs = (torch.arange(L) >= 600).int() + (torch.arange(L) >= 900).int()
    table = torch.rand(2, L // 64 + 1, L // 64 + 1, generator=g) < 0.6
    table[:, 3] = False  # queries [192, 256) keep nothing
    return {"document_causal": lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k),
            "block_table": lambda b, h, q, k: table[h, q // 64, k // 64]}


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_gluon_tile_lists_visit_every_kept_score(kind, tmp_path):
    """Both kernels' schedules from tile lists, as rendered (_tile / _block, _program / _q_block), per
    (batch, head) of a mask that differs by both, against brute force over the mask: every tile with a kept
    score is visited once, none past the ends, and a tile runs without the mask code only where the
    mask keeps every score of it."""
    from types import SimpleNamespace
    from attncc import blocks
    table = torch.rand(2, 1000 // 64 + 1, 1000 // 64 + 1, generator=torch.Generator().manual_seed(6)) < 0.6

    def mask_mod(b, h, q, k):  # blocks of 64 kept at random, per batch and head
        return table[(b + h) % 2, q // 64, k // 64]
    variant = attncc.Variant(None, mask_mod)
    source = codegen.render(plan.build(kind, variant.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon"),
                                       variant.captures))
    path = tmp_path / f"{kind}.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    assert module.BLOCK_SPARSE and module.CLASS_PER_HEAD
    fn = "attn_fwd" if kind == "fwd" else "attn_bwd"
    outer, inner = module.TILES[fn]
    C, B, H, F = _CInt, 2, 2, blocks.FINE
    for Lq, Lkv in [(1000, 900), (300, 700)]:
        q, k = torch.arange(Lq)[:, None], torch.arange(Lkv)[None, :]
        keeps = [mask_mod(torch.tensor(bh // H), torch.tensor(bh % H), q, k).expand(Lq, Lkv) for bh in range(B * H)]
        # the class table by brute force (block_classes' rule: 0 nothing kept, 2 every score kept and in bounds)
        nq, nk = -(-Lq // F), -(-Lkv // F)
        fine = torch.zeros(B * H, nq, nk, dtype=torch.int8)
        for bh in range(B * H):
            kept = torch.zeros(nq * F, nk * F, dtype=torch.int32)
            kept[:Lq, :Lkv] = keeps[bh].int()
            n = kept.view(nq, F, nk, F).sum(dim=(1, 3))
            fine[bh] = torch.where(n == 0, 0, torch.where(n == F * F, 2, 1)).to(torch.int8)
        lists = blocks.tile_lists(fine, outer, inner, fn in blocks.KEYS_OUTER)
        p = SimpleNamespace(H=C(H), N_CTX_Q=C(Lq), N_CTX_KV=C(Lkv), CLS_OUTER=C(lists[4]), CLS_INNER=C(lists[5]),
                            cls_partial_cnt=_Ptr(lists[0].reshape(-1)), cls_partial_idx=_Ptr(lists[1].reshape(-1)),
                            cls_full_cnt=_Ptr(lists[2].reshape(-1)), cls_full_idx=_Ptr(lists[3].reshape(-1)))
        n_outer = -(-(Lq if kind == "fwd" else Lkv) // outer)
        if kind == "fwd":
            vars(p).update(section=C(1), n_m=C(n_outer), n_tiles=C(n_outer * B * H), WGS=module.WGS, PACK=1,
                           BLOCK_M=outer // module.WGS, cls_order=_Ptr(blocks.longest_first(lists)))
            schedules = [_in_python(module._tile)(p, C(t)) for t in range(n_outer * B * H)]
            block = _in_python(module._block)
        else:
            vars(p).update(PAIRS=C(B * H), HEADS=1, CHUNK=C(3), BLOCK_N=outer // 2)
            schedules = []
            for pid in range(n_outer * B * H):
                _Gl.pid = pid
                schedules.append(_in_python(module._program)(p))
            block = _in_python(module._q_block)
        seen = set()
        for b, h, lo, partial, full, n_masked, n in schedules:
            b, h, lo = int(b), int(h), int(lo)
            seen.add((b, h, lo))
            visits = [int(block(C(it), partial, full, n_masked)) for it in range(int(n))]
            keep = (keeps[b * H + h] if kind == "fwd" else keeps[b * H + h].T)[lo:lo + outer]  # this program's rows
            n_inner = -(-keep.shape[1] // inner)
            assert len(set(visits)) == len(visits) and all(0 <= t < max(n_inner, 1) for t in visits), visits
            for t in range(n_inner):
                kept = keep[:, t * inner:(t + 1) * inner]
                assert not kept.any() or t in visits, f"{kind} h={h} tile {lo}: never visits tile {t}"
                if t in visits[int(n_masked):]:  # without the mask code: every score kept, none past an end
                    assert kept.shape == (outer, inner) and bool(kept.all()), f"{kind} h={h} tile {lo}: {t} unmasked"
        assert len(seen) == n_outer * B * H  # every (batch, head, tile) once


@pytest.mark.parametrize("rows", [1, 6])
def test_tile_lists_order_longest_first(rows):
    """attncc.blocks.longest_first: every outer tile once (with a row per (batch, head): row * n_outer
    + tile), by the number of inner tiles its lists hold, non-increasing, in index order among
    equals; module_lists gives it to the kernels a module names in LONGEST_FIRST (the Gluon forward)."""
    from types import SimpleNamespace
    from attncc import blocks
    n_outer = 8
    p_cnt, f_cnt = (torch.randint(0, 4, (rows, n_outer), generator=torch.Generator().manual_seed(7),
                                  dtype=torch.int32) for _ in range(2))
    order = blocks.longest_first((p_cnt, None, f_cnt, None, n_outer, 40))
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(rows * n_outer))
    work = (p_cnt + f_cnt).reshape(-1)[order.long()]  # inner tiles of each outer tile in turn
    ties = work[:-1] == work[1:]
    assert bool((work[:-1] >= work[1:]).all()) and bool(ties.any()), work
    assert bool((order[:-1][ties] < order[1:][ties]).all())  # equals in index order
    fine = torch.randint(0, 3, (rows, 10, 12), generator=torch.Generator().manual_seed(8), dtype=torch.int8)
    module = SimpleNamespace(TILES={"attn_fwd": (128, 64), "other": (64, 64)}, LONGEST_FIRST=("attn_fwd", ))
    cache = {}
    got = blocks.module_lists(module, fine, cache)
    assert sorted(got) == ["attn_fwd", "attn_fwd:order", "other"]
    assert torch.equal(got["attn_fwd:order"], blocks.longest_first(blocks.tile_lists(fine, 128, 64, False)))
    again = blocks.module_lists(module, fine, cache)
    assert all(again[name] is got[name] for name in got)  # kept with the table


@pytest.mark.parametrize("name,d", [("document_causal", 128), ("document_causal", 64), ("block_table", 128)])
def test_gluon_forward_tile_lists_match_reference(name, d, tmp_path):
    """A data-dependent mask in the Gluon forward: each Q tile's key tiles from the tile lists the
    Triton tier's block_classes kernel makes (run here by the interpreter), read by the rendered
    _tile and _block; partial tiles with the mask code (captured-tensor loads), full ones without,
    a Q tile that keeps nothing visits tile 0 masked; against the float64 reference."""
    from types import SimpleNamespace
    from attncc import blocks
    L, H = 1000, 2
    mask_mod = _sparse_masks(L)[name]
    variant = attncc.Variant(None, mask_mod)
    spec = Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon")
    built = plan.build("fwd", variant.analysis, spec, variant.captures)
    assert built.block_sparse and built.class_per_head == (name == "block_table")
    source = codegen.render(built)
    path = tmp_path / "fwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    assert module.BLOCK_SPARSE and module.WGS == 2  # three warp groups spill with the mask's loads
    classifier = attncc.compile(variant).classifier(Spec("bfloat16", d, d, 1, "interpreter"))
    step, tile, block = _softmax_step_in_torch(module), _in_python(module._tile), _in_python(module._block)
    bm, bn = module.LAUNCH_TILES["attn_fwd"][:2]
    bq, scale, C = module.WGS * bm, 0.125, _CInt
    g = torch.Generator().manual_seed(4)
    caps = [c.tensor for c in variant.captures]
    cap_args = _cap_args(caps)
    seen = set()  # what the tile lists held: partial and full tiles, Q tiles that keep no key
    for Lq, Lkv in [(1000, 1000), (300, 420), (1000, 17), (17, 1)]:
        fine = blocks.fine_classes(classifier, caps, 1, H, Lq, Lkv, module.CLASS_PER_HEAD, "cpu")
        p_cnt, p_idx, f_cnt, f_idx, n_outer, n_inner = blocks.tile_lists(fine, *module.TILES["attn_fwd"], False)
        n_m = -(-Lq // bq)
        order = blocks.longest_first((p_cnt, p_idx, f_cnt, f_idx, n_outer, n_inner))
        p = SimpleNamespace(section=C(1), n_m=C(n_m), n_tiles=C(n_m * H), H=C(H), WGS=module.WGS, BLOCK_M=bm, PACK=1,
                            cls_order=_Ptr(order), CLS_OUTER=C(n_outer), CLS_INNER=C(n_inner),
                            cls_partial_cnt=_Ptr(p_cnt.reshape(-1)),
                            cls_partial_idx=_Ptr(p_idx.reshape(-1)), cls_full_cnt=_Ptr(f_cnt.reshape(-1)),
                            cls_full_idx=_Ptr(f_idx.reshape(-1)), BLOCK_N=bn, sm_scale=scale, N_CTX_KV=Lkv)
        q, k, v = (torch.randn(H, n, d, generator=g) for n in (Lq, Lkv, Lkv))
        out = torch.zeros(H, Lq, d, dtype=torch.float64)
        for t in range(n_m * H):
            b, h, m0, partial, full, n_masked, n = (int(x) if isinstance(x, int) else x for x in tile(p, C(t)))
            b_t, h_t = torch.tensor(b), torch.tensor(h)
            q_idx = (m0 + torch.arange(bq))[:, None]
            hoisted = [eval(text, {"gl": _GlTorch()}, dict(b=b_t, h=h_t, q_idx=q_idx, **dict(zip(
                [a for c in built.captures for a in ", ".join(c.args).split(", ")], cap_args))))
                for _, text in built.mods["attn_fwd"].hoisted]
            q_tile = torch.zeros(bq, d)
            q_tile[:min(bq, Lq - m0)] = q[h, m0:m0 + bq]
            m_i, l_i, o = torch.full((bq,), -float("inf")), torch.zeros(bq), torch.zeros(bq, d)
            visits = [int(block(C(it), partial, full, C(n_masked))) for it in range(n)]
            row = (h if module.CLASS_PER_HEAD else 0, m0 // bq)
            listed = int(p_cnt.view(-1, n_outer)[row] + f_cnt.view(-1, n_outer)[row])
            seen |= {"partial"} if listed and n_masked else {"empty"} if not listed else set()
            seen |= {"full"} if n > n_masked else set()
            assert len(set(visits)) == n >= 1 and all(0 <= kb < max(1, -(-Lkv // bn)) for kb in visits), visits
            for it, kb in enumerate(visits):
                k_tile, v_tile = torch.zeros(bn, d), torch.zeros(bn, d)  # TMA zero-fills past the end
                k_tile[:max(0, min(bn, Lkv - kb * bn))] = k[h, kb * bn:(kb + 1) * bn]
                v_tile[:max(0, min(bn, Lkv - kb * bn))] = v[h, kb * bn:(kb + 1) * bn]
                probs, m_i, l_i, alpha = step(p, q_tile @ k_tile.T, m_i, l_i, torch.tensor(kb), b_t, h_t, q_idx,
                                              *hoisted, *cap_args, it == 0 or it < n_masked)
                o = o * alpha[:, None] + probs @ v_tile
            rows = min(bq, Lq - m0)
            out[h, m0:m0 + rows] = torch.where(l_i[:rows, None] == 0, 0.0, o[:rows] / l_i[:rows, None]).double()
        qp, kp = torch.arange(Lq)[:, None], torch.arange(Lkv)[None, :]
        for h in range(H):
            s = (q[h].double() @ k[h].double().T) * scale
            s = s.masked_fill(~mask_mod(0, torch.tensor(h), qp, kp).expand(Lq, Lkv), -float("inf"))
            ref = torch.nan_to_num(torch.softmax(s, dim=1), nan=0.0) @ v[h].double()
            assert torch.isfinite(out[h]).all()
            err = ((out[h] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            assert err < 1e-5, (name, d, Lq, Lkv, h, err)
    assert seen == {"partial", "full", "empty"}, seen


def test_gluon_forward_row_max_tree_is_the_row_max(tmp_path):
    """The forward's row max as a tree (plan.row_max_tree), as rendered, over every column of tiles of
    each width the kernels use: the softmax step cannot show a wrong max (the online softmax cancels
    any per-row shift that does not overflow)."""
    variant = _variant("causal", H=2)
    built = plan.build("fwd", variant.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon"), variant.captures)
    assert built.row_max_tree
    source = codegen.render(built)
    path = tmp_path / "fwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    env = {"gl": _GlTorch(), "_halvings": module._halvings.fn}
    src = inspect.getsource(module._row_max.fn)
    exec(compile(src[src.index("def "):], module.__file__, "exec"), env)
    g = torch.Generator().manual_seed(5)
    for n in (8, 16, 64, 128, 256):
        x = torch.randn(64, n, generator=g)
        for row, col in ((0, 0), (1, n - 1), (2, n // 2), (3, n // 2 - 1)):  # the max at each end and the middle
            x[row, col] = 100.0
        assert torch.equal(env["_row_max"](x), x.amax(dim=1)), n


# The Gluon backward's step as rendered (S^T from -lse2, dP^T from -Delta, the masks, dscore, the dK,
# dV and dQ products, dQ's hand-over in the accumulator's order) on CPU tensors: shared memory as
# tensors, the asynchronous products computed at issue, barriers as no-ops. A step runs twice per
# warp group, so that dQ's product reads both warp groups' dS^T; the schedule, the preprocess (lse2,
# Delta) and the dQ adds are the test's, after the kernel's. Against float64 autograd.
class _Smem:
    def __init__(self, t):
        self.t = t

    @property
    def dtype(self):
        return self.t.dtype

    def _reinterpret(self, dtype, shape, layout):  # _diagonal_sums's padded view: rows of 64 at 65
        assert layout == ("padded", ((64, 1),), tuple(shape)) and list(shape) == [64, 64], layout
        return _PaddedRows(self.t.reshape(-1))

    def index(self, i):
        return _Smem(self.t[i])

    def slice(self, start, n, dim=0):
        return _Smem(self.t.narrow(dim, start, n))

    def permute(self, dims):
        return _Smem(self.t.permute(dims))

    def load(self, layout=None):
        return self.t.clone()

    def store(self, x):
        self.t.copy_(x)


class _PaddedRows:
    """A [64, 64] view with an element of padding after every row: (i, j) at 65 i + j."""

    def __init__(self, flat):
        self.flat = flat

    def store(self, x):
        self.flat[(torch.arange(64)[:, None] * 65 + torch.arange(64)[None, :]).reshape(-1)] = x.reshape(-1)


class _Padded:
    with_identity_for = staticmethod(lambda pairs, shape, order: ("padded", tuple(map(tuple, pairs)), tuple(shape)))


def _mma(a, b, acc, use_acc=True, is_async=True):
    a, b = (x.t if isinstance(x, _Smem) else x for x in (a, b))
    return (acc if use_acc else 0) + a.float() @ b.float()


def _atomic_add(ptr, value, mask=True, sem=None):
    off, value, mask = torch.broadcast_tensors(torch.as_tensor(ptr.offset), torch.as_tensor(value), torch.as_tensor(mask))
    ptr.flat.index_add_(0, off[mask].reshape(-1), value[mask].reshape(-1).to(ptr.flat.dtype))


class _GlBwd(_GlTorch):
    BlockedLayout = staticmethod(lambda *a, **k: None)
    atomic_add = staticmethod(_atomic_add)
    zeros = staticmethod(lambda shape, dtype, layout=None: torch.zeros(shape, dtype=dtype))
    convert_layout = staticmethod(lambda x, layout: x)
    reshape = staticmethod(lambda x, shape: x.reshape(shape))
    permute = staticmethod(lambda x, dims: x.permute(dims))
    split = staticmethod(lambda x: (x[..., 0], x[..., 1]))
    join = staticmethod(lambda a, b: torch.stack((a, b), dim=-1))
    PaddedSharedLayout = _Padded


def _bwd_step_in_torch(module):
    from types import SimpleNamespace
    src = inspect.getsource(module._step.fn)
    src = src[src.index("def "):]
    env = {"gl": _GlBwd(), "_tanh": torch.tanh, "_log2_approx": torch.log2, "_sigmoid": torch.sigmoid, "Pipeline": object,
           "mbarrier": SimpleNamespace(wait=lambda *a, **k: None, arrive=lambda *a, **k: None),
           "fence_async_shared": lambda: None, "warpgroup_mma": _mma,
           "_floor_div": lambda a, b: torch.div(a, b, rounding_mode="floor"), "_floor_mod": torch.remainder,
           "warpgroup_mma_wait": lambda num_outstanding, deps: deps[0] if len(deps) == 1 else tuple(deps)}
    exec(compile(src, module.__file__, "exec"), env)
    if hasattr(module, "_diagonal_sums"):  # its lane shuffle and register swaps as what they compute
        env.update(_reversed_columns=lambda x: x.flip(1), _cta_barrier=lambda: None)
        helper = inspect.getsource(module._diagonal_sums.fn)
        exec(compile(helper[helper.index("def "):], module.__file__, "exec"), env)
    return env["_step"]


def test_gluon_reversed_columns_in_torch(tmp_path):
    """_diagonal_sums's column reversal: the lane shuffle (lane 4 g + l <-> 4 g + 3 - l holds columns
    8 k + 2 l + j of the wgmma accumulator, so it swaps l -> 3 - l) and the register swaps of k and
    j give x[:, 63 - c]. (The shuffle's lanes are the GPU tests'; the steps above take the whole
    reversal as a flip.)"""
    variant = _variant("rel_bias", H=2)
    spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon", learnable=(0,))
    source = codegen.render(plan.build("bwd", variant.analysis, spec, variant.captures))
    path = tmp_path / "bwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)

    def lanes_swapped(asm, constraints, args, dtype, is_pure, pack):
        assert "shfl.sync.bfly.b32" in asm and ", 3," in asm
        c = torch.arange(64)
        return args[0][:, c // 8 * 8 + 2 * (3 - c // 2 % 4) + c % 2]

    gl = _GlBwd()
    gl.inline_asm_elementwise = lanes_swapped
    env = {"gl": gl}
    for name in ("_swap_last", "_reversed_columns"):
        src = inspect.getsource(getattr(module, name).fn)
        exec(compile(src[src.index("def "):], module.__file__, "exec"), env)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(env["_reversed_columns"](x), x.flip(1))


BWD_STEP_CASES = [("causal", 128, False), ("sliding_window", 64, True), ("prefix_lm", 128, True), ("alibi", 128, True),
                  ("softcap", 128, False), ("softcap", 64, True), ("full", 64, False), ("trig", 128, False),
                  ("alibi-split", 128, False), ("alibi-split", 64, True),  # the bias in S^T's start (plan.split_bias)
                  ("alibi-learn", 128, True), ("row_biases-learn", 64, False),  # capture gradients: per-step sums, atomics
                  ("rel_bias-learn", 128, True), ("rel_bias-learn", 64, False),  # per diagonal (_diagonal_sums)
                  ("alibi-gqa", 64, False), ("causal-gqa", 128, True),  # GQA 2: query heads in one program or one each
                  ("document_causal", 128, False), ("block_table", 64, False)]  # tile lists (data-dependent masks)


@pytest.mark.parametrize("name,d,offsets", BWD_STEP_CASES, ids=_step_ids(BWD_STEP_CASES))
def test_gluon_backward_step_matches_reference(name, d, offsets, tmp_path):
    from types import SimpleNamespace
    from unittest import mock
    from attncc import blocks
    name_and_flags = name
    name, learn, group = name.split("-")[0], name.endswith("-learn"), 2 if name.endswith("-gqa") else 1
    sparse = _sparse_masks(1000)
    variant = attncc.Variant(None, sparse[name]) if name in sparse else _variant(name, H=2)
    caps = [c.tensor for c in variant.captures]
    learnable = tuple(range(len(caps))) if learn else ()
    spec = Spec("bfloat16", d, d, group, "cuda-sm90", tier="gluon", offsets=offsets, learnable=learnable)
    with mock.patch.object(plan, "SPLIT_BIAS", name_and_flags.endswith("-split")):
        built = plan.build("bwd", variant.analysis, spec, variant.captures)
    assert built.split_bias == name_and_flags.endswith("-split")
    source = codegen.render(built)
    path = tmp_path / "bwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    step = _bwd_step_in_torch(module)
    q_block = _in_python(module._q_block)
    if not module.BLOCK_SPARSE:
        q_range, q_rotation = _in_python(module._q_range), _in_python(module._q_rotation)
    bm, bn, _, stages = module.LAUNCH_TILES["attn_bwd"]
    bk, dq_n, scale, C = 2 * bn, bm * d // 128, 0.125, _CInt
    Lq, Lkv, q_off, kv_off = (200, 333, 300, 260) if offsets else (300, 250, 0, 0)
    g = torch.Generator().manual_seed(4)
    q, do = (torch.randn(group, Lq, d, generator=g, dtype=torch.float64) for _ in range(2))  # query heads of K/V head 0
    k, v = (torch.randn(Lkv, d, generator=g, dtype=torch.float64) for _ in range(2))
    b_t = torch.tensor(0)
    qp, kp = torch.arange(Lq)[:, None] + q_off, torch.arange(Lkv)[None, :] + kv_off
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [c.requires_grad_() for c in caps if learn]
    lse, o = [], []
    for hq in range(group):
        h_t = torch.tensor(hq)
        s = (leaves[0][hq] @ leaves[1].T) * scale
        if variant.score_mod is not None:
            s = variant.score_mod(s, b_t, h_t, qp, kp)
        if variant.mask_mod is not None:
            s = s.masked_fill(~variant.mask_mod(b_t, h_t, qp, kp).expand(Lq, Lkv), -float("inf"))
        lse.append(torch.logsumexp(s, dim=1))
        o.append(torch.nan_to_num(torch.softmax(s, dim=1), nan=0.0) @ leaves[2])
    lse, o = torch.stack(lse), torch.stack(o)
    want = torch.autograd.grad(o, leaves, do)
    for c in caps:
        c.requires_grad_(False)
    assert all(w.norm() > 0 for w in want)  # the chunks' positions overlap: something to compare
    lse2 = torch.where(torch.isinf(lse), 0.0, lse * 1.4426950408889634).detach().float()  # attn_bwd_preprocess's
    delta = (do * o.detach()).sum(-1).float()
    dcaps = [torch.zeros(c.numel()) for c in caps]
    cap_args = _cap_args(caps, dcaps if learn else None)
    diag_buf = [_Smem(torch.zeros(2, 128, 64))] if "diag_buf" in source else []  # attn_bwd's, for _diagonal_sums
    lse_folds = "if p.FOLD_LSE:" in source
    p = SimpleNamespace(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, STAGES=stages, N_CTX_Q=Lq, N_CTX_KV=Lkv, Q_OFF=q_off,
                        KV_OFF=kv_off, sm_scale=scale, lse_to_acc=-1.0 / (scale * 1.4426950408889634), FOLD_LSE=lse_folds,
                        q_desc=SimpleNamespace(dtype=torch.float32), q_ready=_Smem(torch.zeros(stages)),
                        do_ready=_Smem(torch.zeros(stages)), ds_ready=_Smem(torch.zeros(2)), dq_bars=_Smem(torch.zeros(4)),
                        q_smem=_Smem(torch.zeros(stages, bm, d)), do_smem=_Smem(torch.zeros(stages, bm, d)),
                        lse_smem=_Smem(torch.zeros(stages, bm)), delta_smem=_Smem(torch.zeros(stages, bm)),
                        ds_smem=_Smem(torch.zeros(2, bk, bm)), dq_smem=_Smem(torch.zeros(2, dq_n // 4, 256)),
                        k_smem=_Smem(torch.zeros(1, bk, d)), v_smem=_Smem(torch.zeros(1, bk, d)))  # rings of one slot
    got = [torch.zeros(group, Lq, d), torch.zeros(Lkv, d), torch.zeros(Lkv, d)]
    heads = 1 if Lkv >= module.SPLIT_HEADS_FROM else group  # query heads per program, as the launcher
    if module.BLOCK_SPARSE:  # the K/V tiles' query-tile lists, from the Triton tier's block_classes (interpreted)
        assert name in sparse and heads == 1
        classifier = attncc.compile(variant).classifier(Spec("bfloat16", d, d, 1, "interpreter"))
        fine = blocks.fine_classes(classifier, caps, 1, 1, Lq, Lkv, module.CLASS_PER_HEAD, "cpu")
        p_cnt, p_idx, f_cnt, f_idx, n_outer, n_inner = blocks.tile_lists(fine, *module.TILES["attn_bwd"], True)
        assert int(f_cnt.sum()) and int(p_cnt.sum())  # both kinds of tiles to run
        program = _in_python(module._program)
        vars(p).update(H=C(1), PAIRS=C(1), HEADS=1, CHUNK=C(1), CLS_OUTER=C(n_outer), CLS_INNER=C(n_inner),
                       cls_partial_cnt=_Ptr(p_cnt.reshape(-1)), cls_partial_idx=_Ptr(p_idx.reshape(-1)),
                       cls_full_cnt=_Ptr(f_cnt.reshape(-1)), cls_full_idx=_Ptr(f_idx.reshape(-1)))
    for h0, kv_lo in ((h0, kv_lo) for h0 in range(0, group, heads) for kv_lo in range(0, Lkv, bk)):
        # a program: its K/V tile, its query heads' tiles in the kernel's order
        rows = min(bk, Lkv - kv_lo)
        p.k_smem.t.zero_()[0, :rows] = k[kv_lo:kv_lo + rows].float()
        p.v_smem.t.zero_()[0, :rows] = v[kv_lo:kv_lo + rows].float()
        if module.BLOCK_SPARSE:
            _Gl.pid = kv_lo // bk  # the program of this K/V tile
            _, _, lo, partial, full, n_masked, n = program(p)
            assert int(lo) == kv_lo

            def tile(i, partial=partial, full=full, n_masked=n_masked):
                return q_block(C(i), partial, full, n_masked)
        else:
            at = [C(q_off), C(kv_off)] if offsets else []
            full_lo, full_hi, hi, n_hi, n_masked, n = q_range(C(0), C(h0), C(kv_off + kv_lo if offsets else kv_lo), bk,
                                                              C(Lq), C(Lkv), bm, *at)
            rot = q_rotation(C(kv_off - q_off + kv_lo) if offsets else C(kv_lo), full_lo, bm)

            def tile(i, args=(full_lo, full_hi, hi, n_hi, n_masked, rot)):
                return q_block(C(i), *args)
        kv_idx = [(kv_lo + wg * bn + torch.arange(bn))[:, None] + (kv_off if offsets else 0) for wg in (0, 1)]
        acc = [[torch.zeros(bn, d), torch.zeros(bn, d)] for _ in (0, 1)]
        for j in range(int(n) * heads):
            m0, hq = int(tile(j // heads)) * bm, h0 + j % heads
            slot, qr = j % stages, min(bm, Lq - m0)
            for buf, src in ((p.q_smem, q), (p.do_smem, do), (p.lse_smem, lse2), (p.delta_smem, delta)):
                buf.t[slot].zero_()[:qr] = src[hq, m0:m0 + qr].float()  # TMA zero-fills; row statistics are 0 past the end
            before = [dc.clone() for dc in dcaps]
            for keep in (False, True):  # the first round writes both warp groups' dS^T
                for dc, b0 in zip(dcaps, before):  # and capture gradients, which only the second keeps
                    dc.copy_(b0)
                for wg in (0, 1):
                    dk, dv = step(p, wg, j, m0, b_t, torch.tensor(hq), acc[wg][0].clone(), acc[wg][1].clone(),
                                  kv_idx[wg], *[int(kv_idx[wg][0, 0])] * len(diag_buf), p.k_smem.index(0).slice(wg * bn, bn),
                                  p.v_smem.index(0).slice(wg * bn, bn), None, None, None, j < n_masked * heads,
                                  *cap_args, *diag_buf)  # kv0 and diag_buf: the diagonal sums'
                    if keep:
                        acc[wg] = [dk, dv]
                        part = p.dq_smem.t[wg].reshape(dq_n // 8, 4, 8, 4, 2, 2).permute(1, 4, 2, 0, 3, 5).reshape(64, dq_n)
                        if dq_n == d:  # query tiles of 128: each warp group has 64 of the rows
                            got[0][hq, m0 + 64 * wg:m0 + 64 * wg + 64][:max(0, qr - 64 * wg)] += part[:max(0, qr - 64 * wg)]
                        else:  # query tiles of 64: each warp group has half of the columns
                            got[0][hq, m0:m0 + qr, wg * dq_n:(wg + 1) * dq_n] += part[:qr]
        for wg in (0, 1):
            r0 = kv_lo + wg * bn
            r = max(0, min(bn, Lkv - r0))
            got[1][r0:r0 + r] += acc[wg][0][:r] * scale  # programs of one query head each: float32 sums
            got[2][r0:r0 + r] += acc[wg][1][:r]
    got += [dc.reshape(c.shape) for dc, c in zip(dcaps, caps) if learn]
    for what, a, b in zip(("dq", "dk", "dv", "dcap0", "dcap1"), got, want):
        assert torch.isfinite(a).all(), what
        err = ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert err < 1e-4, (name, d, offsets, what, err)


# The whole Gluon forward pipeline as rendered (producer warp, consumer warp groups, their rings,
# turns and tile handoff), run in Python: every mbarrier wait yields until its phase completes,
# the warps of one or more programs are interleaved at random, TMA copies land at once and tag
# the shared-memory slot they fill with the tile they copied, and wgmma is a check of those tags:
# each S must read the Q tile of its rows and the K tile of its key block, each P V the V tile of
# the probabilities' key block, when issued and when waited for (a slot refilled too early fails),
# and every output tile must carry each of its key blocks once. The arithmetic is not modelled
# (the step tests above and the GPU tests check it).
class _Val:
    """Any tensor value of the kernel: arithmetic keeps its tag (what data it came from)."""

    def __init__(self, tag=None):
        self.tag = tag

    def _op(self, *other):
        return _Val(self.tag)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _op
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __and__ = __rand__ = __or__ = __ror__ = _op
    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = __neg__ = __invert__ = _op
    __hash__ = object.__hash__

    def to(self, *a, **k):
        return _Val(self.tag)

    @property
    def type(self):
        from types import SimpleNamespace
        return SimpleNamespace(layout=None)


class _SmemSlot:
    """A shared-memory buffer: the tag of the tile a TMA copy last put there."""

    def __init__(self, name):
        self.name, self.tag = name, None

    def index(self, i):
        return self

    def permute(self, dims):
        return self

    def reshape(self, shape):
        return self

    def store(self, value):
        self.tag = value.tag


class _SmemRing(_Ring):
    def __init__(self, name, n):
        super().__init__([_SmemSlot(f"{name}{i}") for i in range(n)])


class _Desc:
    """A TMA descriptor: the tensor's name, for the tags of the tiles it copies."""

    def __init__(self, name, rows):
        from types import SimpleNamespace
        self.name, self.dtype = name, None
        self.block_type = SimpleNamespace(nbytes=1, shape=[1, 1, rows, 64])


def _pipeline_model(module, programs, rng, B, H, Lq, Lkv, group, dynamic, offsets=None):
    """Run the rendered producer and consumers of `programs` programs over a (B, H, Lq, Lkv) call
    at random interleavings; returns the output tiles stored (coordinates, the key blocks' V tiles
    their P V products read) and the number of tiles."""
    import re
    import types
    C = _CInt
    bm, bn, _, stages = module.LAUNCH_TILES["attn_fwd"]
    wgs, pack = module.WGS, module.PACK
    n_m = -(-Lq // (wgs * bm // pack))
    n_tiles = n_m * B * H // pack
    counter, stored, copies = [0], [], []

    def tma_load(desc, coords, bar, slot):
        copies.append((slot, (desc.name, tuple(int(c) for c in coords)), bar, desc.block_type.nbytes))  # lands later

    def tma_engine():  # lands the copies in flight, in any order; its barrier's phase may complete then
        while True:
            if copies:
                slot, tag, bar, nbytes = copies.pop(rng.randrange(len(copies)))
                slot.tag = tag
                _land(bar, nbytes)
            yield

    def mma(a, b, acc, use_acc=True, is_async=True):
        if isinstance(a, _SmemSlot):  # S = Q K^T: which slots it read, and what was there
            return _Val(("S", a, a.tag, b, b.tag))
        assert b.tag == a.tag, f"P V read {b.tag} from {b.name}, wanted {a.tag}"  # P's tag: its V tile
        return _Val(("PV", b, b.tag, acc.tag + [a.tag]))

    def mma_wait(num_outstanding, deps):
        for _ in range(rng.randrange(3)):  # the products run while other warps go on
            yield
        out = []
        for d in deps:
            if isinstance(d, _Val) and isinstance(d.tag, tuple) and d.tag[0] in ("S", "PV"):
                reads = [(d.tag[1], d.tag[2])] + ([(d.tag[3], d.tag[4])] if d.tag[0] == "S" else [])
                for slot, tag in reads:  # still there when the product completes
                    assert slot.tag == tag, f"{slot.name} refilled with {slot.tag} while a product read {tag}"
                if d.tag[0] == "PV":
                    d = _Val(d.tag[3])
            out.append(d)
        return out[0] if len(out) == 1 else tuple(out)

    def softmax_step(p, qk, m_i, l_i, kb, b, h, q_idx, *rest):
        _, _, q_tag, _, k_tag = qk.tag
        assert k_tag == ("k", (int(b), int(h) // group, int(kb) * bn, 0)), (k_tag, int(b), int(h), int(kb))
        assert q_tag[0] == "q" and q_tag[1][:2] == ((int(b), int(h)) if pack == 1 else (int(b), int(h) // pack)), q_tag
        return _Val(("v", (int(b), int(h) // group, int(kb) * bn, 0))), _Val(), _Val(), _Val()

    def tma_store(desc, coords, slot):
        stored.append((tuple(int(c) for c in coords), slot.tag))

    def atomic_add(ptr, value, sem=None):
        counter[0] += value
        return C(counter[0] - value)

    env = {"Pipeline": object, "_wait": _wait, "warpgroup_mma": mma, "warpgroup_mma_wait": mma_wait,
           "_softmax_step": softmax_step, "_round_pairs": lambda x: x, "_tma_load": tma_load,
           "_tma_store": tma_store, "_cta_barrier": lambda: None, "fence_async_shared": lambda: None,
           "tma": types.SimpleNamespace(store_wait=lambda pendings: None),
           "mbarrier": types.SimpleNamespace(wait=_wait, arrive=_arrive, expect=_expect)}
    gl = dict(constexpr=object, tensor=object, float32="f32", int32="i32", int64="i64",
              cdiv=_Gl.cdiv, maximum=_Gl.maximum, minimum=_Gl.minimum,
              where=lambda c, x, y: _Val() if isinstance(c, _Val) else (x if c else y),
              NVMMADistributedLayout=lambda **k: None, DotOperandLayout=lambda **k: None,
              SliceLayout=lambda *a: None, BlockedLayout=lambda *a: None, arange=lambda *a, **k: _Val(),
              zeros=lambda *a, **k: _Val([]), full=lambda shape, v, *a, **k: [v] if isinstance(v, int) else _Val(),
              expand_dims=lambda x, d: x, convert_layout=lambda x, layout: x, log2=lambda x: x,
              store=lambda *a, **k: None, static_range=range, num_programs=lambda axis: programs,
              atomic_add=atomic_add, max=lambda x, axis: x[0])
    waiting = ["consumer", "producer", "_kv_step", "_take_turn", "_take_tile", "_give_tile", "_load",
               "warpgroup_mma_wait"]
    plain = ["_tile", "_block_range", "_block", "_draw_tile", "_pass_turn", "_rows", "_epilogue",
             "_floor_div", "_floor_mod", "_floor_div_or_0", "_floor_mod_or_a"]
    sources = {}
    for name in plain + waiting:
        if name != "warpgroup_mma_wait" and hasattr(module, name):
            src = inspect.getsource(getattr(module, name).fn)
            src = src[src.index("def "):].replace("mbarrier.wait(", "yield from _wait(")
            if name in waiting:  # calls of functions that wait: delegate to them
                src = re.sub(r"(?<![\w.])(%s)\(" % "|".join(w for w in waiting if w != name), r"yield from \1(", src)
            sources[name] = compile(src, module.__file__, "exec")

    kernel = module.attn_fwd.fn  # a Launcher (attncc.launcher) holding the Gluon kernel
    kernel = inspect.getsource(getattr(kernel, "fn", kernel))  # the barriers' arrival counts, as the kernel sets them
    counts = {name: n for name, n in re.findall(r"mbarrier\.init\((\w+)\.index\(\w+\), count=(\w+)\)", kernel)}
    counts = {name: wgs if n == "WGS" else int(n) for name, n in counts.items()}
    tasks = []
    for pid in range(programs):
        penv = dict(env, gl=types.SimpleNamespace(**gl, program_id=lambda axis, pid=pid: C(pid)))
        for code in sources.values():
            exec(code, penv)
        rings = {n: _Ring([_Barrier(counts[n]) for _ in range(k)]) for n, k in [
            ("q_ready", wgs), ("q_empty", wgs), ("sched", wgs), ("k_ready", stages), ("k_empty", stages),
            ("v_ready", stages), ("v_empty", stages), ("tile_ready", 2), ("tile_empty", 2)]}
        p = types.SimpleNamespace(
            q_desc=_Desc("q", bm), k_desc=_Desc("k", bn), v_desc=_Desc("v", bn), o_desc=_Desc("o", bm), lse_ptr=_Val(),
            q_smem=_SmemRing(f"p{pid}.q", wgs), o_smem=_SmemRing(f"p{pid}.o", wgs), k_smem=_SmemRing(f"p{pid}.k", stages),
            v_smem=_SmemRing(f"p{pid}.v", stages), tile_ctr=None, tile_smem=_Ring([_Slot(), _Slot()]),
            H=C(H), N_CTX_Q=C(Lq), N_CTX_KV=C(Lkv), n_m=C(n_m), n_tiles=C(n_tiles), section=C(1), sm_scale=0.1,
            BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=64, STAGES=stages, GROUP=group, WGS=wgs, PACK=pack, DYNAMIC=dynamic,
            **rings, **({} if offsets is None else dict(Q_OFF=C(offsets[0]), KV_OFF=C(offsets[1]))))
        tasks += [penv["producer"](p)] + [penv["consumer"](p, w) for w in range(wgs)]
    _interleave(tasks, tma_engine(), rng)
    return stored, n_tiles


@pytest.mark.parametrize("name,d,group,offsets", [("causal", 128, 1, None), ("causal", 64, 1, None), ("full", 128, 1, None),
                                                  ("causal", 64, 4, None), ("prefix_lm", 128, 2, None),
                                                  ("causal", 128, 1, (640, 384)), ("sliding_window", 128, 2, (300, 0))])
def test_gluon_forward_pipeline(name, d, group, offsets, tmp_path):
    """The forward's producer and consumers as rendered, at random interleavings of one or more
    programs (drawn tiles and static ones): no deadlock, every S and P V reads the tiles it needs,
    still there when it completes, and each warp group's output carries every key block its tile
    visits once."""
    import random
    variant = _variant(name, H=2 * group)
    spec = Spec("bfloat16", d, d, group, "cuda-sm90", tier="gluon", offsets=offsets is not None)  # chunk positions
    source = codegen.render(plan.build("fwd", variant.analysis, spec, variant.captures))
    path = tmp_path / "fwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    C = _CInt
    tile, block = _in_python(module._tile), _in_python(module._block)
    bn = module.LAUNCH_TILES["attn_fwd"][1]
    for programs, dynamic, (B, H, Lq, Lkv), seed in [(3, True, (1, 2 * group, 700, 700), 0), (2, False, (2, 2 * group, 300, 450), 1),
                                                     (5, True, (1, 2 * group, 200, 1000), 2), (1, False, (1, 2 * group, 1, 1), 3)]:
        stored, n_tiles = _pipeline_model(module, programs, random.Random(seed), B, H, Lq, Lkv, group, dynamic, offsets)
        from types import SimpleNamespace
        p = SimpleNamespace(section=C(1), n_m=C(n_tiles // (B * H // module.PACK)), n_tiles=C(n_tiles), H=C(H),
                            WGS=module.WGS, BLOCK_M=module.LAUNCH_TILES["attn_fwd"][0], N_CTX_KV=C(Lkv), BLOCK_N=bn,
                            PACK=module.PACK, **({} if offsets is None else dict(Q_OFF=C(offsets[0]), KV_OFF=C(offsets[1]))))
        want = {}
        for t in range(n_tiles):
            b, h, m0, hi, full_lo, full_hi, n_hi, n_masked, n_blocks = tile(p, C(t))
            blocks = sorted(("v", (int(b), int(h) // group, int(block(C(it), hi, full_lo, full_hi, n_hi, n_masked)) * bn, 0))
                            for it in range(int(n_blocks)))
            for w in range(module.WGS):
                row0 = int(m0) + w * (p.BLOCK_M // module.PACK)
                key = (int(b), int(h) // module.PACK, row0, 0, 0) if module.PACK > 1 else (int(b), int(h), row0, 0)
                want[key] = blocks
        got = {}
        for coords, tag in stored:
            assert coords not in got, f"tile {coords} stored twice"
            got[coords] = sorted(tag)
        assert got == want, (programs, dynamic, B, H, Lq, Lkv)
