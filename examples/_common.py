"""Boilerplate shared by the examples: device and shapes, the float64 check, GPU timing.

Each example defines its mods, runs attncc, then calls ``check`` (relative error against
``attncc.reference.attention`` on float64 copies; exits non-zero past the dtype's bound) and
``bench`` (GPU only: median milliseconds from triton.testing.do_bench).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import attncc

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
# ||out - ref|| / ||ref|| an example may reach before it fails, per dtype of q, k, v
BOUNDS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Shape:
    B: int
    H: int           # query heads
    L: int           # sequence length (queries and keys)
    D: int           # head dim
    dtype: torch.dtype
    Hkv: int = 0     # key/value heads; 0 means H (no GQA)

    def __str__(self):
        heads = f"H={self.H}" + (f" Hkv={self.Hkv}" if self.Hkv and self.Hkv != self.H else "")
        return f"B={self.B} {heads} L={self.L} D={self.D} {str(self.dtype).removeprefix('torch.')}"


def shape(gpu: Shape = Shape(2, 16, 4096, 128, torch.bfloat16),
          cpu: Shape = Shape(1, 4, 256, 64, torch.float32)) -> Shape:
    """The example's problem size on this machine: the CPU runs through the Triton interpreter,
    so it gets a small one."""
    return gpu if GPU else cpu


def qkv(s: Shape, seed: int = 0):
    """Random q (B, H, L, D), k and v (B, Hkv, L, D) on DEVICE."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda h: torch.randn(s.B, h, s.L, s.D, generator=g, device=DEVICE, dtype=s.dtype)
    return make(s.H), make(s.Hkv or s.H), make(s.Hkv or s.H)


def _heads_from(h0, score_mod, mask_mod):
    """The mods as the reference must see them on heads h0.. of q: h shifted back by h0."""
    if h0 == 0:
        return score_mod, mask_mod
    shifted_score = score_mod and (lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h + h0, q_idx, kv_idx))
    shifted_mask = mask_mod and (lambda b, h, q_idx, kv_idx: mask_mod(b, h + h0, q_idx, kv_idx))
    return shifted_score, shifted_mask


def reference(q, k, v, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False):
    """attncc.reference.attention on float64 copies, a few heads at a time so that its dense
    (B, heads, Lq, Lkv) float64 score tensor stays near 1 GiB."""
    B, H, Lq, _ = q.shape
    group = H // k.shape[1]
    step = max(group, 2**27 // (B * Lq * max(k.shape[2], 1)) // group * group)
    outs = []
    for h0 in range(0, H, step):
        qs = q[:, h0:h0 + step].double()
        ks, vs = (t[:, h0 // group:(h0 + step) // group].double() for t in (k, v))
        outs.append(attncc.reference.attention(qs, ks, vs, *_heads_from(h0, score_mod, mask_mod),
                                               scale=scale, enable_gqa=enable_gqa))
    return torch.cat(outs, dim=1)


def rel_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(name, out, q, k, v, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False) -> float:
    """Print ||out - ref|| / ||ref|| against the float64 reference; exit 1 past the dtype's bound."""
    ref = reference(q, k, v, score_mod, mask_mod, scale=scale, enable_gqa=enable_gqa)
    err, bound = rel_error(out, ref), BOUNDS[q.dtype]
    ok = err <= bound  # False for NaN too
    print(f"  {name}: error vs float64 reference {err:.2e} (bound {bound:.1e}) {'ok' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(f"{name}: relative error {err:.3e} exceeds {bound:.1e} for {q.dtype}")
    return err


def bench(fn, sdpa=None, sdpa_label="torch SDPA"):
    """GPU only: median ms of fn (attncc) and, if given, of a torch SDPA call doing the same job."""
    if not GPU:
        return None
    from triton.testing import do_bench
    ms = do_bench(fn, return_mode="median")
    line = f"  attncc {ms:.3f} ms"
    if sdpa is not None:
        line += f" | {sdpa_label} {do_bench(sdpa, return_mode='median'):.3f} ms"
    print(line)
    return ms


def banner(title: str, s: Shape):
    where = "cuda" if GPU else "cpu (Triton interpreter; timings on CUDA only)"
    print(f"{title}: {s} on {where}")
