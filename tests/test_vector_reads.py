"""Vector reads: a captured tensor indexed with fewer indices than its rank is a short row whose
elementwise math and reductions (sum, mean, amax, dot, @, norm) work inside mods, with gradients
into learnable captures; compared with the float64 reference."""
from __future__ import annotations

import pytest
import torch

import attncc
from conftest import check, randn_qkv
from test_backward import check_grads

B, H, L, D, R = 1, 2, 20, 16, 6  # R: length of the rows read as vectors


def _learnable(*shape, scale=0.5, seed=0):
    torch.manual_seed(seed)
    return (scale * torch.randn(*shape)).requires_grad_()


def _forward_and_grads(score_mod=None, mask_mod=None, caps=()):
    torch.manual_seed(1)
    q, k, v = randn_qkv(B, H, H, L, L, D)
    _, _, err = check(q, k, v, score_mod, mask_mod)
    check_grads(B, H, H, L, L, D, D, score_mod=score_mod, mask_mod=mask_mod, caps=caps, use_lse=True)
    return err


def test_mla_decoupled_rope_dot():
    """MLA-style decoupled RoPE: a learned per-position query and key row, dotted per score."""
    q_rope, k_rope = _learnable(L, R, seed=1), _learnable(L, R, seed=2)
    _forward_and_grads(lambda s, b, h, q_idx, kv_idx: s + torch.dot(q_rope[q_idx], k_rope[kv_idx]),
                       caps=(q_rope, k_rope))


def test_learned_embedding_distance():
    a, e = _learnable(L, R, seed=3), _learnable(L, R, seed=4)
    _forward_and_grads(lambda s, b, h, q_idx, kv_idx: s - (a[q_idx] - e[kv_idx]).pow(2).sum(-1).sqrt(),
                       caps=(a, e))


_E = _learnable(H, L, R, seed=5)
REDUCTIONS = {
    "product_sum": lambda s, b, h, q, k: s + (_E[h, q] * _E[h, k]).sum(),
    "mean": lambda s, b, h, q, k: s + torch.tanh(_E[h, q] - _E[h][k]).mean(),
    "amax": lambda s, b, h, q, k: s + (_E[h, q] * _E[h, k]).amax(dim=-1),
    "matmul": lambda s, b, h, q, k: s + _E[h, q] @ _E[h, k],
    "norm": lambda s, b, h, q, k: s - 0.5 * torch.norm(_E[h, q] - _E[h, k] + 0.1),
    "elementwise_max": lambda s, b, h, q, k: s + torch.max(_E[h, q], 0.5 * _E[h, k]).sum(),
    "scalar_mix": lambda s, b, h, q, k: s + (torch.exp(_E[h, q]) * s - 2.0 / (1 + _E[h, k] ** 2)).sum() / 8,
}


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reductions(name):
    _forward_and_grads(REDUCTIONS[name], caps=(_E,))


def test_mask_mod_with_vector_reduction():
    emb = torch.randn(L, R)
    mask = lambda b, h, q_idx, kv_idx: (torch.dot(emb[q_idx], emb[kv_idx]) > 0) | (q_idx == kv_idx)
    alibi = lambda s, b, h, q_idx, kv_idx: s + 0.1 * (kv_idx - q_idx)
    _forward_and_grads(alibi, mask)


def test_element_of_a_vector_and_chained_full_index():
    """v[j] is one element; bias[h][q_idx][kv_idx] reaches full rank through a large row."""
    rows, bias = torch.randn(L, R), torch.randn(H, 200, 200)
    variant = attncc.Variant(lambda s, b, h, q, k: s + (2 * rows[q])[1] + rows[k][0] + bias[h][q][k])
    text = str(variant)
    assert "[q_idx, 1]" in text and "[kv_idx, 0]" in text and "[h, q_idx, kv_idx]" in text
    assert text.count("[q_idx, ") == 1  # only the element read is loaded


def test_row_too_long():
    table = torch.randn(4, 200)
    with pytest.raises(attncc.AttnccError, match=r"row of 200 elements.*at most 128"):
        attncc.Variant(lambda s, b, h, q_idx, kv_idx: s + table[h].sum())


@pytest.mark.parametrize("op", ["cumsum", "max_dim", "attribute", "lengths", "returned", "python_sum"])
def test_unsupported_on_a_vector(op):
    rows, other = torch.randn(L, R), torch.randn(L, R + 1)
    mods = {"cumsum": lambda s, b, h, q, k: s + torch.cumsum(rows[q], 0).sum(),
            "max_dim": lambda s, b, h, q, k: s + rows[q].max(-1),
            "attribute": lambda s, b, h, q, k: s + rows[q].softmax(0).sum(),
            "lengths": lambda s, b, h, q, k: s + torch.dot(rows[q], other[k]),
            "returned": lambda s, b, h, q, k: s + rows[q],
            "python_sum": lambda s, b, h, q, k: s + sum(rows[q])}
    with pytest.raises(attncc.AttnccError, match=r"<lambda>.*test_vector_reads.py:\d+.*(supported on a vector|reduce it)"):
        attncc.Variant(mods[op])


# --- row products: a query's row dotted with a key's row becomes one tile product --------------
# (attncc.passes.rowdots; _row_dot in templates/header.py.jinja). R2 is neither a power of
# two nor 16, so the padding to 16 columns is exercised; the tensors are rows per head and position.
R2 = 12
_QR, _KR = torch.randn(H, 40, R2), torch.randn(H, 40, R2)
_QB, _KB = _QR.to(torch.bfloat16), _KR.to(torch.bfloat16)
ROW_DOTS = {  # name -> (score_mod, whether the kernels take the tile product)
    "dot": (lambda s, b, h, q, k: s + 0.3 * torch.dot(_QR[h, q], _KR[h, k]), True),
    "matmul_keys_first": (lambda s, b, h, q, k: s - _KR[h, k] @ _QR[h, q] / 4, True),
    "product_sum_bf16": (lambda s, b, h, q, k: s + 0.3 * (_QB[h, q] * _KB[h, k]).sum(), True),
    "mixed_dtypes": (lambda s, b, h, q, k: s + 0.3 * torch.dot(_QB[h, q], _KR[h, k]), True),
    "shifted_rows": (lambda s, b, h, q, k: s + 0.3 * torch.dot(_QR[h, q + 3], _KR[h, (k * 2) % 40]), True),
    "two_terms": (lambda s, b, h, q, k: torch.tanh(torch.dot(_QR[h, q], _KR[h, k]) / 8) * 8 + s
                  + 0.1 * torch.dot(_KR[h, q], _QR[h, k]), True),
    "both_rows_per_query": (lambda s, b, h, q, k: s + 0.3 * torch.dot(_QR[h, q], _KR[h, q]), False),
    "first_two_elements": (lambda s, b, h, q, k: s + _QR[h, q][0] * _KR[h, k][0] + _QR[h, q][1] * _KR[h, k][1], True),
    "gapped_elements": (lambda s, b, h, q, k: s + _QR[h, q][0] * _KR[h, k][0] + _QR[h, q][2] * _KR[h, k][2], False),
}


def _kernel_texts(score_mod):
    from attncc import codegen, plan
    from attncc.spec import Spec
    variant = attncc.Variant(score_mod)
    return [codegen.render(plan.build(kind, variant.analysis, Spec("float32", D, D, 1, "interpreter"),
                                      variant.captures)) for kind in ("fwd", "bwd", "kv")]


@pytest.mark.parametrize("name", ROW_DOTS)
def test_row_products_become_tile_products(name):
    """The kernels compute a query row . key row as _row_dot where the pattern holds (and not
    otherwise), and the results, forward, lse and gradients, match the float64 reference at odd
    lengths, with Lq != Lkv and GQA."""
    score_mod, tiled = ROW_DOTS[name]
    assert all(("_row_dot(" in text) == tiled for text in _kernel_texts(score_mod))
    torch.manual_seed(2)
    for hq, hkv, lq, lkv in ((H, H, 17, 17), (H, 1, 1, 33), (H, H, 37, 21)):
        q, k, v = randn_qkv(B, hq, hkv, lq, lkv, D)
        check(q, k, v, score_mod, enable_gqa=hq != hkv)
    check_grads(B, H, 1, 23, 30, D, D, score_mod=score_mod, use_lse=True)


def test_row_products_of_learnable_rows():
    """Learnable rows: the forward takes the tile product, their gradients the per-element
    derivatives (the products stay in the IR)."""
    q_rope, k_rope = _learnable(L, R2, seed=6), _learnable(L, R2, seed=7)
    score_mod = lambda s, b, h, q_idx, kv_idx: s + torch.dot(q_rope[q_idx], k_rope[kv_idx])  # noqa: E731
    assert "_row_dot(" in _kernel_texts(score_mod)[0]
    _forward_and_grads(score_mod, caps=(q_rope, k_rope))


def test_row_products_in_the_decode_kernel():
    """Few queries (rows shorter than 16): _row_dot falls back to R multiply-adds per score."""
    from attncc import inference
    score_mod = ROW_DOTS["dot"][0]
    torch.manual_seed(3)
    q, k, v = torch.randn(B, H, 2, D), torch.randn(B, 1, 40, D), torch.randn(B, 1, 40, D)
    out, lse = inference.decode(attncc.compile(attncc.Variant(score_mod)), q, k, v, enable_gqa=True,
                                return_lse=True)
    ref, ref_lse = attncc.reference.attention(q.double(), k.double(), v.double(), score_mod, enable_gqa=True,
                                              return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-4 and (lse.double() - ref_lse).abs().max() < 1e-4


def test_row_products_stay_products_before_sm80():
    """tl.dot of bf16 rows and tf32x3 want sm80 or later: older targets keep the R products."""
    from attncc import codegen, plan
    from attncc.spec import Spec
    variant = attncc.Variant(ROW_DOTS["dot"][0])
    for target, tiled in (("cuda-sm75", False), ("cuda-sm80", True)):
        text = codegen.render(plan.build("fwd", variant.analysis, Spec("float16", D, D, 1, target), variant.captures))
        assert ("_row_dot(" in text) == tiled, target
