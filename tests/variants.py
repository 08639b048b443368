"""The example attention variants the tests run, as (name, builder) pairs.

``builder(B, H, Lq, Lkv, device) -> (score_mod, mask_mod)``: H is the number of query heads
(the ``h`` a mod sees); every captured tensor is created fresh, from torch's global RNG, on
``device``. GQA/MQA is not a variant: the tests cover it through their head configurations.
"""
from __future__ import annotations

import torch

WINDOW = 16
PREFIX = 8
SOFTCAP = 30.0
NUM_DOCS = 4


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def full(B, H, Lq, Lkv, device):
    return None, None


def causal(B, H, Lq, Lkv, device):
    return None, causal_mask


def sliding_window(B, H, Lq, Lkv, device):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)
    return None, sliding_window


def alibi_slopes(H, device):
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device=device)


def alibi(B, H, Lq, Lkv, device):
    slopes = alibi_slopes(H, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi, causal_mask


def softcap(B, H, Lq, Lkv, device):
    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)
    return softcap, None


def document_ids(L, device):
    """Sorted random document ids for L packed positions (NUM_DOCS documents at most)."""
    return torch.sort(torch.randint(0, NUM_DOCS, (L,), device=device)).values


def document(B, H, Lq, Lkv, device):
    ids = document_ids(max(Lq, Lkv), device)
    doc_q, doc_kv = ids[:Lq].clone(), ids[:Lkv].clone()

    def document(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_kv[kv_idx]
    return None, document


def prefix_lm(B, H, Lq, Lkv, device):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < PREFIX) | (q_idx >= kv_idx)
    return None, prefix_lm


def rel_bias(B, H, Lq, Lkv, device):
    """A learnable-style relative position bias table: bias[h, q_idx - kv_idx + Lkv]."""
    bias = 0.5 * torch.randn(H, Lq + Lkv + 1, device=device)

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + Lkv]
    return rel_bias, None


VARIANTS = [
    ("full", full),
    ("causal", causal),
    ("sliding_window", sliding_window),
    ("alibi", alibi),
    ("softcap", softcap),
    ("document", document),
    ("prefix_lm", prefix_lm),
    ("rel_bias", rel_bias),
]
NAMES = [name for name, _ in VARIANTS]
BUILDERS = dict(VARIANTS)
