"""Grouped-query attention (Llama-3, Mistral): 4 query heads share each key/value head.
attncc maps query head h to K/V head h // 4 inside the kernel; K and V are never repeated.

    python examples/gqa.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import Shape, banner, bench, check, qkv, shape


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


s = shape(gpu=Shape(2, 32, 4096, 128, torch.bfloat16, Hkv=8),
          cpu=Shape(1, 8, 256, 64, torch.float16, Hkv=2))
q, k, v = qkv(s)
banner("GQA 4:1 causal", s)

kernel = attncc.compile(attncc.Variant(mask_mod=causal))
out = kernel(q, k, v, enable_gqa=True)

check("gqa", out, q, k, v, mask_mod=causal, enable_gqa=True)
bench(lambda: kernel(q, k, v, enable_gqa=True),
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
      sdpa_label="SDPA is_causal enable_gqa")
