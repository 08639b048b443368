"""The Gluon tier's forward (templates/sm90) on a Hopper GPU against the float64 reference and the
Triton tier: every example variant it takes, odd lengths, Lq != Lkv, GQA, head dims 64 and 128,
fully masked rows, (B, L, H, D) views, a learnable capture's gradient through its lse, and the
tier choice. Run with ``python -m pytest -m gpu tests/test_gpu_gluon.py`` on an sm90 machine."""
from __future__ import annotations

import os
import zlib

import pytest
import torch

import attncc
from conftest import assert_close_to_reference
from test_gpu import reference_on_gpu
from variants import BUILDERS, NAMES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm90 GPU")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (B, Hq, Hkv, Lq, Lkv, D)
SHAPES = {"1x2x1x1": (1, 2, 2, 1, 1, 128), "2x3x17": (2, 3, 3, 17, 17, 128), "gqa8:2-1000": (2, 8, 2, 1000, 1000, 128),
          "Lq300-Lkv1500": (2, 4, 4, 300, 1500, 128), "Lq1500-Lkv300": (1, 4, 4, 1500, 300, 128),
          "Lq1-Lkv4096": (2, 2, 2, 1, 4096, 128), "D64-gqa4:1-Lq17-Lkv1000": (1, 4, 1, 17, 1000, 64),
          "many-tiles-4x8x2048": (4, 8, 8, 2048, 2048, 128),  # more tiles than SMs: programs draw them (DYNAMIC_KV)
          "D64-many-tiles-4x8x2048": (4, 8, 8, 2048, 2048, 64),
          "gqa16:2-Lq300-Lkv777": (1, 16, 2, 300, 777, 128),
          # head dim 64: three consumer warp groups (192-row tiles) where tiles.wide_forward says
          "D64-2x3x17": (2, 3, 3, 17, 17, 64), "D64-Lq300-Lkv1500": (2, 4, 4, 300, 1500, 64),
          "D64-Lq1500-Lkv300": (1, 4, 4, 1500, 300, 64), "D64-Lq1-Lkv777": (2, 2, 2, 1, 777, 64),
          "D64-gqa4:2-Lq1000": (2, 4, 2, 1000, 1000, 64),  # two query heads packed into a tile (plan.pack_gqa)
          "D64-gqa16:2-Lq300-Lkv777": (1, 16, 2, 300, 777, 64)}  # eight
FP16_SHAPES = ("2x3x17", "gqa8:2-1000", "D64-gqa4:1-Lq17-Lkv1000", "D64-Lq300-Lkv1500")  # fp16: fewer shapes (each dtype compiles its kernels)
GLUON_BWD_VARIANTS = NAMES


def _modules(tier: str):
    return [m for (_, kind, spec), (_, m) in attncc.api._loaded.items() if kind == "fwd" and spec.tier == tier]


def _run(name, shape, dtype, seed):
    B, Hq, Hkv, Lq, Lkv, D = SHAPES[shape]
    torch.manual_seed(zlib.crc32(seed.encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cuda")
    # q wants a gradient: a call of few queries over many keys would take the decode kernel
    q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
    out, lse = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv, return_lse=True)
    ref, ref_lse = reference_on_gpu(q.detach(), k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    out = out.detach()
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    return out, lse


@pytest.mark.parametrize("name,shape,dt", [(n, s, d) for n in NAMES for s in SHAPES for d in DTYPES
                                            if d == "bf16" or s in FP16_SHAPES])
def test_gluon_forward_matches_reference(name, shape, dt, monkeypatch):
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    monkeypatch.setattr(attncc.api, "_loaded", {})  # this call's kernel modules only
    _run(name, shape, DTYPES[dt], f"gluon-{name}-{shape}-{dt}")
    assert _modules("gluon"), "the forced Gluon tier did not run"


@pytest.mark.parametrize("dt", list(DTYPES))
def test_gluon_and_triton_tiers_agree(dt, monkeypatch):
    """The portable tier is the oracle: both tiers on the same inputs, within the dtype's rounding."""
    dtype = DTYPES[dt]
    for name in NAMES:
        outs = []
        for tier in ("gluon", "triton"):
            monkeypatch.setenv("ATTNCC_TIER", tier)
            outs.append(_run(name, "gqa8:2-1000", dtype, f"agree-{name}-{dt}"))
        err = ((outs[0][0].double() - outs[1][0].double()).norm() / outs[1][0].double().norm()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{name}: tiers differ by {err:.2e}"


@pytest.mark.parametrize("dt,D", [(dt, D) for dt in DTYPES for D in (128, 64)])
def test_gluon_fully_masked_rows_and_blhd_views(dt, D, monkeypatch):
    """Rows whose every key is masked give 0 and lse -inf; (B, L, H, D) views go through 4-D
    descriptors with their strides."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    dtype = DTYPES[dt]
    torch.manual_seed(3)
    B, L, H = 2, 777, 4
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
    mask = lambda b, h, q_idx, kv_idx: (q_idx < 300) & (kv_idx <= q_idx) | (q_idx > 600) & (kv_idx > 500)  # noqa: E731
    out, lse = attncc.attention(q, k, v, None, mask, return_lse=True)
    ref, ref_lse = reference_on_gpu(q, k, v, None, mask)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    assert torch.isneginf(lse[:, :, 300:601]).all() and (out[:, :, 300:601] == 0).all()
    assert _modules("gluon")


@pytest.mark.parametrize("name, group", [("causal", 1), ("full", 1), ("causal", 4)])
def test_auto_tier_picks_the_wide_gluon_forward_for_long_sequences(name, group, monkeypatch):
    """With no ATTNCC_TIER, head dim 64 runs the Gluon forward with three consumer warp groups from
    4096 queries and keys, 2048 without a mask or with GQA's query heads packed into the tiles
    (tiers.gluon_pays), and the Triton tier's below."""
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    torch.manual_seed(11)
    shortest = 4096 if name == "causal" and group == 1 else 2048
    for L, tier in ((shortest, "gluon"), (shortest - 1, "triton")):
        score_mod, mask_mod = BUILDERS[name](1, 4, L, L, "cuda")
        q = torch.randn(1, 4, L, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 4 // group, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out, lse = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=group > 1, return_lse=True)
        ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod, enable_gqa=group > 1)
        assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
        variant = attncc.Variant(score_mod, mask_mod)
        assert attncc.tiers.choose(variant, "cuda-sm90", "bfloat16", 64, 64, False, (q, k, v))[0] == tier
        spec = attncc.spec.Spec("bfloat16", 64, 64, 1, "cuda-sm90", tier="gluon")
        assert attncc.compile(variant).module("fwd", spec).WGS == 3


@pytest.mark.parametrize("name", ["rel_bias", "sliding_window"])
def test_auto_tier_takes_two_warp_groups_at_head_dim_64(name, monkeypatch):
    """With no ATTNCC_TIER, head dim 64 runs a score_mod that loads a captured table at q_idx - kv_idx,
    and a sliding window, on the Gluon forward with two consumer warp groups from 1024 queries and
    keys (tiers.gluon_pays), and the Triton tier's below; both against the float64 reference."""
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    chosen, choose = [], attncc.tiers.choose

    def spy(*args, **kwargs):
        tier, why = choose(*args, **kwargs)
        chosen.append(tier)
        return tier, why
    monkeypatch.setattr(attncc.tiers, "choose", spy)
    torch.manual_seed(12)
    for L, tier in ((1024, "gluon"), (1023, "triton")):
        score_mod, mask_mod = BUILDERS[name](2, 4, L, L, "cuda")
        q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        chosen.clear()
        out, lse = attncc.attention(q, k, v, score_mod, mask_mod, return_lse=True)
        assert chosen and set(chosen) == {tier}, (L, chosen)  # what the call ran
        ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod)
        assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
    spec = attncc.spec.Spec("bfloat16", 64, 64, 1, "cuda-sm90", tier="gluon")
    assert attncc.compile(attncc.Variant(score_mod, mask_mod)).module("fwd", spec).WGS == 2


def test_gluon_forward_feeds_the_backward(monkeypatch):
    """A learnable relative-position table, ATTNCC_TIER=gluon: the Gluon forward's output and lse
    drive the Gluon backward (the table's gradient summed per tile diagonal); gradients equal the
    Triton tier's."""
    grads = []
    for tier in ("gluon", "triton"):
        monkeypatch.setenv("ATTNCC_TIER", tier)
        torch.manual_seed(5)
        B, H, L, D = 2, 4, 1000, 128
        table = (0.5 * torch.randn(H, 2 * L, device="cuda")).requires_grad_()
        mod = lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + L]  # noqa: E731
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        out = attncc.attention(q, k, v, mod, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
        out.float().square().sum().backward()
        grads.append([t.grad.double() for t in (q, k, v, table)])
    for name, g, w in zip(("dq", "dk", "dv", "dtable"), *grads):
        err = ((g - w).norm() / w.norm()).item()
        assert torch.isfinite(g).all() and err < 2e-2, f"{name}: {err:.2e}"



# --- the backward (templates/sm90/attn_bwd.py.jinja) ---------------------------------------------
BWD_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}  # as tests/test_gpu_backward.py
BWD_SHAPES = {"2x3x17": (2, 3, 3, 17, 17, 128), "gqa8:2-1000": (2, 8, 2, 1000, 1000, 128),
              "Lq300-Lkv1500": (1, 4, 4, 300, 1500, 128), "Lq1500-Lkv300": (1, 4, 4, 1500, 300, 128),
              "Lq1-Lkv777": (2, 2, 2, 1, 777, 128), "D64-gqa4:1-Lq1000": (1, 4, 1, 1000, 1000, 64),
              "whole-tiles-2x4x1024": (2, 4, 4, 1024, 1024, 128),
              # head dim 64 takes query tiles of 128 and splits dQ by rows (attncc.tiles.gluon_tiles)
              "D64-2x3x17": (2, 3, 3, 17, 17, 64), "D64-Lq300-Lkv1500": (1, 4, 4, 300, 1500, 64),
              "D64-Lq1500-Lkv300": (1, 4, 4, 1500, 300, 64), "D64-Lq1-Lkv777": (2, 2, 2, 1, 777, 64),
              "D64-whole-tiles-2x4x1024": (2, 4, 4, 1024, 1024, 64),
              # more K/V tiles than SMs (programs in several waves), odd lengths
              "many-tiles-3x8x1999": (3, 8, 8, 1999, 1999, 128), "D64-many-tiles-3x8x1999": (3, 8, 8, 1999, 1999, 64),
              "gqa8:2-many-tiles-Lq1500-Lkv2100": (2, 8, 2, 1500, 2100, 128)}  # dK, dV added into float32 sums
BWD_FP16 = ("2x3x17", "gqa8:2-1000", "D64-gqa4:1-Lq1000", "D64-Lq1500-Lkv300")


def _bwd_modules(tier: str):
    return [m for (_, kind, spec), (_, m) in attncc.api._loaded.items() if kind == "bwd" and spec.tier == tier]


def _grads(name, shape, dtype, seed, layout="bhld"):
    B, Hq, Hkv, Lq, Lkv, D = shape
    torch.manual_seed(zlib.crc32(seed.encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cuda")

    def make(h, n):
        if layout == "blhd":  # (B, L, H, D) storage seen as (B, H, L, D)
            return torch.randn(B, n, h, D, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(B, h, n, D, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = make(Hq, Lq), make(Hkv, Lkv), make(Hkv, Lkv)
    out = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    do = torch.randn_like(out)
    return (q, k, v, score_mod, mask_mod, do), torch.autograd.grad(out, (q, k, v), do)


@pytest.mark.parametrize("name,shape,dt", [(n, s, d) for n in GLUON_BWD_VARIANTS for s in BWD_SHAPES for d in DTYPES
                                            if d == "bf16" or s in BWD_FP16])
def test_gluon_backward_matches_reference(name, shape, dt, monkeypatch):
    """dQ, dK, dV of the Gluon backward against float64 autograd through the reference (NaN fails):
    within the dtype's tolerance relative to the gradient, or (where the exact gradient is about 0,
    as dQ of a query that sees one key) within twice the Triton tier's error on the same inputs or
    float32's rounding of dP - Delta."""
    dtype = DTYPES[dt]
    seed = f"gbwd-{name}-{shape}-{dt}"
    monkeypatch.setenv("ATTNCC_TIER", "triton")
    _, oracle = _grads(name, BWD_SHAPES[shape], dtype, seed)
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    before = len(_bwd_modules("gluon"))
    (q, k, v, score_mod, mask_mod, do), got = _grads(name, BWD_SHAPES[shape], dtype, seed)
    assert len(_bwd_modules("gluon")) > before or _bwd_modules("gluon"), "the forced Gluon backward did not run"
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, score_mod, mask_mod, enable_gqa=q.shape[1] != k.shape[1])
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    # where the exact gradient is 0 (dQ of a query that sees one key: dP - Delta cancels), float32
    # rounding of dP - Delta is what is left: a floor far below any wrong term, scaled by |dV| ~ |dO|
    floor = 1e-5 * want[2].norm().item()
    for label, g, t, w in zip(("dq", "dk", "dv"), got, oracle, want):
        assert torch.isfinite(g).all(), f"{label}: non-finite values"
        err, triton_err = (g.double() - w).norm().item(), (t.double() - w).norm().item()
        bound = max(BWD_TOL[dtype] * w.norm().item(), 2 * triton_err, floor)
        assert err <= bound, f"{label}: error {err:.3g} > {bound:.3g} (|grad| {w.norm().item():.3g}, Triton tier {triton_err:.3g})"


@pytest.mark.parametrize("dt", list(DTYPES))
def test_gluon_and_triton_backward_agree(dt, monkeypatch):
    """The Triton tier's backward is the oracle: both tiers on the same inputs, (B, L, H, D) views."""
    dtype = DTYPES[dt]
    for name in GLUON_BWD_VARIANTS:
        grads = []
        for tier in ("gluon", "triton"):
            monkeypatch.setenv("ATTNCC_TIER", tier)
            grads.append(_grads(name, BWD_SHAPES["gqa8:2-1000"], dtype, f"agree-bwd-{name}-{dt}", layout="blhd")[1])
        for label, g, w in zip(("dq", "dk", "dv"), *grads):
            err = ((g.double() - w.double()).norm() / w.double().norm()).item()
            assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), f"{name} {label}: tiers differ by {err:.2e}"
    assert _bwd_modules("gluon")


def test_gluon_backward_fully_masked_rows_and_keys(monkeypatch):
    """Rows and keys the mask empties get zero gradients, never NaN."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    torch.manual_seed(4)
    B, H, L, D = 1, 2, 777, 128
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = lambda b, h, q_idx, kv_idx: (q_idx < 300) & (kv_idx <= q_idx) | (q_idx > 600) & (kv_idx > 500)  # noqa: E731
    out = attncc.attention(q, k, v, None, mask)
    out.float().square().sum().backward()
    assert _bwd_modules("gluon")
    assert (q.grad[:, :, 300:601] == 0).all() and (k.grad[:, :, 300:501] == 0).all()
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    attncc.reference.attention(qd, kd, vd, None, mask).square().sum().backward()
    for g, w in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert torch.isfinite(g).all() and ((g.double() - w).norm() / w.norm()).item() < 3e-2


@pytest.mark.parametrize("scale", [0.0, 1e-35, -0.3])
def test_gluon_backward_scales_the_lse_start_cannot_take(scale, monkeypatch):
    """S^T's accumulator starts from -lse2 / (scale log2 e) only where that fits a float32: a
    scale of 0 or next to it reads lse2 in the step instead (FOLD_LSE=False); a negative scale
    starts it. Gradients against float64 either way."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 2, 333, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    out = attncc.attention(q, k, v, None, mask, scale=scale)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    assert _bwd_modules("gluon")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, None, mask, scale=scale), (qd, kd, vd),
                               do.double())
    for label, g, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), label
        if w.norm() > 0:  # dq and dk vanish with the scale
            assert ((g.double() - w).norm() / w.norm()).item() < BWD_TOL[torch.bfloat16], label
        else:
            assert (g == 0).all(), label


def test_gluon_backward_compiles_with_the_newest_ptxas(tmp_path, monkeypatch):
    """Where a CUDA toolkit newer than Triton's ptxas is installed (attncc.toolchain), the Gluon
    backward's kernels compile with it, into a Triton cache folder of their own, and compute the
    same gradients as with Triton's ptxas; the forward keeps Triton's."""
    from attncc import toolchain
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.delenv("ATTNCC_PTXAS", raising=False)
    tool = toolchain.choose("auto", None)
    if tool is None:
        pytest.skip("no CUDA toolkit here with a ptxas newer than Triton's that the driver runs")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    grads = []
    for setting in ("auto", "triton"):
        monkeypatch.setenv("ATTNCC_PTXAS", setting)
        monkeypatch.setattr(attncc.api, "_loaded", {})
        monkeypatch.setattr(attncc.runtime, "_modules", {})  # loaded afresh: Triton compiles them again
        monkeypatch.setattr(attncc.runtime, "_launched", set())
        torch.manual_seed(8)
        q, k, v = (torch.randn(1, 2, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = attncc.attention(q, k, v, None, lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
        assert _bwd_modules("gluon")
        newest = tmp_path / ("ptxas-%d.%d" % tool.version)
        assert newest.is_dir() and any(newest.iterdir()), setting
        if setting == "auto":
            assert os.environ.get("TRITON_PTXAS_PATH") is None  # set only while compiling
            first = set(newest.iterdir())
    assert set(newest.iterdir()) == first  # Triton's ptxas wrote to the usual cache, not this one
    for g, w in zip(*grads):
        assert torch.equal(g, w) or ((g.double() - w.double()).norm() / w.double().norm()).item() < 1e-3


def test_gluon_backward_tier_choice(monkeypatch):
    """Learnable captures keep the Triton tier's backward unless ATTNCC_TIER=gluon asks for the
    Gluon one (its per-step sums and atomics measured slower), except relative-position tables
    (their diagonal sums measured faster on the Gluon tier); deterministic mode keeps it."""
    torch.manual_seed(6)
    L = 4099  # past tiers.gluon_bwd_pays: under auto only the learnable capture keeps the Triton tier
    slopes = torch.rand(4, device="cuda", requires_grad=True)
    table = torch.randn(4, 2 * L - 1, device="cuda", requires_grad=True)
    q, k, v = (torch.randn(1, 4, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    alibi = lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)  # noqa: E731
    relative = lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + L - 1]  # noqa: E731
    for tier, mod, kwargs, want in (("auto", alibi, {}, "triton"), ("gluon", alibi, {}, "gluon"),
                                    ("auto", relative, {}, "gluon"), ("gluon", alibi, {"deterministic": True}, "triton")):
        monkeypatch.setenv("ATTNCC_TIER", tier)
        attncc.api._loaded.clear()
        attncc.attention(q, k, v, mod, **kwargs).sum().backward()
        assert _bwd_modules(want) and not _bwd_modules({"triton": "gluon", "gluon": "triton"}[want]), (tier, want)
    assert torch.isfinite(slopes.grad).all() and torch.isfinite(table.grad).all()


@pytest.mark.parametrize("D,L,mask", [(64, 1000, "per-head window"), (128, 1000, "per-head window"),
                                       (64, 8200, "causal"), (128, 4200, "causal")])
def test_gluon_backward_gqa_programs(D, L, mask, monkeypatch):
    """GQA 4:1: a program per query head adding dK, dV into float32 sums (always where the mask
    reads h, whose tile bounds are one query head's; else from SPLIT_HEADS_FROM keys: 8192 at head
    dim 64, 4096 at 128), against float64 autograd."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    torch.manual_seed(zlib.crc32(f"gqa-programs-{D}-{L}".encode()))
    if mask == "causal":
        mask_mod = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    else:
        mask_mod = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 96 * (h + 1))  # noqa: E731
    q = torch.randn(1, 4, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 1, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    attncc.api._loaded.clear()
    out = attncc.attention(q, k, v, None, mask_mod, enable_gqa=True)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    modules = _bwd_modules("gluon")
    assert modules and not _bwd_modules("triton")
    assert L >= modules[0].SPLIT_HEADS_FROM, "the programs did not split the query heads"
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, None, mask_mod, enable_gqa=True)
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    for label, g, w in zip(("dq", "dk", "dv"), got, want):
        err = ((g.double() - w).norm() / w.norm()).item()
        assert torch.isfinite(g).all() and err < BWD_TOL[torch.bfloat16], (label, err)


LEARNABLE = {  # name -> builder of (score_mod, mask_mod, learnable tensors) for H query heads, length L
    "alibi_slopes": lambda H, L: (lambda t: (lambda s, b, h, q, k: s + t[h] * (k - q), lambda b, h, q, k: q >= k, (t,)))(
        torch.rand(H, device="cuda", requires_grad=True)),
    # gated, so that the per-query term has a gradient (a bias constant along a softmax row has none)
    "row_biases": lambda H, L: (lambda qb, kb: (lambda s, b, h, q, k: s + torch.tanh(s / 4) * (qb[h, q] + kb[k]), None,
                                               (qb, kb)))(
        torch.randn(H, L, device="cuda", requires_grad=True), torch.randn(L, device="cuda", requires_grad=True)),
    # a relative-position table (index q_idx - kv_idx): its gradient summed per diagonal of the tile
    "relative_table": lambda H, L: (lambda t: (lambda s, b, h, q, k: s + t[h, q - k + L - 1], None, (t,)))(
        torch.randn(H, 2 * L - 1, device="cuda", requires_grad=True)),
}


@pytest.mark.parametrize("name", LEARNABLE)
@pytest.mark.parametrize("shape", ["2x3x17", "gqa8:2-1000", "D64-Lq300-Lkv1500"])
def test_gluon_backward_learnable_captures(name, shape, monkeypatch):
    """ATTNCC_TIER=gluon: gradients of learnable captures read by (h), (h, q_idx) and (kv_idx), summed
    over the tile axes their index does not read and added atomically by both consumer warp groups,
    with dq, dk, dv, against float64 autograd."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    B, Hq, Hkv, Lq, Lkv, D = BWD_SHAPES[shape]
    torch.manual_seed(zlib.crc32(f"learn-{name}-{shape}".encode()))
    score_mod, mask_mod, caps = LEARNABLE[name](Hq, max(Lq, Lkv))
    q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    attncc.api._loaded.clear()
    out = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *caps), do)
    assert _bwd_modules("gluon") and not _bwd_modules("triton")
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    want = torch.autograd.grad(ref, (qd, kd, vd, *caps), do.double())
    for i, (g, w) in enumerate(zip(got, want)):
        err = ((g.double() - w.double()).norm() / w.double().norm()).item()
        assert torch.isfinite(g).all() and err < BWD_TOL[torch.bfloat16], (i, err)


@pytest.mark.parametrize("name,D,Hkv", [("causal", 128, 2), ("prefix_lm", 128, 2), ("softcap", 64, 1)])
def test_auto_tier_picks_the_gluon_backward_for_long_sequences(name, D, Hkv, monkeypatch):
    """With no ATTNCC_TIER, a long enough call (tiers.gluon_bwd_pays) runs the Gluon backward and
    a short one the Triton tier's; both against float64 (odd length 4099 past the threshold)."""
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    attncc.api._loaded.clear()
    for L in (4099, 1000):
        torch.manual_seed(L)
        score_mod, mask_mod = BUILDERS[name](1, 2, L, L, "cuda")
        q = torch.randn(1, 2, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=Hkv != 2)
        do = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), do)
        assert bool(_bwd_modules("gluon")) == (L > 4096), (L, _bwd_modules("gluon"))
        qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = attncc.reference.attention(qd, kd, vd, score_mod, mask_mod, enable_gqa=Hkv != 2)
        want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        for label, g, w in zip(("dq", "dk", "dv"), got, want):
            assert torch.isfinite(g).all(), f"{L} {label}: non-finite values"
            err = ((g.double() - w).norm() / w.norm()).item()
            assert err < BWD_TOL[torch.bfloat16], f"{L} {label}: relative error {err:.2e}"
        del ref, want, qd, kd, vd
        attncc.api._loaded.clear()
