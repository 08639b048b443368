"""GPU check of the backward kernels (bf16, fp16) against float64 autograd, and fwd+bwd timing
of the two dQ strategies (separate kernel vs atomics) against FlexAttention and SDPA."""
import os

import torch
import triton

import attncc

dev = "cuda"
torch.manual_seed(0)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_case(B, H, Hkv, Lq, Lkv, D, Dv, dtype, sm, mm, caps):
    q = torch.randn(B, H, Lq, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, Dv, device=dev, dtype=dtype, requires_grad=True)
    o = attncc.attention(q, k, v, sm, mm, enable_gqa=H != Hkv)
    do = torch.randn_like(o)
    for c in caps:
        c.grad = None
    (o * do).sum().backward()
    got = [q.grad, k.grad, v.grad] + [c.grad for c in caps]
    for c in caps:
        c.grad = None
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    r = attncc.reference.attention(qd, kd, vd, sm, mm, enable_gqa=H != Hkv)
    (r * do.double()).sum().backward()
    want = [qd.grad, kd.grad, vd.grad] + [c.grad for c in caps]
    return [rel(a, b) for a, b in zip(got, want)], bool(any(g.isnan().any() for g in got))


slopes = torch.rand(16, device=dev, requires_grad=True)
table = (0.1 * torch.randn(16, 4200, device=dev)).requires_grad_()
causal = lambda b, h, q, k: q >= k
cases = {
    "full": (None, None, []),
    "causal": (None, causal, []),
    "alibi_learnable": (lambda s, b, h, q, k: s + slopes[h] * (k - q), causal, [slopes]),
    "softcap": (lambda s, b, h, q, k: 30 * torch.tanh(s / 30), causal, []),
    "relbias_learnable": (lambda s, b, h, q, k: s + table[h, q - k + 2100], causal, [table]),
    "sq_where": (lambda s, b, h, q, k: torch.where(s > 0, s * s * 0.1, torch.exp(s) - 1), None, []),
}
fails = []
for dtype in (torch.bfloat16, torch.float16):
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    for shape in [(2, 8, 8, 1000, 1000, 128, 128), (2, 8, 2, 777, 1000, 64, 64), (1, 4, 4, 300, 513, 80, 80),
                  (1, 4, 4, 129, 200, 192, 64), (1, 16, 16, 2048, 2048, 64, 64)]:
        for name, (sm, mm, caps) in cases.items():
            errs, nan = run_case(*shape, dtype, sm, mm, caps)
            # capture gradients sum over many scores: bf16 inputs give a looser bound there
            ok = not nan and all(e < tol for e in errs[:3]) and all(e < 10 * tol for e in errs[3:])
            print(f"{'ok ' if ok else 'BAD'} {dtype} {shape} {name}: " + " ".join(f"{e:.1e}" for e in errs), flush=True)
            if not ok:
                fails.append((dtype, shape, name, errs))
print("FAILS:", fails)

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

rows = []
for (B, H, N, D) in [(4, 16, 4096, 128), (4, 32, 4096, 64)]:
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for name in ("full", "causal", "softcap"):
        sm, mm, _ = cases[name]
        res = {}
        for mode in ("kernel", "atomic"):
            os.environ["ATTNCC_BWD_DQ"] = mode
            res[mode] = triton.testing.do_bench(lambda: attncc.attention(q, k, v, sm, mm).backward(do), warmup=25, rep=100,
                                                return_mode="median")
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        bm = create_block_mask(mm, None, None, N, N) if mm else None
        res["flex"] = triton.testing.do_bench(lambda: flex(q, k, v, score_mod=sm, block_mask=bm).backward(do), warmup=25,
                                              rep=100, return_mode="median")
        res["fwd_attncc"] = triton.testing.do_bench(lambda: attncc.attention(q, k, v, sm, mm), warmup=25, rep=100, return_mode="median")
        if name != "softcap":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                res["sdpa"] = triton.testing.do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal").backward(do),
                    warmup=25, rep=100, return_mode="median")
        rows.append((name, B, H, N, D, res))
os.environ["ATTNCC_BWD_DQ"] = "kernel"
print("| variant | shape | attncc fwd ms | fwd+bwd dq-kernel ms | fwd+bwd dq-atomic ms | flex fwd+bwd ms | sdpa-flash fwd+bwd ms |")
print("|---|---|---|---|---|---|---|")
for name, B, H, N, D, r in rows:
    print(f"| {name} | {B}x{H}x{N}x{D} | {r['fwd_attncc']:.3f} | {r['kernel']:.3f} | {r['atomic']:.3f} | {r['flex']:.3f} | {r.get('sdpa', float('nan')):.3f} |")
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
