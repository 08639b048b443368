"""Validation of user inputs: every failure names the problem and the fix."""
from __future__ import annotations

import torch

from .errors import AttnccError

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_qkv(q, k, v, enable_gqa: bool, dtypes=DTYPES) -> int:
    """Validate query/key/value; return the GQA group size Hq // Hkv."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise AttnccError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttnccError(
                f"{name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}; "
                "for (batch, seq_len, heads, head_dim) tensors pass x.transpose(1, 2) (no copy needed)")
        if t.dtype not in dtypes:
            raise AttnccError(f"{name} has dtype {t.dtype}; attncc kernels support float16, bfloat16 and float32")
    if not q.dtype == k.dtype == v.dtype:
        raise AttnccError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; "
                          "convert with .to(dtype)")
    if not q.device == k.device == v.device:
        raise AttnccError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise AttnccError(f"batch sizes differ: query {B}, key {k.shape[0]}, value {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise AttnccError(f"key and value must have the same number of heads, got {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != v.shape[2]:
        raise AttnccError(f"key and value must have the same sequence length, got {k.shape[2]} and {v.shape[2]}")
    if k.shape[3] != D:
        raise AttnccError(f"query and key head dims differ ({D} vs {k.shape[3]}); they are dotted together")
    for name, d in (("query/key", D), ("value", v.shape[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise AttnccError(f"{name} head dim {d} is outside the supported range 1..{MAX_HEAD_DIM}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv:
        raise AttnccError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA/MQA")
    if Hq != Hkv and not enable_gqa:
        raise AttnccError(f"query has {Hq} heads but key/value have {Hkv}; pass enable_gqa=True for "
                          "grouped-query / multi-query attention")
    return Hq // Hkv


def check_captures(captures, device: torch.device) -> None:
    """Captured tensors must live on the inputs' device (they are read inside the kernel)."""
    for c in captures:
        t = c.tensor
        if t.device != device:
            raise AttnccError(
                f"captured tensor {c!r} is on {t.device} but the inputs are on {device}; "
                f"create it on {device} (or move it with .to(device) before building the mod)")
