"""GPU smoke + correctness + timing of the generated forward kernels (one process, one table).

python benchmarks/gpu_check.py  -> checks bf16/fp16 against the float64 reference and times
attncc against SDPA (flash, cuDNN) and compiled FlexAttention on a few variants.
"""

import torch
import triton

import attncc

dev = "cuda"
torch.manual_seed(0)


def rel(o, r):
    return ((o.double() - r).norm() / r.norm()).item()


def variants(L):
    slopes = torch.exp2(-8 * torch.arange(1, 17, device=dev) / 16)
    doc = torch.repeat_interleave(torch.arange(8, device=dev), L // 8 + 1)[:L]
    return {
        "full": (None, None),
        "causal": (None, lambda b, h, q, k: q >= k),
        "sliding1024": (None, lambda b, h, q, k: (q >= k) & (q - k < 1024)),
        "alibi_causal": (lambda s, b, h, q, k: s + slopes[h] * (k - q), lambda b, h, q, k: q >= k),
        "softcap_causal": (lambda s, b, h, q, k: 30 * torch.tanh(s / 30), lambda b, h, q, k: q >= k),
        "document_causal": (None, lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)),
    }


rows = []
fails = []
for dtype in (torch.bfloat16, torch.float16):
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3
    for (B, H, Hkv, Lq, Lkv, D, Dv) in [(2, 8, 8, 1000, 1000, 128, 128), (1, 4, 4, 4096, 4096, 64, 64),
                                        (2, 8, 2, 1000, 777, 128, 128), (1, 4, 4, 300, 513, 80, 80),
                                        (1, 4, 4, 300, 300, 256, 256), (1, 4, 4, 129, 200, 192, 64),
                                        (1, 4, 1, 1, 1000, 64, 64)]:
        q = torch.randn(B, H, Lq, D, device=dev, dtype=dtype)
        k = torch.randn(B, Hkv, Lkv, D, device=dev, dtype=dtype)
        v = torch.randn(B, Hkv, Lkv, Dv, device=dev, dtype=dtype)
        for name, (sm, mm) in variants(max(Lq, Lkv)).items():
            o, lse = attncc.attention(q, k, v, sm, mm, enable_gqa=Hkv != H, return_lse=True)
            r, rl = attncc.reference.attention(q.double(), k.double(), v.double(), sm, mm, enable_gqa=Hkv != H, return_lse=True)
            e = rel(o, r)
            fin = torch.isfinite(rl)
            le = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
            ok = e < tol and le < 1e-2 and bool((torch.isfinite(lse) == fin).all()) and not o.isnan().any()
            if not ok:
                fails.append((str(dtype), B, H, Hkv, Lq, Lkv, D, Dv, name, e, le))
        print(f"checked {dtype} {(B, H, Hkv, Lq, Lkv, D, Dv)}", flush=True)

print("FAILS:", fails)

# no recompilation for new lengths
kern = attncc.compile(attncc.Variant(mask_mod=lambda b, h, q, k: q >= k))
for L in (1000, 1500, 3000, 17):
    x = torch.randn(1, 4, L, 64, device=dev, dtype=torch.bfloat16)
    kern(x, x, x)
mods = [m for (_, kk, _), (_, m) in attncc.api._loaded.items() if m is not None]
fn = [getattr(m.attn_fwd, "fn", m.attn_fwd) for m in mods]  # a Launcher wraps the JITFunction
def ncompiled(f):
    c = getattr(f, "device_caches", None)
    if c is not None:
        return sum(len(v[0]) for v in c.values())
    return len(getattr(f, "cache", {}).get(0, {}))
print("compiled variants per module:", [ncompiled(f) for f in fn][:40])

# timing
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
flex = torch.compile(flex_attention)
for (B, H, N, D) in [(4, 16, 4096, 128), (4, 32, 4096, 64), (1, 16, 16384, 128)]:
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for name, (sm, mm) in variants(N).items():
        t_a = triton.testing.do_bench(lambda: attncc.attention(q, k, v, sm, mm), warmup=25, rep=100, return_mode="median")
        comp = attncc.compile(attncc.Variant(sm, mm))
        t_c = triton.testing.do_bench(lambda: comp(q, k, v), warmup=25, rep=100, return_mode="median")
        t_f = float("nan")
        try:
            torch._dynamo.reset()
            flex = torch.compile(flex_attention)
            bm = create_block_mask(mm, B=None, H=None, Q_LEN=N, KV_LEN=N) if mm else None
            t_f = triton.testing.do_bench(lambda: flex(q, k, v, score_mod=sm, block_mask=bm), warmup=25, rep=100, return_mode="median")
        except Exception as e:
            print("flex failed", name, e)
        t_s = float("nan")
        t_cd = float("nan")
        if name in ("full", "causal"):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t_s = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal"), warmup=25, rep=100, return_mode="median")
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                t_cd = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=name == "causal"), warmup=25, rep=100, return_mode="median")
        rows.append((name, B, H, N, D, t_a, t_c, t_f, t_s, t_cd))

print("| variant | BxHxNxD | attncc fn ms | attncc compiled ms | flex ms | sdpa-flash ms | sdpa-cudnn ms | compiled/flex |")
print("|---|---|---|---|---|---|---|---|")
for (name, B, H, N, D, ta, tc, tf, ts, tcd) in rows:
    print(f"| {name} | {B}x{H}x{N}x{D} | {ta:.3f} | {tc:.3f} | {tf:.3f} | {ts:.3f} | {tcd:.3f} | {tf / tc:.2f}x |")
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
