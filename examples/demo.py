"""attncc demo: four attention variants, each a few lines of Python, compiled into
FlashAttention-2 Triton kernels and checked against a float64 reference.

    python examples/demo.py           # --full prints the whole generated file
"""
import sys

import torch
import torch.nn.functional as F

import attncc
from _common import BOUNDS, DEVICE, GPU, banner, qkv, reference, rel_error, shape

if GPU:
    from triton.testing import do_bench

s = shape()  # GPU: B=2 H=16 L=4096 D=128 bfloat16; CPU: B=1 H=4 L=256 D=64 float32
q, k, v = qkv(s)
slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / s.H) for i in range(s.H)], device=DEVICE)
doc_ids = torch.arange(s.L, device=DEVICE) * 5 // s.L  # five packed documents of equal length


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 50.0 * torch.tanh(score / 50.0)


def document(b, h, q_idx, kv_idx):
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)


VARIANTS = {"causal": (None, causal), "alibi": (alibi, causal), "softcap": (softcap, causal),
            "document": (None, document)}


def kernel_function(source: str, name: str = "attn_fwd") -> str:
    """Just the @triton.jit function `name` of a generated file: where the mods are inlined."""
    lines = source.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith(f"def {name}("))
    start -= lines[start - 1].startswith("@")
    end = next((i for i in range(start + 2, len(lines)) if lines[i][:1] not in ("", " ", ")")), len(lines))
    return "\n".join(lines[start:end]).rstrip()


banner("attncc demo", s)
header = f"{'variant':<10} {'error vs fp64':>13}  {'bound':>7}  {'check':<6}"
print(header + f" {'attncc ms':>10}" if GPU else header.rstrip())
kernels, failed = {}, []
for name, (score_mod, mask_mod) in VARIANTS.items():
    kernel = kernels[name] = attncc.compile(attncc.Variant(score_mod, mask_mod, name=name))
    out = kernel(q, k, v)
    err = rel_error(out, reference(q, k, v, score_mod, mask_mod))
    ok = err <= BOUNDS[q.dtype]  # False for NaN too
    if not ok:
        failed.append(name)
    line = f"{name:<10} {err:13.2e}  {BOUNDS[q.dtype]:7.1e}  {'ok' if ok else 'FAILED':<6}"
    if GPU:
        line += f" {do_bench(lambda: kernel(q, k, v), return_mode='median'):10.3f}"
    print(line.rstrip())
if GPU:
    sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), return_mode="median")
    print(f"(for scale: torch SDPA with is_causal=True takes {sdpa:.3f} ms)")

source = kernels["softcap"].source("fwd", dtype=torch.bfloat16, head_dim=128)
if "--full" not in sys.argv:
    source = kernel_function(source)
print("\n# Generated Triton source, softcap + causal, bfloat16, head_dim=128 (--full for the whole file):\n")
print(source)
print("\n# kernel.explain():\n")
print(kernels["softcap"].explain())
if failed:
    raise SystemExit(f"demo: {', '.join(failed)} exceeded the error bound")
