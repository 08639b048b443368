"""Gradients of the generated backward kernels against torch autograd through the float64 reference."""
import pytest
import torch

import attncc
from attncc import plan
from attncc.spec import Spec


def _grads(fn, inputs, do, dlse=None):
    out, lse = fn(*inputs)
    loss = (out.double() * do).sum()
    if dlse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse.double() * dlse, 0.0).sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def check_grads(B, H, Hkv, Lq, Lkv, D, Dv, score_mod=None, mask_mod=None, caps=(), use_lse=False, tol=2e-5):
    torch.manual_seed(B * 1000 + Lq * 7 + Lkv)
    q = torch.randn(B, H, Lq, D, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, Dv, requires_grad=True)
    gqa = H != Hkv
    do = torch.randn(B, H, Lq, Dv, dtype=torch.float64)
    dlse = torch.randn(B, H, Lq, dtype=torch.float64) if use_lse else None
    got = _grads(lambda q, k, v, *c: attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=gqa, return_lse=True),
                 (q, k, v, *caps), do, dlse)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = _grads(lambda q, k, v, *c: attncc.reference.attention(q, k, v, score_mod, mask_mod, enable_gqa=gqa,
                                                                 return_lse=True),
                  (qd, kd, vd, *caps), do, dlse)
    scale = max(w.norm().item() for w in want[:3] if w is not None)
    for name, g, w in zip(["dq", "dk", "dv"] + [f"dcap{i}" for i in range(len(caps))], got, want):
        assert g is not None and w is not None, name
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        err = (g.double() - w.double()).norm().item()
        # a gradient can be ~0 by symmetry (dq with one key; a bias that depends on q_idx only):
        # then compare with the size of the other gradients, never with zero alone
        assert err <= tol * max(w.norm().item(), 0.1 * scale), \
            f"{name}: |err| {err:.3e} vs |ref| {w.norm().item():.3e}"


causal = lambda b, h, q, k: q >= k

SHAPES = [  # B, H, Hkv, Lq, Lkv, D, Dv
    (1, 2, 2, 17, 33, 16, 16),
    (2, 4, 2, 40, 1, 32, 24),
    (1, 4, 1, 1, 40, 16, 16),
    (1, 2, 2, 64, 64, 80, 80),
    (2, 6, 2, 33, 65, 16, 32),
    (1, 2, 1, 64, 33, 16, 16),   # whole query tiles, ragged keys: bounds checks on one side only
    (1, 2, 2, 33, 64, 32, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask", [None, causal], ids=["full", "causal"])
def test_qkv_grads_shapes(shape, mask):
    check_grads(*shape, mask_mod=mask)


SCORE_MODS = {
    "softcap": lambda s, b, h, q, k: 5 * torch.tanh(s / 5),
    "square": lambda s, b, h, q, k: s * s * 0.25,
    "exp": lambda s, b, h, q, k: torch.exp(s * 0.5),
    "abs": lambda s, b, h, q, k: torch.abs(s) - 0.5 * s,
    "piecewise_where": lambda s, b, h, q, k: torch.where(s > 0, 2 * s, torch.exp(s) - 1),
    "sigmoid_gate": lambda s, b, h, q, k: s * torch.sigmoid(s),
    "clamp": lambda s, b, h, q, k: torch.clamp(s, -1.0, 1.5),
}


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_derivatives(name):
    check_grads(1, 2, 2, 37, 45, 16, 16, score_mod=SCORE_MODS[name], mask_mod=causal)


# d score_mod / d score over score_mod's value, which the Gluon backward recomputes from P at head dims
# above 64 (plan.dscore_late): the rewrite where it exists, checked at numbers, and where it must not exist
OF_VALUE = {**SCORE_MODS, "softcap_alibi": lambda s, b, h, q, k: 20 * torch.tanh(s / 20) + 0.1 * (q - k),
            "sigmoid": lambda s, b, h, q, k: 3 * torch.sigmoid(2 * s), "sin": lambda s, b, h, q, k: torch.sin(s),
            "tanh_per_query": lambda s, b, h, q, k: (q + 1) * torch.tanh(s),
            "tanh_tanh": lambda s, b, h, q, k: torch.tanh(torch.tanh(s)),
            "small_cap": lambda s, b, h, q, k: 0.05 * torch.tanh(s / 0.05)}  # B < 0.1: the value's error / B


@pytest.mark.parametrize("name", sorted(OF_VALUE))
def test_dscore_over_the_value(name):
    import math
    from attncc.passes import derive
    from attncc.passes.symbolic import B, H, KV, Q, SCORE
    score = attncc.Variant(OF_VALUE[name]).analysis.score
    dscore = derive.derive(score).dscore
    got = derive.dscore_of_value(score, dscore)
    rewritten = {"softcap", "exp", "softcap_alibi", "sigmoid"}  # score_mod = A + B f(u), f' over f, B a number
    assert (got is not None) == (name in rewritten), got
    if got is None:
        return
    assert SCORE not in got.free_symbols
    for s in (-7.0, -0.5, 0.25, 3.0):
        at = {SCORE: s, Q: 11, KV: 4, B: 0, H: 1}
        value_log2 = float(score.subs(at)) * math.log2(math.e)
        assert float(got.subs({**at, derive.SCORE_MOD_LOG2: value_log2})) == pytest.approx(float(dscore.subs(at)),
                                                                                        rel=1e-9, abs=1e-12)
    spec = lambda d: Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon")  # noqa: E731
    variant = attncc.Variant(OF_VALUE[name])
    at_128 = plan.build("bwd", variant.analysis, spec(128))
    assert at_128.dscore_late and [n for n, _ in at_128.mods["attn_bwd_dkdv"].late][-1:] == ["dscore"]
    assert not any("score_mod_log2" in text for _, text in at_128.mods["attn_bwd_dkdv"].body)
    assert not plan.build("bwd", variant.analysis, spec(64)).dscore_late  # no spills there: dscore kept


@pytest.mark.parametrize("mask,flat", [(causal, True), (lambda b, h, q, k: (q >= k) & (q - k < 5 + 7 * h), False)],
                         ids=["causal", "window_per_head"])
def test_gqa_dkdv_loop_forms(mask, flat):
    """GQA dK/dV: one loop over (query tile, head) pairs when the mask's tiles do not depend on h,
    else tile loops inside a loop over the group's heads; both against the reference."""
    spec = Spec("float32", 16, 16, 3, "interpreter")
    assert plan.build("bwd", attncc.Variant(mask_mod=mask).analysis, spec).flat_group == flat
    check_grads(2, 6, 2, 45, 70, 16, 16, mask_mod=mask)
    check_grads(1, 3, 1, 1, 33, 16, 16, mask_mod=mask)


def test_lse_gradient_flows():
    check_grads(2, 2, 2, 33, 40, 16, 16, mask_mod=lambda b, h, q, k: q + 3 >= k, use_lse=True)


def test_window_document_prefix_masks():
    doc = torch.tensor([0] * 20 + [1] * 15 + [2] * 30)
    check_grads(1, 2, 2, 65, 65, 16, 16, mask_mod=lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k))
    check_grads(1, 2, 2, 65, 65, 16, 16, mask_mod=lambda b, h, q, k: (q >= k) & (q - k < 9))
    check_grads(1, 2, 2, 65, 65, 16, 16, mask_mod=lambda b, h, q, k: (k < 8) | (q >= k))


def test_learnable_alibi_slopes():
    slopes = torch.rand(4, requires_grad=True)
    check_grads(2, 4, 2, 40, 40, 16, 16, score_mod=lambda s, b, h, q, k: s + slopes[h] * (k - q),
                mask_mod=causal, caps=(slopes,))


def test_learnable_relative_bias_table():
    L = 50
    table = (0.5 * torch.randn(2, 2 * L + 1)).requires_grad_()
    check_grads(1, 2, 2, 50, 50, 16, 16, score_mod=lambda s, b, h, q, k: s + table[h, q - k + L],
                mask_mod=causal, caps=(table,))


@pytest.mark.parametrize("L", [128, 100])
def test_captures_read_inside_lose_their_bounds_masks(L):
    """At whole-tile lengths (128) every index of the table and of the document ids stays inside
    them: their loads compile without bounds masks (checks.captures_in_range), and the gradients,
    the table's summed per diagonal included, still match the reference. At 100 positions the
    ragged tile's rows past the end read outside, and the masks stay."""
    from attncc import autograd, checks
    torch.manual_seed(L)
    table = (0.5 * torch.randn(2, 2 * L - 1)).requires_grad_()
    docs = torch.sort(torch.randint(0, 3, (L,))).values
    mod = lambda s, b, h, q, k: s + table[h, q - k + L - 1]
    mask = lambda b, h, q, k: (docs[q] == docs[k]) & (q >= k)
    variant = attncc.Variant(mod, mask)
    q = torch.randn(1, 2, L, 16)
    inside = checks.captures_in_range(variant, q, q, [table, docs])
    assert inside == ((0, 1) if L == 128 else ())
    spec = autograd._launch(attncc.compile(variant), q, q, q, [table, docs], None, None, 0.0, False).spec
    assert spec.in_range == inside
    check_grads(1, 2, 2, L, L, 16, 16, score_mod=mod, mask_mod=mask, caps=(table,))


@pytest.mark.parametrize("Lq, Lkv, group", [(50, 50, 1), (37, 70, 2), (70, 33, 1)])
def test_learnable_relative_table_summed_per_diagonal(Lq, Lkv, group):
    """Indices that read q_idx - kv_idx only take the per-diagonal reduction; the table is too
    short for the farthest diagonals on purpose (they read 0 and get no gradient), and a
    clamped bucket index maps many diagonals to one entry."""
    table = (0.5 * torch.randn(4, 60)).requires_grad_()
    buckets = (0.5 * torch.randn(4, 9)).requires_grad_()
    mod = lambda s, b, h, q, k: (s + table[h, q - k + 30]
                                 + buckets[h, torch.clamp(q - k, -4, 4) + 4])
    check_grads(1, 4, 4 // group, Lq, Lkv, 16, 16, score_mod=mod, caps=(table, buckets))
    grads = plan.build("bwd", attncc.Variant(mod).analysis, Spec("float32", 16, 16, 1, "interpreter",
                                                                learnable=(0, 1))).grads
    assert [g.reduce for g in grads] == ["diag", "diag"]


def test_learnable_gate_and_bias_mixed_sites():
    gate = torch.randn(2, 40, requires_grad=True)
    kbias = torch.randn(2, 40, requires_grad=True)
    check_grads(1, 2, 2, 40, 40, 16, 16,
                score_mod=lambda s, b, h, q, k: s * torch.sigmoid(gate[h, q]) + kbias[h, k] + gate[h, k] * 0.1,
                caps=(gate, kbias))


def test_learnable_dense_bias():
    bias = (0.3 * torch.randn(2, 2, 30, 20)).requires_grad_()
    check_grads(2, 2, 2, 30, 20, 16, 16, score_mod=lambda s, b, h, q, k: s + bias[b, h, q, k], caps=(bias,))


def test_learnable_runtime_scalar():
    temp = torch.tensor(0.7, requires_grad=True)
    check_grads(1, 2, 2, 30, 30, 16, 16, score_mod=lambda s, b, h, q, k: s * temp, caps=(temp,))


def test_deterministic_mode_bitwise():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 70, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 4, 70, 16)
    runs = []
    for _ in range(2):
        out = attncc.attention(q, k, v, mask_mod=causal, deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_deterministic_learnable_captures_bitwise_and_accurate():
    """Capture gradients in deterministic mode: int64 fixed point, so two runs agree bit for bit."""
    L = 50
    slopes = torch.rand(2, requires_grad=True)
    table = (0.5 * torch.randn(2, 2 * L + 1)).requires_grad_()
    mod = lambda s, b, h, q, k: s + slopes[h] * (k - q) * 0.1 + table[h, q - k + L]
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, L, 16, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, L, 16)
    runs = [torch.autograd.grad(attncc.attention(q, k, v, mod, causal, deterministic=True), (q, k, v, slopes, table), do)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    want = torch.autograd.grad(attncc.attention(q, k, v, mod, causal), (slopes, table), do)
    for a, b in zip(runs[0][3:], want):
        assert (a - b).abs().max().item() < 1e-6



def test_integer_captures_get_no_gradient():
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    out = attncc.attention(q, k, v, mask_mod=lambda b, h, qi, ki: doc[qi] == doc[ki])
    out.sum().backward()
    assert doc.grad is None and q.grad is not None


@pytest.mark.parametrize("shape", [(1, 2, 2, 33, 65, 16, 16), (2, 4, 2, 40, 17, 32, 24)], ids=["mha_ragged", "gqa"])
def test_atomic_dq_option(monkeypatch, shape):
    """ATTNCC_BWD_DQ=atomic: dQ summed by relaxed atomic adds from the dK/dV programs (the measured
    alternative to the dQ programs) gives the same gradients."""
    monkeypatch.setenv("ATTNCC_BWD_DQ", "atomic")
    variant = attncc.Variant(mask_mod=causal)
    assert attncc.compile(variant).bwd_spec(Spec("float32", 16, 16, 1, "interpreter"), ()).atomic_dq
    check_grads(*shape, mask_mod=causal)


def test_autograd_node_only_when_something_needs_a_gradient():
    """Calls with nothing to differentiate skip the autograd Function (host time) and give the
    same numbers; a learnable captured tensor alone still gets its node and its gradient."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 17, 24) for _ in range(3))
    bias = torch.randn(2)

    def score(s, b, h, q_idx, kv_idx):
        return s + bias[h]

    with torch.no_grad():
        plain = attncc.attention(q, k, v, score)
    assert plain.grad_fn is None
    tracked = attncc.attention(q.clone().requires_grad_(), k, v, score)
    assert tracked.grad_fn is not None
    torch.testing.assert_close(plain, tracked.detach(), rtol=0, atol=0)
    want = attncc.reference.attention(q.double(), k.double(), v.double(), score)
    torch.testing.assert_close(plain.double(), want, rtol=2e-5, atol=2e-5)

    bias.requires_grad_()
    out = attncc.attention(q, k, v, score)
    assert out.grad_fn is not None
    out.sum().backward()
    assert bias.grad is not None and torch.isfinite(bias.grad).all() and bias.grad.abs().sum() > 0
