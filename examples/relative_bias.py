"""Learned relative-position bias (T5 / Swin style, unbucketed): each head has a row of 2L - 1
biases indexed by the distance q_idx - kv_idx. The table is a captured tensor, read in place:
training it changes no kernel.

    python examples/relative_bias.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import DEVICE, banner, bench, check, qkv, shape

s = shape()
L = s.L
bias = torch.nn.Parameter(0.5 * torch.randn(s.H, 2 * L - 1, device=DEVICE))  # learnable (H, 2L - 1)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, q_idx - kv_idx + L - 1]


q, k, v = qkv(s)
banner("relative bias", s)

kernel = attncc.compile(attncc.Variant(relative_bias))
with torch.no_grad():  # forward only here: no autograd bookkeeping in the timings
    out = kernel(q, k, v)
    check("relative_bias", out, q, k, v, relative_bias)
    i = torch.arange(L, device=DEVICE)
    dense = bias[:, i[:, None] - i[None, :] + L - 1].to(s.dtype)  # (H, L, L) for SDPA
    bench(lambda: kernel(q, k, v),
          sdpa=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), sdpa_label="SDPA dense bias")
