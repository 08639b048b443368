"""ALiBi (Press et al., 2022): a per-head linear penalty on distance instead of position
embeddings, with a causal mask. The slopes are a captured tensor: the kernel reads it in place.

    python examples/alibi.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import DEVICE, banner, bench, check, qkv, shape

s = shape()
slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / s.H) for i in range(s.H)], device=DEVICE)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


q, k, v = qkv(s)
banner("alibi", s)

kernel = attncc.compile(attncc.Variant(alibi, causal))
out = kernel(q, k, v)

check("alibi", out, q, k, v, alibi, causal)
i = torch.arange(s.L, device=DEVICE)
distance = i[None, :] - i[:, None]  # kv_idx - q_idx
bias = (slopes[:, None, None] * distance).masked_fill(distance > 0, float("-inf")).to(s.dtype)  # (H, L, L)
bench(lambda: kernel(q, k, v),
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), sdpa_label="SDPA dense bias")
