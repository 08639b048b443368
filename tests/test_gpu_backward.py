"""Backward and dropout on the GPU in bf16 and fp16 against float64 autograd (skipped without CUDA)."""
import pytest
import torch

import attncc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
causal = lambda b, h, q, k: q >= k
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 8, 8, 1000, 1000, 128, 128), (2, 8, 2, 777, 1000, 64, 64),
                                   (1, 4, 4, 300, 513, 80, 80), (1, 4, 4, 129, 200, 192, 64),
                                   (1, 4, 4, 512, 1024, 128, 128)],  # whole tiles: the table loads without masks
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("variant", ["causal", "softcap", "alibi_learnable", "relbias_learnable"])
@pytest.mark.parametrize("tier", ["triton", "gluon"])  # the forward's: the backward is the Triton tier's
def test_backward_gpu(dtype, shape, variant, tier, monkeypatch):
    monkeypatch.setenv("ATTNCC_TIER", tier)
    B, H, Hkv, Lq, Lkv, D, Dv = shape
    dev = "cuda"
    torch.manual_seed(0)
    slopes = torch.rand(H, device=dev, requires_grad=True)
    table = (0.1 * torch.randn(H, Lq + Lkv + 1, device=dev)).requires_grad_()
    sm, caps = {
        "causal": (None, ()),
        "softcap": (lambda s, b, h, q, k: 30 * torch.tanh(s / 30), ()),
        "alibi_learnable": (lambda s, b, h, q, k: s + slopes[h] * (k - q), (slopes,)),
        "relbias_learnable": (lambda s, b, h, q, k: s + table[h, q - k + Lkv], (table,)),
    }[variant]
    q = torch.randn(B, H, Lq, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, Dv, device=dev, dtype=dtype, requires_grad=True)
    out = attncc.attention(q, k, v, sm, causal, enable_gqa=H != Hkv)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *caps), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, sm, causal, enable_gqa=H != Hkv)
    want = torch.autograd.grad(ref, (qd, kd, vd, *caps), do.double())
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all()
        bound = TOL[dtype] * (1 if i < 3 else 10)  # capture grads sum many bf16-rounded terms
        assert _rel(g, w) < bound, (i, _rel(g, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_after_warp_specialized_forward_gpu(dtype, monkeypatch):
    """Full attention at head dim 128 with Lkv % 128 == 0: on sm90 the Triton tier's forward is
    the warp-specialised one (its lse is stored through a descriptor); the gradients use that lse."""
    monkeypatch.setenv("ATTNCC_TIER", "triton")
    torch.manual_seed(1)
    B, H, Hkv, Lq, Lkv, D = 2, 8, 2, 1000, 1024, 128
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype, requires_grad=True)
    out = attncc.attention(q, k, v, enable_gqa=True)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, enable_gqa=True), (qd, kd, vd), do.double())
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all()
        assert _rel(g, w) < TOL[dtype], (i, _rel(g, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 8, 8, 1000, 1000, 128, 128), (2, 8, 2, 777, 1000, 64, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_atomic_dq_gpu(monkeypatch, dtype, shape):
    """ATTNCC_BWD_DQ=atomic (relaxed vector atomics into a float32 dQ) on the GPU."""
    monkeypatch.setenv("ATTNCC_BWD_DQ", "atomic")
    B, H, Hkv, Lq, Lkv, D, Dv = shape
    torch.manual_seed(0)
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, Dv, device="cuda", dtype=dtype, requires_grad=True)
    out = attncc.attention(q, k, v, mask_mod=causal, enable_gqa=H != Hkv)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, mask_mod=causal, enable_gqa=H != Hkv)
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and _rel(g, w) < TOL[dtype], _rel(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(2, 4, 1000, 1000, 64), (1, 4, 777, 1000, 128), (2, 2, 300, 300, 96)],
                         ids=lambda s: "x".join(map(str, s)))
def test_dropout_gpu_matches_mask(dtype, shape):
    """Forward and gradients with dropout against the reference applying attncc.dropout_mask: each
    head dim launches its own tiles, and the dK/dV programs draw the mask transposed."""
    torch.manual_seed(0)
    B, H, Lq, Lkv, D = shape
    q = torch.randn(B, H, Lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, H, Lkv, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    torch.manual_seed(11)
    out = attncc.attention(q, k, v, mask_mod=causal, dropout_p=0.1)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    torch.manual_seed(11)
    keep = attncc.dropout_mask(B, H, Lq, Lkv, 0.1, device="cuda")
    assert abs(keep.float().mean().item() - 0.9) < 0.01
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, mask_mod=causal, dropout_p=0.1, dropout_mask=keep)
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    assert _rel(out, ref) < TOL[dtype]
    for g, w in zip(got, want):
        assert _rel(g, w) < TOL[dtype]


def test_deterministic_gpu():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    slopes = torch.rand(8, device="cuda", requires_grad=True)
    table = (0.1 * torch.randn(8, 2001, device="cuda")).requires_grad_()
    mod = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi) * 0.01 + table[h, qi - ki + 1000]
    do = torch.randn_like(q)
    runs = [torch.autograd.grad(attncc.attention(q, k, v, mod, causal, deterministic=True), (q, k, v, slopes, table), do)
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
