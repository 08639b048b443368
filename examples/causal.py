"""Causal attention: each query sees itself and the keys before it.

    python examples/causal.py
"""
import torch.nn.functional as F

import attncc
from _common import banner, bench, check, qkv, shape


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


s = shape()
q, k, v = qkv(s)
banner("causal", s)

kernel = attncc.compile(attncc.Variant(mask_mod=causal))
out = kernel(q, k, v)

check("causal", out, q, k, v, mask_mod=causal)
bench(lambda: kernel(q, k, v),
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sdpa_label="SDPA is_causal")
