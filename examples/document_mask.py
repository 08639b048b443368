"""Document masking for packed sequences: several documents are packed into one long row, and
a token attends (causally) only within its own document. The document ids are a captured
tensor; packing a new batch changes its contents, not the kernel.

    python examples/document_mask.py
"""
import torch
import torch.nn.functional as F

import attncc
from _common import DEVICE, Shape, banner, bench, check, qkv, shape

s = shape(gpu=Shape(1, 16, 8192, 128, torch.bfloat16), cpu=Shape(1, 4, 256, 64, torch.float32))
lengths = torch.tensor([0.3, 0.05, 0.15, 0.25, 0.1, 0.15]).mul(s.L).long()  # six documents
lengths[-1] += s.L - lengths.sum()
doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(DEVICE)  # 0 0 .. 1 .. 5


def document_causal(b, h, q_idx, kv_idx):
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)


q, k, v = qkv(s)
banner(f"document mask, {len(lengths)} packed documents", s)

kernel = attncc.compile(attncc.Variant(mask_mod=document_causal))
out = kernel(q, k, v)

check("document_mask", out, q, k, v, mask_mod=document_causal)
i = torch.arange(s.L, device=DEVICE)
dense = (doc_ids[:, None] == doc_ids[None, :]) & (i[:, None] >= i[None, :])  # (L, L) for SDPA
bench(lambda: kernel(q, k, v),
      sdpa=lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), sdpa_label="SDPA dense mask")
