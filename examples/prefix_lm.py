"""Prefix LM (T5, PaliGemma): the prefix (prompt, image tokens) is attended bidirectionally,
the rest causally. Each batch row has its own prefix length, a captured (B,) tensor.

    python examples/prefix_lm.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import DEVICE, banner, bench, check, qkv, shape

s = shape()
prefix_len = torch.tensor([s.L // 4, s.L // 2, 1, 0][:s.B], device=DEVICE)


def prefix_lm(b, h, q_idx, kv_idx):
    return (kv_idx < prefix_len[b]) | (q_idx >= kv_idx)


q, k, v = qkv(s)
banner("prefix LM", s)

kernel = attncc.compile(attncc.Variant(mask_mod=prefix_lm))
out = kernel(q, k, v)

check("prefix_lm", out, q, k, v, mask_mod=prefix_lm)
i = torch.arange(s.L, device=DEVICE)
dense = (i[None, None, None, :] < prefix_len[:, None, None, None]) | (i[:, None] >= i[None, :])  # (B, 1, L, L)
bench(lambda: kernel(q, k, v),
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), sdpa_label="SDPA dense mask")
