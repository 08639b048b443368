"""Sliding-window causal attention (Mistral, Gemma-2 local layers): each query sees the
WINDOW most recent keys, itself included.

    python examples/sliding_window.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import GPU, banner, bench, check, qkv, shape

WINDOW = 1024 if GPU else 64


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


s = shape()
q, k, v = qkv(s)
banner(f"sliding window {WINDOW}", s)

kernel = attncc.compile(attncc.Variant(mask_mod=sliding_window))
out = kernel(q, k, v)

check("sliding_window", out, q, k, v, mask_mod=sliding_window)
i = torch.arange(s.L, device=q.device)
dense = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW)  # (L, L) for SDPA
bench(lambda: kernel(q, k, v),
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), sdpa_label="SDPA dense mask")
