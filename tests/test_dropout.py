"""Dropout: the kernels' Philox mask equals attncc.dropout_mask, and everything follows from it."""
import pytest
import torch

import attncc

causal = lambda b, h, q, k: q >= k


def _inputs(B=2, H=2, Lq=45, Lkv=70, D=16, seed=0, Hkv=None):
    torch.manual_seed(seed)
    return [torch.randn(B, h, L, D, requires_grad=True) for h, L in ((H, Lq), (Hkv or H, Lkv), (Hkv or H, Lkv))]


@pytest.mark.parametrize("p,H,Hkv", [(0.1, 2, 2), (0.5, 2, 2), (0.1, 4, 2)])
def test_output_and_grads_match_reference_with_same_mask(p, H, Hkv):
    q, k, v = _inputs(H=H, Hkv=Hkv)
    torch.manual_seed(1234)
    out = attncc.attention(q, k, v, mask_mod=causal, dropout_p=p, enable_gqa=H != Hkv)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    torch.manual_seed(1234)
    keep = attncc.dropout_mask(2, H, 45, 70, p)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = attncc.reference.attention(qd, kd, vd, mask_mod=causal, dropout_p=p, dropout_mask=keep,
                                     enable_gqa=H != Hkv)
    want = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    for g, w in zip(got, want):
        assert ((g.double() - w).norm() / w.norm()).item() < 1e-5


def test_keep_rate_statistics():
    p = 0.3
    keep = attncc.dropout_mask(2, 4, 128, 128, p, seed=7, offset=11)
    n = keep.numel()
    rate = keep.float().mean().item()
    sigma = ((p * (1 - p)) / n) ** 0.5
    assert abs(rate - (1 - p)) < 5 * sigma
    # neither rows nor heads share a pattern
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_every_lane_of_a_philox_call_keeps_at_rate_and_independently():
    # one Philox call gives 8 neighbouring keys (two 16-bit numbers per 32-bit output)
    p = 0.25
    keep = attncc.dropout_mask(2, 4, 256, 256, p, seed=3, offset=5).reshape(-1, 8).float()
    n = keep.shape[0]
    sigma = ((p * (1 - p)) / n) ** 0.5
    for lane in range(8):
        assert abs(keep[:, lane].mean().item() - (1 - p)) < 5 * sigma, lane
    for a, b in [(0, 1), (1, 2), (6, 7)]:  # halves of one word, and across words
        both = (keep[:, a] * keep[:, b]).mean().item()
        assert abs(both - (1 - p) ** 2) < 5 * (((1 - p) ** 2 * (1 - (1 - p) ** 2)) / n) ** 0.5, (a, b)


def test_dropout_p_is_rounded_to_the_kernels_16_bit_grid():
    assert attncc.Variant(dropout_p=0.1).dropout_p == 6554 / 65536
    assert attncc.Variant(dropout_p=0.5).dropout_p == 0.5
    assert attncc.Variant(dropout_p=0.9999999).dropout_p == 65535 / 65536  # stays below 1
    # the mask applies the rounded probability exactly: threshold 1 of 65536 keeps u >= 1
    keep = attncc.dropout_mask(1, 1, 64, 64, 1 / 65536, seed=1, offset=0)
    assert keep.float().mean().item() > 0.99


def test_reproducible_under_manual_seed_and_fresh_per_call():
    q, k, v = _inputs()
    torch.manual_seed(5)
    a = attncc.attention(q, k, v, dropout_p=0.2)
    b = attncc.attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(5)
    a2 = attncc.attention(q, k, v, dropout_p=0.2)
    assert torch.equal(a, a2)
    assert not torch.equal(a, b)


def test_explicit_generator():
    q, k, v = _inputs()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(attncc.attention(q, k, v, dropout_p=0.2, generator=g1),
                       attncc.attention(q, k, v, dropout_p=0.2, generator=g2))


def test_eval_mode_and_zero_p_compile_the_rng_out():
    q, k, v = _inputs()
    kernel = attncc.compile(attncc.Variant(mask_mod=causal, dropout_p=0.4))
    plain = attncc.attention(q, k, v, mask_mod=causal)
    assert torch.equal(kernel(q, k, v, training=False), plain)
    assert not torch.equal(kernel(q, k, v), plain)
    src = attncc.compile(attncc.Variant(mask_mod=causal)).source("fwd", dtype=torch.float16, head_dim=64)
    assert "DROPOUT=False" in src


def test_lse_is_that_of_the_undropped_softmax():
    q, k, v = _inputs()
    _, lse = attncc.attention(q, k, v, mask_mod=causal, dropout_p=0.5, return_lse=True)
    _, lse0 = attncc.attention(q, k, v, mask_mod=causal, return_lse=True)
    assert torch.allclose(lse, lse0)
