"""Mods for the command line, as README's "Command line" section and `attncc COMMAND --help` name them:

    attncc show examples/mods.py:softcap --kernel bwd --dtype fp16 --head-dim 64
    attncc explain examples/mods.py:document --mask-ascii --len 2048
    attncc bench examples/mods.py:alibi+causal --len 2048 4096 8192 --backward

Each is a FlexAttention-style function: a score_mod (score, b, h, q_idx, kv_idx) or a mask_mod
(b, h, q_idx, kv_idx); FILE.py:score_fn+mask_fn joins one of each. The tensors they read (ALiBi
slopes, document ids) are captured: sized here for up to HEADS heads and MAX_LEN positions.
"""
import torch

import attncc

HEADS = 16  # attncc bench's default --heads
MAX_LEN = 8192  # the longest --len in the examples above
slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)])  # ALiBi, one per head
doc_ids = torch.arange(MAX_LEN) // 1000  # packed documents of 1000 tokens (the last one shorter)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 1024)


def document(b, h, q_idx, kv_idx):
    """Causal attention within each packed document."""
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    """Gemma-2's logit soft-capping."""
    return 50.0 * torch.tanh(score / 50.0)


alibi_causal = attncc.Variant(alibi, causal, name="alibi_causal")  # the same as alibi+causal
