"""Multi-head latent attention (MLA, DeepSeek-V2) decoding, absorbed and unabsorbed, from the same
weights; they must agree.

MLA caches one latent vector c (rank m) per token plus one RoPE key k_r (dim p) shared by all
heads, instead of H keys and values. Head h's key is [c W_UK[h], k_r] and its value c W_UV[h].

  unabsorbed   up-project the whole cache into H keys (d_nope + p) and values (d_v) per token,
               then ordinary multi-head attention: reads H (d_nope + p + d_v) numbers per token
  absorbed     fold W_UK into the query: q_lat[h] = q_nope[h] W_UK[h]^T (rank m), so
               score = [q_lat, q_r] . [c, k_r]; attend over the latent cache directly as MQA
               with keys [c, k_r] (dim m + p) and values c (its first m channels, the same memory),
               then up-project the output: o[h] = o_lat[h] W_UV[h]. Reads m + p numbers per token.

The absorbed form is one attncc call on a KVCache(value_from_key=True) whose head dim m + p = 576
is not a power of two (attncc splits it as 512 + 64). Any mods apply; here causal + softcap.

    python examples/mla.py
"""
import math

import torch

import attncc
from _common import DEVICE, GPU

torch.manual_seed(0)
if GPU:  # DeepSeek-V2/V3's attention dims
    B, H, D_MODEL, M, P, D_NOPE, D_V, PROMPT, STEPS, dtype = 4, 128, 2048, 512, 64, 128, 128, 1000, 4, torch.bfloat16
else:
    B, H, D_MODEL, M, P, D_NOPE, D_V, PROMPT, STEPS, dtype = 2, 4, 64, 64, 16, 32, 32, 40, 2, torch.float32
SCALE = 1.0 / math.sqrt(D_NOPE + P)  # the scale of the unabsorbed heads, kept by the absorbed form
BOUND = 1.6e-2 if dtype == torch.bfloat16 else 1e-4  # relative error allowed between the forms

w = {name: torch.randn(*shape, device=DEVICE) / math.sqrt(shape[0]) for name, shape in dict(
    dkv=(D_MODEL, M), kr=(D_MODEL, P), q=(D_MODEL, H * D_NOPE), qr=(D_MODEL, H * P),
    uk=(M, H * D_NOPE), uv=(M, H * D_V)).items()}
uk = w["uk"].view(M, H, D_NOPE).permute(1, 0, 2)  # (H, M, D_NOPE)
uv = w["uv"].view(M, H, D_V).permute(1, 0, 2)     # (H, M, D_V)


def rope(x, pos):
    """Rotary embedding of the last dim of x (..., L, heads, dim) at positions pos (L,)."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, device=x.device) / half)
    ang = pos[:, None, None].float() * freq
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * ang.cos() - b * ang.sin(), a * ang.sin() + b * ang.cos()], -1)


def softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


variant = attncc.compile(attncc.Variant(softcap, causal, scale=SCALE))
latent = attncc.KVCache(B, PROMPT + STEPS, 1, M + P, dtype, DEVICE, head_dim_v=M, value_from_key=True)
heads = attncc.KVCache(B, PROMPT + STEPS, H, D_NOPE + P, dtype, DEVICE, head_dim_v=D_V)


def step(x, start):
    """Tokens x (B, L, D_MODEL) at positions start.. through both forms; returns both outputs."""
    L = x.shape[1]
    pos = torch.arange(start, start + L, device=DEVICE)
    c = x @ w["dkv"]                                                      # (B, L, M)
    k_r = rope((x @ w["kr"]).view(B, L, 1, P), pos)                       # (B, L, 1, P)
    q_nope = (x @ w["q"]).view(B, L, H, D_NOPE)
    q_r = rope((x @ w["qr"]).view(B, L, H, P), pos)
    # unabsorbed: H keys and values per token
    k = torch.cat([torch.einsum("blm,hmd->blhd", c, uk), k_r.expand(B, L, H, P)], -1)
    v = torch.einsum("blm,hmd->blhd", c, uv)
    q = torch.cat([q_nope, q_r], -1)
    o_heads = variant.with_kvcache(q.to(dtype), heads, k.to(dtype), v.to(dtype))
    # absorbed: queries in the latent space, one shared latent "head"
    q_lat = torch.einsum("blhd,hmd->blhm", q_nope, uk)
    o_lat = variant.with_kvcache(torch.cat([q_lat, q_r], -1).to(dtype), latent,
                                 torch.cat([c[:, :, None], k_r], -1).to(dtype))
    o_absorbed = torch.einsum("blhm,hmd->blhd", o_lat.float(), uv)
    if L == 1 or not GPU:  # and the unabsorbed form against the float64 definition
        n = start + L
        kc, vc = (t[:, :, :n].double() for t in (heads.k, heads.v))  # (B, H, n, dim)
        ref = attncc.reference.attention(q.transpose(1, 2).double(), kc, vc, softcap, causal, scale=SCALE,
                                         q_offset=start).transpose(1, 2)
        err = ((o_heads.double() - ref).norm() / ref.norm()).item()
        assert err < BOUND, f"unabsorbed MLA differs from the reference: {err:.2e}"
    return o_heads.float(), o_absorbed


with torch.no_grad():
    x = torch.randn(B, PROMPT, D_MODEL, device=DEVICE)
    outs = [step(x, 0)]  # prefill
    for t in range(STEPS):  # decode one token at a time
        outs.append(step(torch.randn(B, 1, D_MODEL, device=DEVICE), PROMPT + t))

print(f"MLA: B={B} H={H} latent rank m={M} rope dim p={P} (cache head dim {M + P}), {str(dtype)[6:]} on {DEVICE}")
print(f"cache per token: latent {M + P} numbers, unabsorbed {H * (D_NOPE + P + D_V)}")
for i, (o_heads, o_absorbed) in enumerate(outs):
    err = ((o_absorbed - o_heads).norm() / o_heads.norm()).item()
    print(f"  {'prefill' if i == 0 else f'decode step {i}':14s} |absorbed - unabsorbed| / |unabsorbed| = {err:.2e}")
    assert err < BOUND, f"absorbed and unabsorbed MLA disagree: {err:.2e} >= {BOUND}"
print("absorbed and unabsorbed MLA agree")
