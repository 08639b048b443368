"""The benchmarked attention variants: one set of mods per shape serves attncc, FlexAttention and
the density count, so every system computes the same function.

Layouts follow /work/shared/anchors/bench_anchors.py (document ids, ALiBi slopes, window and
prefix lengths), so the numbers are comparable with the anchor figures.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

NAMES = ("full", "causal", "sliding_window_1024", "document_causal", "prefix_lm_1024", "alibi_causal",
         "softcap_causal", "gqa4_causal", "relative_bias_causal", "dropout0.1_causal")


@dataclass(frozen=True)
class Case:
    """One variant at one (H, N): its mods and what the other systems can run of it."""
    name: str
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    gqa: int = 1                 # query heads per K/V head
    dropout_p: float = 0.0
    sdpa: dict | None = None     # F.scaled_dot_product_attention kwargs that express it; None: n/a
    sdpa_backends: tuple = ()    # systems among ("sdpa-flash", "sdpa-cudnn") that run it
    flex: bool = True            # FlexAttention expresses it (its Triton and FLASH backends)
    fa4: dict | None = None      # flash_attn.cute.flash_attn_func kwargs that express it; None: n/a
    learnable: tuple = ()        # captured tensors that require grad (timed backward includes them)


def document_ids(N: int, device) -> torch.Tensor:
    """Eight packed documents of random lengths (mean N/8): the anchors' layout, seed 0."""
    docs = torch.zeros(N, dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    for c in sorted(torch.randint(1, N, (7,), generator=g).tolist()):
        docs[c:] += 1
    return docs.to(device)


def make_cases(H: int, N: int, device, window: int = 1024, prefix: int = 1024) -> dict[str, Case]:
    """Every variant of NAMES for H query heads and sequence length N, keyed by name. window and
    prefix change only for small CPU smoke tests; the names keep the benchmarked 1024."""
    docs = document_ids(N, device)
    slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=device)
    g = torch.Generator().manual_seed(1)
    table = (0.5 * torch.randn(H, 2 * N - 1, generator=g)).to(device).requires_grad_()  # (H, 2N - 1)
    learned_slopes = slopes.clone().requires_grad_()  # outside NAMES: tier A/B runs of learnable captures

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def learned_alibi(score, b, h, q_idx, kv_idx):
        return score + learned_slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * torch.tanh(score / 30.0)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + N - 1]

    flash_cudnn = ("sdpa-flash", "sdpa-cudnn")
    cases = [
        Case("full", sdpa={}, sdpa_backends=flash_cudnn, fa4={}),
        Case("causal", mask_mod=causal, sdpa=dict(is_causal=True), sdpa_backends=flash_cudnn, fa4=dict(causal=True)),
        # FA4's window (left, right) keeps q - left <= kv <= q + right: q - kv < window is left = window - 1
        Case("sliding_window_1024", mask_mod=sliding_window, fa4=dict(causal=True, window_size=(window - 1, 0))),
        Case("document_causal", mask_mod=document_causal),
        Case("prefix_lm_1024", mask_mod=prefix_lm),
        Case("alibi_causal", alibi, causal),
        Case("softcap_causal", softcap, causal, fa4=dict(causal=True, softcap=30.0)),
        Case("gqa4_causal", mask_mod=causal, gqa=4, sdpa=dict(is_causal=True, enable_gqa=True),
             sdpa_backends=flash_cudnn, fa4=dict(causal=True)),
        # outside NAMES (the suite): GQA under other masks, for the forward's packed query heads
        Case("gqa4_full", gqa=4, sdpa=dict(enable_gqa=True), sdpa_backends=flash_cudnn, fa4={}),
        Case("gqa4_prefix_lm_1024", mask_mod=prefix_lm, gqa=4),
        Case("relative_bias_causal", relative_bias, causal, learnable=(table,)),
        Case("learned_alibi_causal", learned_alibi, causal, learnable=(learned_slopes,)),
        Case("dropout0.1_causal", mask_mod=causal, dropout_p=0.1, sdpa=dict(is_causal=True, dropout_p=0.1),
             sdpa_backends=("sdpa-flash",), flex=False),
    ]
    return {c.name: c for c in cases}


def density(mask_mod, N: int, device, rows: int = 1024) -> float:
    """Exact fraction of the N x N (q_idx, kv_idx) pairs that mask_mod keeps, counted in blocks
    of query rows. Every mask here ignores b and h, so batch 0, head 0 stands for all."""
    if mask_mod is None:
        return 1.0
    kv_idx = torch.arange(N, device=device)[None, :]
    kept = 0
    for q0 in range(0, N, rows):
        q_idx = torch.arange(q0, min(q0 + rows, N), device=device)[:, None]
        kept += int(mask_mod(0, 0, q_idx, kv_idx).sum().item())
    return kept / (N * N)
