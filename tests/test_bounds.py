"""The tile bounds derived from mask predicates (passes/bounds.py) against brute force."""
import random

import pytest
import sympy as sp
import torch

import attncc
from attncc.passes import bounds
from attncc.passes.symbolic import KV, Q

LO, HI = sp.symbols("lo hi", integer=True)
H = sp.Symbol("h", integer=True, nonnegative=True)

MASKS = {
    "causal": lambda b, h, q, k: q >= k,
    "sliding": lambda b, h, q, k: (q >= k) & (q - k < 7),
    "prefix_lm": lambda b, h, q, k: (k < 5) | (q >= k),
    "not_greater": lambda b, h, q, k: ~(k > q),
    "bottom_right": lambda b, h, q, k: q + 9 >= k,
    "dilated_causal": lambda b, h, q, k: ((q - k) % 2 == 0) & (q >= k),
    "band_scaled": lambda b, h, q, k: (2 * q >= k) & (k + 3 > q),
    "diagonal": lambda b, h, q, k: q == k,
    "not_diagonal": lambda b, h, q, k: q != k,
    "query_rows_only": lambda b, h, q, k: q >= 10,
    "xor_of_halves": lambda b, h, q, k: (q >= k) ^ (k < 3),
    "per_head_window": lambda b, h, q, k: (q >= k) & (q - k <= 2 * h + 1),
    "or_of_windows": lambda b, h, q, k: ((q >= k) & (q - k < 3)) | ((k >= q) & (k - q < 2)),
    "symmetric_window": lambda b, h, q, k: (q - k).abs() <= 5,
    "symmetric_window_strict": lambda b, h, q, k: 4 > torch.abs(k - q),
    "outside_a_band": lambda b, h, q, k: (q - k).abs() > 3,
    "two_diagonals": lambda b, h, q, k: (q - k).abs() == 2,
    "off_two_diagonals": lambda b, h, q, k: (k - q).abs() != 2,
    "outside_or_on_a_band": lambda b, h, q, k: 3 <= (q - k).abs(),
}


def _value(expr, env):
    v = expr.subs(env)
    return float(v) if v.is_number else None


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("outer", ["q", "kv"])
def test_bounds_are_conservative(name, outer):
    fn = MASKS[name]
    mask = attncc.Variant(mask_mod=fn).analysis.mask
    o, i = (Q, KV) if outer == "q" else (KV, Q)
    tb = bounds.derive(mask, o, i, LO, HI)
    rng = random.Random(0)
    for _ in range(25):
        h = rng.randint(0, 3)
        lo = rng.randint(0, 30)
        hi = lo + rng.randint(0, 7)
        env = {LO: lo, HI: hi, H: h}
        r0, r1, f0, f1 = (_value(e, env) for e in (tb.reach.first, tb.reach.last, tb.full.first, tb.full.last))
        for inner in range(-3, 50):
            pairs = [(x, inner) if outer == "q" else (inner, x) for x in range(lo, hi + 1)]
            attends = [bool(fn(0, h, torch.tensor(qq), torch.tensor(kk))) for qq, kk in pairs]
            if any(attends):
                assert r0 <= inner <= r1, (name, outer, lo, hi, h, inner, tb.reach)
            if f0 <= inner <= f1:
                assert all(attends), (name, outer, lo, hi, h, inner, tb.full)


def test_bounds_are_tight_for_causal_and_window():
    m = attncc.Variant(mask_mod=MASKS["sliding"]).analysis.mask
    tb = bounds.derive(m, Q, KV, LO, HI)
    assert (tb.reach.first, tb.reach.last) == (LO - 6, HI)
    assert (tb.full.first, tb.full.last) == (HI - 6, LO)


# masks each of whose rows is one interval of the other index, which row_interval must find
ROW_INTERVALS = {"causal", "sliding", "prefix_lm", "not_greater", "bottom_right", "band_scaled", "diagonal",
                 "query_rows_only", "per_head_window", "symmetric_window", "symmetric_window_strict"}


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("outer", ["q", "kv"])
def test_row_interval_is_exact_or_none(name, outer):
    """row_interval (the kernels' masked steps compare each score's index with its row's
    ends instead of evaluating mask_mod) holds exactly the indices the mask keeps, or is None."""
    fn = MASKS[name]
    o, i = (Q, KV) if outer == "q" else (KV, Q)
    iv = bounds.row_interval(attncc.Variant(mask_mod=fn).analysis.mask, o, i)
    if iv is None:
        assert name not in ROW_INTERVALS, (name, outer)
        return
    for h in range(4):
        for x in range(0, 40):
            first, last = (_value(e, {o: x, H: h}) for e in (iv.first, iv.last))
            for inner in range(-3, 50):
                qq, kk = (x, inner) if outer == "q" else (inner, x)
                keeps = bool(fn(0, h, torch.tensor(qq), torch.tensor(kk)))
                assert keeps == (first <= inner <= last), (name, outer, h, x, inner, iv)


def test_plans_mask_by_row_ends():
    """The Gluon kernels' masked steps take the row interval where there is one, in terms of their
    outer index, and keep mask_mod's expression where there is none; the Triton tier's kernels print
    mask_mod as the interval of their loop's index."""
    from attncc import codegen, plan
    from attncc.spec import Spec
    spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon")
    window = attncc.Variant(mask_mod=MASKS["sliding"])
    fwd = plan.build("fwd", window.analysis, spec)
    bwd = plan.build("bwd", window.analysis, spec)
    assert (fwd.row_keep.first, fwd.row_keep.end) == ("q_idx - 6", "q_idx + 1")
    assert (bwd.row_keep.first, bwd.row_keep.end) == ("kv_idx", "kv_idx + 7")
    source = codegen.render(fwd)  # a band: compared relative to the thread's first key (plan.lane_compares)
    assert "valid = (cols - lane) < gl.minimum(q_idx + 1, p.N_CTX_KV) - key0" in source
    assert "valid = valid & ((cols - lane) >= q_idx - 6 - key0)" in source
    causal = plan.build("fwd", attncc.Variant(mask_mod=MASKS["causal"]).analysis, spec)
    assert "valid = (kv_idx < p.N_CTX_KV) & (kv_idx < q_idx + 1)" in codegen.render(causal)  # as kv_idx
    assert "q_first = gl.zeros_like(kv_idx) + (kv_idx)" in codegen.render(bwd)
    dilated = attncc.Variant(mask_mod=MASKS["dilated_causal"])
    for kernel in ("fwd", "bwd"):
        p = plan.build(kernel, dilated.analysis, spec)
        assert p.row_keep is None and "keep = " in codegen.render(p)
    triton_fwd = plan.build("fwd", window.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90"))
    triton_bwd = plan.build("bwd", window.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90"))
    assert triton_fwd.row_keep is None
    keep = lambda p, fn: dict(p.mods[fn].body)["keep"]  # noqa: E731
    assert keep(triton_fwd, "attn_fwd") == keep(triton_bwd, "attn_bwd_dq") == "((kv_idx <= q_idx) & (kv_idx >= q_idx - 6))"
    assert keep(triton_bwd, "attn_bwd_dkdv") == "((q_idx >= kv_idx) & (q_idx <= kv_idx + 6))"
    assert "_floor_mod" in keep(plan.build("fwd", dilated.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90")), "attn_fwd")


def test_gluon_forward_band_width():
    """The Gluon forward's plan.band (the launcher runs one program per SM over the tiles where the
    band is narrow beside the keys): the width of a constant window, 0 where it is none."""
    from attncc import plan
    from attncc.spec import Spec
    spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon")
    band = lambda mask: plan.build("fwd", attncc.Variant(mask_mod=mask).analysis, spec).band  # noqa: E731
    assert band(MASKS["sliding"]) == 7
    assert band(lambda b, h, q, k: (q >= k) & (q - k < 1024)) == 1024
    assert band(lambda b, h, q, k: (q - k).abs() <= 200) == 401
    assert band(lambda b, h, q, k: (k >= q + 90) & (k < q + 100)) == 10
    for mask in (MASKS["causal"], lambda b, h, q, k: (q >= k) & (q - k < 150 * (h + 1)), MASKS["dilated_causal"],
                 lambda b, h, q, k: (k < 70) | (q >= k)):
        assert band(mask) == 0
    assert plan.build("fwd", attncc.Variant(mask_mod=MASKS["sliding"]).analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90")).band == 0


def test_symmetric_window_skips_tiles():
    """abs(q_idx - kv_idx) <= w bounds the tiles like the band it is (it gave no bounds at all, so
    every tile ran with the mask), and the kernels' results stay the reference's, forward and
    backward, at an odd length with several tiles on each side of the band."""
    fn = MASKS["symmetric_window"]
    tb = bounds.derive(attncc.Variant(mask_mod=fn).analysis.mask, Q, KV, LO, HI)
    assert (tb.reach.first, tb.reach.last, tb.full.first, tb.full.last) == (LO - 5, HI + 5, HI - 5, LO + 5)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 301, 16, requires_grad=True) for _ in range(3))
    out = attncc.attention(q, k, v, mask_mod=fn)
    ref = attncc.reference.attention(*(x.double() for x in (q, k, v)), mask_mod=fn)
    assert (out.double() - ref).abs().max().item() < 1e-4
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, mask_mod=fn), (qd, kd, vd), torch.ones_like(ref))
    for g, w in zip(grads, want):
        assert torch.isfinite(g).all() and (g.double() - w).abs().max().item() < 1e-3


def test_full_tiles_of_an_or_with_a_condition_on_the_outer_index():
    """Prefix-LM from a K/V tile: a tile inside the prefix is attended by every query, so the dK/dV
    loop runs no mask code on it; past the prefix, queries from the tile's last key on. The join
    of an all-or-nothing part with another interval is exact, not the narrower part."""
    m = attncc.Variant(mask_mod=MASKS["prefix_lm"]).analysis.mask
    full = bounds.derive(m, KV, Q, LO, HI).full
    for lo, hi, want in [(0, 3, (-sp.oo, sp.oo)), (0, 4, (-sp.oo, sp.oo)), (2, 5, (5, sp.oo)), (8, 11, (11, sp.oo))]:
        assert (full.first.subs({LO: lo, HI: hi}), full.last.subs({LO: lo, HI: hi})) == want, (lo, hi)
    rows = bounds.derive(attncc.Variant(mask_mod=MASKS["query_rows_only"]).analysis.mask, KV, Q, LO, HI).full
    assert (rows.first, rows.last) == (10, sp.oo)


def test_block_classes_of_a_data_dependent_mask_match_brute_force():
    from attncc import blocks
    doc = torch.tensor([0] * 40 + [1] * 25 + [2] * 70)
    L = doc.numel()
    mask = lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)
    kernel = attncc.compile(attncc.Variant(mask_mod=mask))
    q = torch.randn(1, 2, L, 16)
    kernel(q, q, q)  # builds the modules
    fwd = [m for (key, kind, _), (_, m) in attncc.api._loaded.items()
           if key == kernel.variant.ir_key and kind == "fwd"][0]
    assert fwd.BLOCK_SPARSE and not fwd.CLASS_PER_HEAD
    fine = blocks.fine_classes(fwd, [doc], 1, 2, L, L, False, "cpu")
    dense = (doc[:, None] == doc[None, :]) & (torch.arange(L)[:, None] >= torch.arange(L)[None, :])
    F = blocks.FINE
    for i in range(fine.shape[1]):
        for j in range(fine.shape[2]):
            tile = dense[i * F:(i + 1) * F, j * F:(j + 1) * F]
            want = 0 if not tile.any() else (2 if tile.all() and tile.numel() == F * F else 1)
            assert fine[0, i, j].item() == want, (i, j)


def test_changed_document_ids_reclassify():
    doc = torch.tensor([0] * 50 + [1] * 50)
    mask = lambda b, h, q, k: doc[q] == doc[k]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    kernel = attncc.compile(attncc.Variant(mask_mod=mask))
    a = kernel(q, k, v)
    doc[:] = torch.tensor([0] * 20 + [1] * 80)  # in place: same tensor, new contents
    b = kernel(q, k, v)
    ref = attncc.reference.attention(q.double(), k.double(), v.double(), mask_mod=mask)
    assert ((b.double() - ref).norm() / ref.norm()).item() < 1e-5
    assert not torch.allclose(a, b)


def test_two_document_layouts_of_one_mask_structure_keep_their_own_tiles():
    """Variants of one structure share generated modules; each call's tile lists must come from
    its own captured tensor (blocks.for_module remembers the last lists per module and lengths)."""
    def doc_mask(doc):
        return lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)
    docs = [torch.tensor([0] * 70 + [1] * 30), torch.tensor([0] * 10 + [1] * 90)]
    kernels = [attncc.compile(attncc.Variant(mask_mod=doc_mask(d))) for d in docs]
    assert kernels[0].variant.ir_key == kernels[1].variant.ir_key
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 100, 16) for _ in range(3))
    for i in (0, 1, 0, 1):
        ref = attncc.reference.attention(q.double(), k.double(), v.double(), mask_mod=doc_mask(docs[i]))
        out = kernels[i](q, k, v)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5, i


def test_per_head_data_dependent_mask():
    keep_from = torch.tensor([0, 30, 64])  # head h attends keys >= keep_from[h]
    mask = lambda b, h, q, k: (k >= keep_from[h]) & (q >= k)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 97, 16, requires_grad=True) for _ in range(3))
    out = attncc.attention(q, k, v, mask_mod=mask)
    ref = attncc.reference.attention(q.double(), k.double(), v.double(), mask_mod=mask)
    ok = torch.isfinite(ref)
    assert torch.allclose(out.double()[ok], ref[ok], atol=1e-5)
    do = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    gr = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, mask_mod=mask), (qd, kd, vd), do.double())
    for a, b in zip(g, gr):
        assert ((a.double() - b).norm() / b.norm()).item() < 1e-5


def test_explain_shows_the_derived_tile_ranges():
    text = attncc.compile(attncc.Variant(mask_mod=MASKS["sliding"])).explain()
    assert "reaches keys [q_lo - 6, q_hi]" in text and "every key in [q_hi - 6, q_lo]" in text
    assert "keeps exactly the keys [q_idx - 6, q_idx]" in text
    assert "not one interval" in attncc.compile(attncc.Variant(mask_mod=MASKS["dilated_causal"])).explain()
    doc = torch.zeros(8, dtype=torch.long)
    text = attncc.compile(attncc.Variant(mask_mod=lambda b, h, q, k: doc[q] == doc[k])).explain()
    assert "block_classes" in text
