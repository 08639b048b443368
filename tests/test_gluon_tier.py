"""The Gluon tier on a machine without a GPU: where it is chosen and why, and that every rendered
Gluon kernel compiles for sm90 (Triton compiles Gluon down to ptxas without a device), so a
template error fails here and not at a user's first call; a few rendered kernels are kept whole
as snapshots (tests/snapshots/sm90/); and the kernels' integer tile schedules and their forward
and backward steps, as rendered, run in Python (torch in place of Gluon's operations) against
brute force and the float64 reference. Correctness on the GPU: tests/test_gpu_gluon.py."""
from __future__ import annotations

import difflib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attncc
from attncc import codegen, plan, runtime, tiers
from attncc.spec import Spec
from variants import BUILDERS, NAMES

GLUON_VARIANTS = [n for n in NAMES if n != "document"]


def _variant(name, H=4, L=1000):
    if name == "row_biases":  # learnable: gated biases per (head, query) and per key
        qb, kb = torch.randn(H, L), torch.randn(L)
        return attncc.Variant(lambda s, b, h, q, k: s + torch.tanh(s) * (qb[h, q] + kb[k]),
                              BUILDERS["causal"](2, H, L, L, "cpu")[1])
    if name == "trig":
        return attncc.Variant(lambda s, b, h, q, k: s + torch.sin(s) * torch.cos(0.5 * s)
                              + torch.sigmoid(s), BUILDERS["causal"](2, H, L, L, "cpu")[1])
    return attncc.Variant(*BUILDERS[name](2, H, L, L, "cpu"))


def test_tier_choice(monkeypatch):
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    causal = _variant("causal")
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False)[0] == "gluon"
    assert tiers.choose(causal, "cuda-sm90", "float16", 128, 128, False)[0] == "gluon"
    for args, why in [(("cuda-sm90", "bfloat16", 64, 64, False), "measured slower"),
                      (("cuda-sm90", "float32", 128, 128, False), "float16 and bfloat16"),
                      (("cuda-sm90", "bfloat16", 128, 128, True), "dropout"),
                      (("cuda-sm90", "bfloat16", 128, 64, False), "equal head dims"),
                      (("cuda-sm80", "bfloat16", 128, 128, False), "sm90"),
                      (("cuda-sm100", "bfloat16", 128, 128, False), "sm90"),
                      (("interpreter", "bfloat16", 128, 128, False), "sm90")]:
        tier, reason = tiers.choose(causal, *args)
        assert tier == "triton" and why in reason, (args, reason)
    tier, reason = tiers.choose(_variant("document"), "cuda-sm90", "bfloat16", 128, 128, False)
    assert tier == "triton" and "captured tensors" in reason
    tier, reason = tiers.choose(attncc.Variant(lambda s, b, h, q, k: s + torch.atan(s)), "cuda-sm90", "bfloat16",
                                128, 128, False)
    assert tier == "triton" and "atan" in reason
    rows = torch.randn(1000, 16)
    tier, reason = tiers.choose(attncc.Variant(lambda s, b, h, q, k: s + torch.dot(rows[q], rows[k])), "cuda-sm90",
                                "bfloat16", 128, 128, False)
    assert tier == "triton" and "tile product" in reason
    # head dim 64: three consumer warp groups (the identity score_mod, a mask that does not band
    # the keys), from 8192 queries and keys
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, length=8192)[0] == "gluon"
    long, short = (torch.zeros(1, 2, n, 64, dtype=torch.bfloat16) for n in (8192, 8191))
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, (long, long, long))[0] == "gluon"
    for tensors in [(long, short, short), (short, long, long)]:
        tier, reason = tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, tensors)
        assert tier == "triton" and "8191 queries or keys (< 8192)" in reason, reason
    for name in ("alibi", "sliding_window", "softcap"):
        tier, reason = tiers.choose(_variant(name), "cuda-sm90", "bfloat16", 64, 64, False, length=16384)
        assert tier == "triton" and "three consumer warp groups" in reason, (name, reason)
    q = torch.zeros(1, 2, 8, 256, dtype=torch.bfloat16)[..., ::2]  # head-dim stride 2: no TMA box
    tier, reason = tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False, (q, q, q))
    assert tier == "triton" and "TMA" in reason
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False)[0] == "gluon"
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 80, 80, False)[0] == "triton"
    monkeypatch.setenv("ATTNCC_TIER", "triton")
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False) == ("triton", "ATTNCC_TIER=triton")
    monkeypatch.setenv("ATTNCC_TIER", "fast")
    with pytest.raises(attncc.AttnccError, match="ATTNCC_TIER='fast' is not one of auto, triton, gluon"):
        tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False)


def test_interpreted_calls_keep_the_triton_tier(monkeypatch):
    """CPU tensors run the Triton tier's kernels whatever ATTNCC_TIER asks (Gluon has no interpreter)."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    q = torch.randn(1, 2, 17, 16)
    out = attncc.attention(q, q, q, mask_mod=BUILDERS["causal"](1, 2, 17, 17, "cpu")[1])
    ref = attncc.reference.attention(q.double(), q.double(), q.double(), None, BUILDERS["causal"](1, 2, 17, 17, "cpu")[1])
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert all(spec.tier == "triton" for (_, kind, spec) in attncc.api._loaded if kind == "fwd")


def test_explain_and_source_name_the_tier(monkeypatch):
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    kernel = attncc.compile(_variant("alibi"))
    text = kernel.explain()
    assert "sm90, bfloat16, head dim 128: gluon" in text and "head dim 64: triton (head dim 64: the Gluon" in text
    src = kernel.source("fwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    assert "Gluon tier (Hopper)" in src and "def producer(" in src and "def consumer(" in src
    assert "Gluon tier" not in kernel.source("fwd", dtype=torch.bfloat16, head_dim=64, target="cuda-sm90")
    # the Gluon backward runs from the K/V length where it measured faster (tiers.GLUON_BWD_PAYS);
    # source() shows what a call of unknown length runs
    assert ("backward, sm90, bfloat16, head dim 128: triton (head dim 128, an unknown number of keys (< 4096): "
            "the Gluon backward measured slower") in text
    assert "; from 4096 keys: gluon (sm90, bfloat16, head dim 128, 4096 keys: measured faster)" in text
    assert "head dim 64, an unknown number of keys (< 4096)" in text and "; from 4096 keys: gluon" in text
    assert "Gluon tier" not in kernel.source("bwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    softcap = attncc.compile(_variant("softcap"))
    assert "head dim 128: triton (head dim 128, an unknown" in softcap.explain()
    assert "; from 4096 keys: gluon" in softcap.explain()
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    bwd = kernel.source("bwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    assert "Gluon tier (Hopper)" in bwd and "def attn_bwd(" in bwd and "_tma_add(" in bwd
    assert "backward, sm90, bfloat16, head dim 128: gluon (ATTNCC_TIER=gluon)" in softcap.explain()


def test_backward_tier_choice_follows_the_measurements(monkeypatch):
    """Auto: the Gluon backward from 4096 keys at head dims 64 and 128 (GQA and any score_mod
    too); ATTNCC_TIER=gluon anywhere it fits."""
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    causal, softcap = _variant("causal"), _variant("softcap")

    def tier(variant, d, group, kv_len):
        spec = Spec("bfloat16", d, d, group, "cuda-sm90", tier="gluon")
        return tiers.choose_backward(variant, spec, (), False, kv_len)

    assert tier(causal, 128, 1, 4096)[0] == "gluon" and tier(causal, 128, 1, None)[0] == "triton"
    assert tier(softcap, 128, 1, 4096)[0] == "gluon" and tier(causal, 128, 4, 16384)[0] == "gluon"
    assert tier(causal, 64, 4, 4096)[0] == "gluon" and tier(softcap, 64, 1, 4096)[0] == "gluon"
    # GQA with a mask that reads h: each query head's programs bound their own tiles
    per_head = attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 96 * (h + 1)))
    assert tier(per_head, 64, 4, 4096)[0] == "gluon"
    spec = Spec("bfloat16", 64, 64, 4, "cuda-sm90", tier="gluon")
    assert "SPLIT_HEADS_FROM = 0\n" in codegen.render(plan.build("bwd", per_head.analysis, spec, per_head.captures))
    assert "SPLIT_HEADS_FROM = 8192\n" in codegen.render(plan.build("bwd", causal.analysis, spec, causal.captures))
    for args, why in [((causal, 128, 1, 4095), "128, 4095 keys (< 4096)"), ((causal, 64, 1, 1000), "(< 4096)"),
                      ((causal, 80, 1, 16384), "equal head dims of 64 or 128")]:
        got, reason = tier(*args)
        assert got == "triton" and why in reason, (args, reason)
    assert tiers.choose_backward(causal, Spec("bfloat16", 128, 128, 1, "cuda-sm90"), (), True, None)[0] == "triton"
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    assert tier(causal, 128, 4, 100) == ("gluon", "ATTNCC_TIER=gluon")


# Rendered Gluon kernels kept whole under tests/snapshots/sm90/: a change to the templates, the plan
# or the printer that alters one shows here as a diff to read (pytest --update-snapshots rewrites them)
SNAPSHOTS = Path(__file__).parent / "snapshots" / "sm90"
SNAPSHOT_CASES = [("fwd", "causal", 128, 1, "bfloat16"), ("fwd", "full", 64, 1, "bfloat16"),  # two / three warp groups
                  ("fwd", "alibi", 128, 4, "float16"),  # a captured tensor, GQA
                  ("bwd", "softcap", 128, 1, "bfloat16"), ("bwd", "sliding_window", 64, 2, "bfloat16"),
                  ("fwd-cp", "causal", 128, 1, "bfloat16"), ("bwd-cp", "prefix_lm", 128, 1, "bfloat16")]


@pytest.mark.parametrize("kind,name,d,group,dtype", SNAPSHOT_CASES,
                         ids=[f"{k}-{n}-d{d}-g{g}-{t}" for k, n, d, g, t in SNAPSHOT_CASES])
def test_rendered_gluon_source_matches_snapshot(kind, name, d, group, dtype, request):
    variant = _variant(name, H=2 * group)
    spec = Spec(dtype, d, d, group, "cuda-sm90", tier="gluon", offsets=kind.endswith("-cp"))
    source = codegen.render(plan.build(kind.split("-")[0], variant.analysis, spec, variant.captures))
    path = SNAPSHOTS / f"{kind}_{name}_d{d}_g{group}_{dtype}.py"
    if request.config.getoption("--update-snapshots"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    want = path.read_text() if path.exists() else ""
    if source != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), source.splitlines(True), str(path), "rendered", n=2))
        pytest.fail(f"the rendered kernel differs from {path} (if the change is meant, rerun with --update-snapshots "
                    f"and commit the file):\n{diff[:6000]}")


def test_context_parallel_tier_choice(monkeypatch):
    """context_parallel's chunk kernels: the Triton tier until tiers.GLUON_OFFSETS_CHECKED, then the
    Gluon tier where it fits, its kernels rendered with Q_OFF and KV_OFF (plan.offsets, which the
    Triton tier leaves off: it takes them always), and the backward's Spec inherits them."""
    causal = _variant("causal")
    chunks = tuple(torch.zeros(1, 2, 512, 128, dtype=torch.bfloat16) for _ in range(3))
    tier, why = tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, False, chunks)
    assert tier == "triton" and "GLUON_OFFSETS_CHECKED" in why
    monkeypatch.setattr(tiers, "GLUON_OFFSETS_CHECKED", True)
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, False, chunks)[0] == "gluon"
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, True, chunks)[0] == "triton"  # dropout
    strided = tuple(torch.zeros(1, 2, 512, 129, dtype=torch.bfloat16)[..., :128] for _ in range(3))
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, False, strided)[0] == "triton"
    for tier in ("gluon", "triton"):
        spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier=tier, offsets=True)
        for kind in ("fwd", "bwd"):
            built = plan.build(kind, causal.analysis, spec, causal.captures)
            assert built.offsets == (tier == "gluon")
            if tier == "gluon":
                src = codegen.render(built)
                assert re.search(r"q_idx = gl\.expand_dims\(.*\) \+ p\.Q_OFF$", src, re.M), kind
                assert "q_off=0, kv_off=0" in src, kind
    compiled = attncc.compile(causal)
    fwd = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon", offsets=True)
    bwd = compiled.bwd_spec(fwd, (), False, 4096)
    assert bwd.tier == "gluon" and bwd.offsets


# The Gluon kernels' tile schedules, run in Python: _block_range / _block (forward) and _q_range /
# _q_rotation / _q_block (backward) are integer code, so they run here with gl's few functions and
# Gluon's division (it truncates, as C) in place of the GPU's, against brute force over the mask:
# every tile with a kept score is visited once, tiles run without the mask code only where every
# score is kept, and with chunk positions (Q_OFF, KV_OFF) the same holds at those positions.
class _CInt(int):
    """An int with Gluon's (C's) // and %, which truncate toward zero."""

    def __add__(a, b):
        return _CInt(int(a) + int(b))

    __radd__ = __add__

    def __sub__(a, b):
        return _CInt(int(a) - int(b))

    def __rsub__(a, b):
        return _CInt(int(b) - int(a))

    def __mul__(a, b):
        return _CInt(int(a) * int(b))

    __rmul__ = __mul__

    def __neg__(a):
        return _CInt(-int(a))

    def __floordiv__(a, b):
        q = abs(int(a)) // abs(int(b))
        return _CInt(q if (int(a) >= 0) == (int(b) > 0) else -q)

    def __rfloordiv__(b, a):
        return _CInt(a) // b

    def __mod__(a, b):
        return a - b * (a // b)

    def __rmod__(b, a):
        return _CInt(a) % b


class _Gl:
    cdiv = staticmethod(lambda a, b: (_CInt(a) + b - 1) // b)
    maximum = staticmethod(lambda a, b: _CInt(max(int(a), int(b))))
    minimum = staticmethod(lambda a, b: _CInt(min(int(a), int(b))))
    where = staticmethod(lambda c, x, y: x if c else y)


def _in_python(jitted, done=None):
    """A Gluon function as plain Python over _CInt (and the Gluon functions it calls, likewise)."""
    import types
    done = {} if done is None else done
    fn = jitted.fn
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
    load = staticmethod(_load)

    def __getattr__(self, name):  # gl.exp2, gl.sin, gl.zeros_like, ...: torch's function of that name
        return getattr(torch, name)


def _softmax_step_in_torch(module):
    """The rendered _softmax_step as a plain function over torch tensors."""
    src = inspect.getsource(module._softmax_step.fn)
    src = src[src.index("def "):].replace("qk.type.layout", "None")
    env = {"gl": _GlTorch(), "_tanh": torch.tanh, "_sigmoid": torch.sigmoid, "Pipeline": object,
           "_floor_div": lambda a, b: torch.div(a, b, rounding_mode="floor"),
           "_floor_mod": torch.remainder}
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


# The Gluon backward's step as rendered (S^T from -lse2, dP^T from -Delta, the masks, dscore, the dK,
# dV and dQ products, dQ's hand-over in the accumulator's order) on CPU tensors: shared memory as
# tensors, the asynchronous products computed at issue, barriers as no-ops. A step runs twice per
# warp group, so that dQ's product reads both warp groups' dS^T; the schedule, the preprocess (lse2,
# Delta) and the dQ adds are the test's, after the kernel's. Against float64 autograd.
class _Smem:
    def __init__(self, t):
        self.t = t

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


def _bwd_step_in_torch(module):
    from types import SimpleNamespace
    src = inspect.getsource(module._step.fn)
    src = src[src.index("def "):]
    env = {"gl": _GlBwd(), "_tanh": torch.tanh, "_sigmoid": torch.sigmoid, "Pipeline": object,
           "mbarrier": SimpleNamespace(wait=lambda *a, **k: None, arrive=lambda *a, **k: None),
           "fence_async_shared": lambda: None, "warpgroup_mma": _mma,
           "warpgroup_mma_wait": lambda num_outstanding, deps: deps[0] if len(deps) == 1 else tuple(deps)}
    exec(compile(src, module.__file__, "exec"), env)
    return env["_step"]


BWD_STEP_CASES = [("causal", 128, False), ("sliding_window", 64, True), ("prefix_lm", 128, True), ("alibi", 128, True),
                  ("softcap", 128, False), ("softcap", 64, True), ("full", 64, False), ("trig", 128, False),
                  ("alibi-learn", 128, True), ("row_biases-learn", 64, False),  # capture gradients: per-step sums, atomics
                  ("alibi-gqa", 64, False), ("causal-gqa", 128, True)]  # GQA 2: query heads in one program (64) or one each


@pytest.mark.parametrize("name,d,offsets", BWD_STEP_CASES, ids=_step_ids(BWD_STEP_CASES))
def test_gluon_backward_step_matches_reference(name, d, offsets, tmp_path):
    from types import SimpleNamespace
    name, learn, group = name.split("-")[0], name.endswith("-learn"), 2 if name.endswith("-gqa") else 1
    variant = _variant(name, H=2)
    caps = [c.tensor for c in variant.captures]
    learnable = tuple(range(len(caps))) if learn else ()
    spec = Spec("bfloat16", d, d, group, "cuda-sm90", tier="gluon", offsets=offsets, learnable=learnable)
    built = plan.build("bwd", variant.analysis, spec, variant.captures)
    source = codegen.render(built)
    path = tmp_path / "bwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    step = _bwd_step_in_torch(module)
    q_range, q_block, q_rotation = (_in_python(f) for f in (module._q_range, module._q_block, module._q_rotation))
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
    lse_folds = "if p.FOLD_LSE:" in source
    p = SimpleNamespace(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=d, STAGES=stages, N_CTX_Q=Lq, N_CTX_KV=Lkv, Q_OFF=q_off,
                        KV_OFF=kv_off, sm_scale=scale, lse_to_acc=-1.0 / (scale * 1.4426950408889634), FOLD_LSE=lse_folds,
                        q_desc=SimpleNamespace(dtype=torch.float32), q_ready=_Smem(torch.zeros(stages)),
                        do_ready=_Smem(torch.zeros(stages)), ds_ready=_Smem(torch.zeros(2)), dq_bars=_Smem(torch.zeros(4)),
                        q_smem=_Smem(torch.zeros(stages, bm, d)), do_smem=_Smem(torch.zeros(stages, bm, d)),
                        lse_smem=_Smem(torch.zeros(stages, bm)), delta_smem=_Smem(torch.zeros(stages, bm)),
                        ds_smem=_Smem(torch.zeros(2, bk, bm)), dq_smem=_Smem(torch.zeros(2, dq_n // 4, 256)),
                        k_smem=_Smem(torch.zeros(bk, d)), v_smem=_Smem(torch.zeros(bk, d)))
    got = [torch.zeros(group, Lq, d), torch.zeros(Lkv, d), torch.zeros(Lkv, d)]
    heads = 1 if Lkv >= module.SPLIT_HEADS_FROM else group  # query heads per program, as the launcher
    for h0, kv_lo in ((h0, kv_lo) for h0 in range(0, group, heads) for kv_lo in range(0, Lkv, bk)):
        # a program: its K/V tile, its query heads' tiles in the kernel's order
        rows = min(bk, Lkv - kv_lo)
        p.k_smem.t.zero_()[:rows] = k[kv_lo:kv_lo + rows].float()
        p.v_smem.t.zero_()[:rows] = v[kv_lo:kv_lo + rows].float()
        full_lo, full_hi, hi, n_hi, n_masked, n = q_range(C(0), C(h0), C(kv_off + kv_lo if offsets else kv_lo), bk, C(Lq),
                                                          C(Lkv), bm, *([C(q_off), C(kv_off)] if offsets else []))
        rot = q_rotation(C(kv_off - q_off + kv_lo) if offsets else C(kv_lo), full_lo, bm)
        kv_idx = [(kv_lo + wg * bn + torch.arange(bn))[:, None] + (kv_off if offsets else 0) for wg in (0, 1)]
        acc = [[torch.zeros(bn, d), torch.zeros(bn, d)] for _ in (0, 1)]
        for j in range(int(n) * heads):
            m0, hq = int(q_block(C(j // heads), full_lo, full_hi, hi, n_hi, n_masked, rot)) * bm, h0 + j % heads
            slot, qr = j % stages, min(bm, Lq - m0)
            for buf, src in ((p.q_smem, q), (p.do_smem, do), (p.lse_smem, lse2), (p.delta_smem, delta)):
                buf.t[slot].zero_()[:qr] = src[hq, m0:m0 + qr].float()  # TMA zero-fills; row statistics are 0 past the end
            before = [dc.clone() for dc in dcaps]
            for keep in (False, True):  # the first round writes both warp groups' dS^T
                for dc, b0 in zip(dcaps, before):  # and capture gradients, which only the second keeps
                    dc.copy_(b0)
                for wg in (0, 1):
                    dk, dv = step(p, wg, j, m0, b_t, torch.tensor(hq), acc[wg][0].clone(), acc[wg][1].clone(),
                                  kv_idx[wg], p.k_smem.slice(wg * bn, bn), p.v_smem.slice(wg * bn, bn), None, None, None,
                                  j < n_masked * heads, *cap_args)
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


# Run in a process of its own: with the interpreter on (as in the CPU tests) Triton's own library
# functions are interpreter objects that Gluon cannot compile, and a fresh TRITON_CACHE_DIR makes
# it compile rather than find an earlier result.
COMPILE = """
import json, sys
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature
from attncc import runtime
path, d, group, dtype, shapes, kind = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4]),
                                      json.loads(sys.argv[5]), sys.argv[6])
module = runtime.load(Path(path), False, Path(path).read_text())
B, H, Lq, Lkv = 2, 2 * group, 300, 777
q, out = (torch.zeros(B, H, Lq, d, dtype=dtype) for _ in range(2))
k = torch.zeros(B, H // group, Lkv, d, dtype=dtype)
rows = torch.zeros(B, H, Lq)
caps = []
for shape in shapes:
    c = torch.zeros(shape)
    caps += [c] + [x for dim in range(c.dim()) for x in (c.shape[dim], c.stride(dim))]
    if kind == "bwd-learn":  # every capture learnable: its float32 gradient and strides follow it
        caps += [torch.zeros(shape)] + list(c.stride())
target = GPUTarget("cuda", 90, 128)
backend = make_backend(target)


def compile_for_sm90(fn, args, kwargs):
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


offsets = [1024, 513] if kind.endswith("-cp") else []  # Q_OFF, KV_OFF: a chunk of a longer sequence
if kind.startswith("fwd"):
    block_m, block_n, _, stages = module.LAUNCH_TILES["attn_fwd"]
    args = [module._descriptor(q, block_m), module._descriptor(k, block_n), module._descriptor(k, block_n),
            module._descriptor(out, block_m), rows, *caps, H, B * H, Lq, Lkv, 0.125, *offsets]
    compiled = compile_for_sm90(module.attn_fwd, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
                                                            GROUP=group, WGS=module.WGS, num_warps=4,
                                                            maxnreg=168 if module.WGS == 2 else 128))
else:
    block_m, block_n, _, stages = module.LAUNCH_TILES["attn_bwd"]
    heads = 1 if Lkv >= module.SPLIT_HEADS_FROM else group  # as the launcher: query heads per program
    dkv = k if heads == group else k.float()  # float32 sums where programs share a K/V head
    dq = module._dq_accumulator(B * H * triton.cdiv(Lq, block_m), "cpu")[1]
    args = [module._descriptor(q, block_m), module._descriptor(k, 2 * block_n), module._descriptor(k, 2 * block_n),
            module._descriptor(out, block_m), rows, rows, dq, dkv, dkv, *dkv.stride(), *dkv.stride(), *caps,
            H, B * H // heads, Lq, Lkv, 0.125, -5.5, 3, *offsets]
    compiled = compile_for_sm90(module.attn_bwd, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
                                                             GROUP=group, HEADS=heads,
                                                             FOLD_LSE=kind != "bwd-nofold", num_warps=4, maxnreg=168))
    compile_for_sm90(module.attn_bwd_preprocess, [out, out, rows, rows, rows, rows, torch.zeros(B, H, Lq, d),
                                                  *out.stride(), *out.stride(), H, Lq],
                     dict(HEAD_DIM=d, BLOCK_M=64, HAS_DLSE=True, num_warps=4))
    compile_for_sm90(module.attn_bwd_dq, [torch.zeros(B * H * triton.cdiv(Lq, block_m) * block_m * d), q, *q.stride(), H, Lq],
                     dict(BLOCK_M=block_m, HEAD_DIM=d, num_warps=4))
assert compiled.metadata.shared > 0 and "wgmma" in compiled.asm["ptx"]
adds = [line for line in compiled.asm["ptx"].splitlines() if "red.global" in line or "atom.global" in line]
print("atomics", sum(".add.f32" in line for line in adds), "vector", sum(".add.v" in line for line in adds),
      "ordered", sum("relaxed" not in line for line in adds))
print("compiled", compiled.metadata.shared, "triton", triton.__version__)
"""
# A folder holding Triton 3.6, the GPU machines' version (.ci/run installs one there): every case
# compiles with it too, since Gluon's API moves between releases (3.9 took a global constexpr tuple
# that 3.6 refused)
TRITON_36 = os.environ.get("ATTNCC_TRITON_36")


TRIG = "trig"  # score_mod with sin, cos and sigmoid (printed as Gluon's functions or its helpers)
CASES = [("fwd", name, 128, 1, "bfloat16") for name in GLUON_VARIANTS + [TRIG]] + [
    ("fwd", "causal", 128, 4, "float16"), ("fwd", "alibi", 64, 2, "bfloat16"), ("fwd", "full", 64, 1, "float16"),
    ("fwd", "full", 64, 1, "bfloat16"),  # P rounded in pairs (plan.probs_in_pairs)
    ("fwd", "causal", 64, 4, "bfloat16")] + [
    ("bwd", name, 128, 1, "bfloat16") for name in ("full", "causal", "alibi", "softcap", "rel_bias", TRIG)] + [
    ("bwd", "causal", 128, 4, "float16"), ("bwd", "sliding_window", 64, 2, "bfloat16"), ("bwd", "softcap", 64, 1, "bfloat16"),
    ("bwd", "sliding_window", 128, 1, "bfloat16"), ("bwd", "prefix_lm", 128, 1, "bfloat16"),  # masks as row intervals
    ("bwd-nofold", "causal", 128, 1, "bfloat16"),  # lse2 read in the step (a scale of 0: FOLD_LSE=False)
    ("bwd-learn", "alibi", 128, 1, "bfloat16"), ("bwd-learn", "row_biases", 64, 2, "float16")] + [  # dcap atomics
    # context parallelism's kernels at chunk positions (Q_OFF, KV_OFF)
    ("fwd-cp", "causal", 128, 1, "bfloat16"), ("fwd-cp", "sliding_window", 128, 4, "float16"),
    ("fwd-cp", "alibi", 64, 1, "bfloat16"), ("fwd-cp", "full", 64, 2, "bfloat16"),
    ("bwd-cp", "causal", 128, 1, "bfloat16"), ("bwd-cp", "prefix_lm", 64, 2, "bfloat16"),
    ("bwd-cp", "softcap", 128, 4, "float16")]


@pytest.mark.parametrize("kind,name,d,group,dtype", CASES, ids=[f"{k}-{n}-d{d}-g{g}-{t}" for k, n, d, g, t in CASES])
def test_rendered_gluon_kernel_compiles_for_sm90(kind, name, d, group, dtype, tmp_path):
    variant = _variant(name, H=2 * group)
    learnable = tuple(range(len(variant.captures))) if kind == "bwd-learn" else ()
    spec = Spec(dtype, d, d, group, "cuda-sm90", tier="gluon", learnable=learnable, offsets=kind.endswith("-cp"))
    source = codegen.render(plan.build(kind.split("-")[0], variant.analysis, spec, variant.captures))
    path = tmp_path / f"{kind}_{name}.py"
    path.write_text(source)
    module = runtime.load(path, True, source)  # loads here too (as the interpreter's module: no compile)
    assert module.TIER == "gluon"
    if kind.startswith("fwd"):  # three consumer warp groups where plan.wide_forward grants them
        assert module.WGS == (3 if d == 64 and name in ("full", "causal") else 2)
    # loaded without runtime.py's `from __future__ import annotations`: Gluon reads the annotations
    helper, param = (module._block_range, "BLOCK_Q") if kind.startswith("fwd") else (module._q_range, "BLOCK_KV")
    assert not isinstance(inspect.signature(helper.fn).parameters[param].annotation, str)
    shapes = [list(c.tensor.shape) for c in variant.captures]
    for triton_dir in [None] + ([TRITON_36] if TRITON_36 else []):  # this Triton, then the GPU machines' 3.6
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNCC_INTERPRET")}
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton{'-3.6' if triton_dir else ''}")
        if triton_dir:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
        result = subprocess.run([sys.executable, "-c", COMPILE, str(path), str(d), str(group), dtype, json.dumps(shapes),
                                 kind], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
        assert not triton_dir or "triton 3.6." in result.stdout, result.stdout  # the folder's Triton ran
        if kind == "bwd-learn":  # one atomic instruction per gradient, loop (masked, whole) and consumer: a
            # value the layout holds twice per thread would be added twice
            grads = plan.build("bwd", variant.analysis, spec, variant.captures).grads
            assert f"atomics {4 * len(grads)} " in result.stdout, result.stdout
        if "atomics" in result.stdout:  # sums, not synchronisation: relaxed (an acq_rel atomic orders memory)
            assert " ordered 0" in result.stdout, result.stdout


def test_gluon_backward_query_tiles():
    """Head dim 64 takes query tiles of 128 where the score_mod's derivative is 1 and the mask
    leaves whole tiles; a dscore tile (softcap) beside them spilled 360 bytes per thread, and a
    mask whose bounds leave no whole tile runs every 128-row step with its spilling mask code:
    those keep tiles of 64, as head dim 128."""
    def tiles(name, d):
        variant = name if isinstance(name, attncc.Variant) else _variant(name)
        spec = Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon")
        return plan.build("bwd", variant.analysis, spec, variant.captures).tiles["attn_bwd"].block_m
    assert [tiles(n, 64) for n in ("full", "causal", "alibi", "softcap", "document")] == [128, 128, 128, 64, 64]
    stripes = attncc.Variant(mask_mod=lambda b, h, q, k: (q // 64) % 2 == (k // 64) % 2)  # no whole tile derivable
    assert tiles(stripes, 64) == 64
    assert [tiles(n, 128) for n in ("full", "softcap")] == [64, 64]


@pytest.mark.parametrize("d,lq,name", [(128, 128, "full"), (128, 100, "full"), (64, 17, "full"), (64, 256, "full"),
                                       (64, 300, "full"), (64, 100, "softcap")])
def test_gluon_dq_accumulator_order(d, lq, name, tmp_path):
    """The float32 dQ buffer holds each warp group's half of a query tile (64 rows x DQ_N columns:
    the columns split at query tiles of 64, the rows at tiles of 128) in the wgmma accumulator's
    register order: thread t = 32 warp + lane holds rows 16 warp + 8 i + lane // 4 and columns
    8 k + 2 (lane % 4) + j of its half at float (128 k + t) * 4 + 2 i + j of its block. The
    post-pass attn_bwd_dq reshapes a block to (warp group, k, warp, t // 4, t % 4, i, j), permutes
    it by DQ_ORDER and reads it as rows x columns (whole tiles and a ragged last one): that must
    invert exactly the order above. (Gluon does not run on the CPU: torch does the kernel's
    reshapes here; the GPU tests check dq itself.)"""
    variant = _variant(name)
    source = codegen.render(plan.build("bwd", variant.analysis, Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon"),
                                       variant.captures))
    path = tmp_path / "bwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    assert f"    acc = gl.permute(acc, {module.DQ_ORDER})  # DQ_ORDER\n" in source  # the kernel's own order
    assert "    acc = gl.reshape(acc, [2, BLOCK_M * HEAD_DIM // 1024, 4, 8, 4, 2, 2])\n" in source
    block_m = module.LAUNCH_TILES["attn_bwd"][0]
    dq_n = block_m * d // 128
    B, H = 2, 3
    n_q = -(-lq // block_m)
    acc = torch.randn(B * H * n_q * block_m * d)
    r = torch.arange(n_q * block_m)[:, None]
    c = torch.arange(d)[None, :]
    if block_m == 128:  # the warp groups split the rows
        wg, rr, cc = (r % block_m) // 64, r % 64, c
    else:  # the columns
        wg, rr, cc = c // dq_n, r % 64, c % dq_n
    lane = 4 * (rr % 8) + (cc % 8) // 2
    t = 32 * (rr // 16) + lane
    f = (128 * (cc // 8) + t) * 4 + 2 * ((rr % 16) // 8) + cc % 2
    bh = torch.arange(B * H)[:, None, None]
    index = ((bh * n_q + r // block_m) * 2 + wg) * (64 * dq_n) + f
    want = acc[index].view(B, H, n_q * block_m, d)[:, :, :lq]
    order = module.DQ_ORDER
    blocks = acc.view(B * H * n_q, 2, block_m * d // 1024, 4, 8, 4, 2, 2).permute(0, *[1 + x for x in order])
    dq = blocks.reshape(B, H, n_q * block_m, d)[:, :, :lq]
    assert torch.equal(dq, want)


def _assert_patches_apply(table, kernel, head_dims, optional=()):
    """Each old text of benchmarks/gluon/<table>.py occurs exactly once in the rendered full and
    causal Gluon kernels at these head dims; texts starting with one of `optional` (switches whose
    other side some of these kernels render) at most once, and once in at least one of them."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gluon" / f"{table}.py"
    spec = importlib.util.spec_from_file_location(table, path)
    patches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patches)
    applied = set()
    for name in ("full", "causal"):
        variant = _variant(name)
        for d in head_dims:
            source = codegen.render(plan.build(kernel, variant.analysis, Spec("bfloat16", d, d, 1, "cuda-sm90",
                                                                              tier="gluon"), variant.captures))
            for patch, edits in patches.PATCHES.items():
                for old, _ in edits:
                    count = source.count(old)
                    if old.startswith(tuple(optional)):
                        assert count <= 1, (name, d, patch, old[:80], count)
                        applied |= {old} if count else set()
                    else:
                        assert count == 1, (name, d, patch, old[:80], count)
    missing = [old[:80] for edits in patches.PATCHES.values() for old, _ in edits
               if old.startswith(tuple(optional)) and old not in applied]
    assert not missing, missing


def test_probe_patches_still_apply():
    """benchmarks/gluon/gluon_bwd_probe.py times text patches of the rendered Gluon backward: each
    old text must occur exactly once in the full and the causal kernel, or the probe measures a
    patch that did nothing (or fails on the GPU, after its compile time)."""
    _assert_patches_apply("bwd_patches", "bwd", (128, ))


def test_forward_probe_patches_still_apply():
    """The same for gluon_fwd_probe.py's patches of the rendered Gluon forward, at both widths (two
    consumer warp groups at head dim 128, three at 64); the persistence patches set a flag either way,
    and cvt-pairs / cvt-one switch the rounding of P whichever way a kernel renders it."""
    _assert_patches_apply("fwd_patches", "fwd", (128, 64), optional=("\nPERSISTENT", "    p_op = ", "        p_op = "))
