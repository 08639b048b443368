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
