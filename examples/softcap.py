"""Logit soft-capping (Gemma-2): scores pass through CAP * tanh(score / CAP), so no logit
exceeds CAP (50 for Gemma-2's attention, 30 for its final logits), with a causal mask.

    python examples/softcap.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import banner, bench, check, qkv, shape

CAP = 50.0


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


s = shape()
q, k, v = qkv(s)
q = q * 4  # sharper scores, so that the largest ones actually meet the cap
banner(f"softcap {CAP:g}", s)

kernel = attncc.compile(attncc.Variant(softcap, causal))
out = kernel(q, k, v)

check("softcap", out, q, k, v, softcap, causal)
bench(lambda: kernel(q, k, v),  # SDPA cannot cap; plain causal SDPA shows the cost of the tanh
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sdpa_label="SDPA is_causal, no cap")
