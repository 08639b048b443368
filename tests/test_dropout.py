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


def _philox4x32_7(seed, c):
    """Philox4x32 with seven rounds (Salmon et al. 2011) on Python ints: the reference for
    tl.philox(..., n_rounds=7)."""
    M = 0xFFFFFFFF
    k0, k1 = seed & M, (seed >> 32) & M
    c0, c1, c2, c3 = c
    for _ in range(7):
        p0, p2 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p2 >> 32) ^ c1 ^ k0, p2 & M, (p0 >> 32) ^ c3 ^ k1, p0 & M
        k0, k1 = (k0 + 0x9E3779B9) & M, (k1 + 0xBB67AE85) & M
    return c0, c1, c2, c3


def test_mask_is_the_documented_philox_stream():
    # every entry recomputed from the layout in _dropout_keep's docstring: call number
    # ((8g + r) * ceil(Lkv / 32) + a) * 4 + c, counter (call, b * H + h, offset low 31 bits, offset >> 31),
    # word w, byte y -> query 16g + 8 (w // 2) + r, key 32a + 8 (2 (w % 2) + y // 2) + 2c + y % 2
    seed, offset, p, H, Lq, Lkv = 2**40 + 12345, 2**33 + 7, 0.375, 2, 20, 40
    keep = attncc.dropout_mask(1, H, Lq, Lkv, p, seed=seed, offset=offset)
    want = torch.zeros_like(keep)
    groups = -(-Lkv // 32)
    for h in range(H):
        for g in range(-(-Lq // 16)):
            for r in range(8):
                for a in range(groups):
                    for c in range(4):
                        call = ((8 * g + r) * groups + a) * 4 + c
                        words = _philox4x32_7(seed, (call, h, offset & 0x7FFFFFFF, offset >> 31))
                        for w, word in enumerate(words):
                            for y in range(4):
                                q, kv = 16 * g + 8 * (w // 2) + r, 32 * a + 8 * (2 * (w % 2) + y // 2) + 2 * c + y % 2
                                if q < Lq and kv < Lkv:
                                    want[0, h, q, kv] = (word >> (8 * y)) & 0xFF >= p * 256
    assert torch.equal(keep, want)


def test_every_byte_of_a_philox_call_keeps_at_rate_and_independently():
    # one Philox call gives 16 entries: rows q and q + 8 (q % 16 < 8) times keys 2c, 2c + 1 of each
    # 8 of 32 (four bytes per 32-bit word); group them as [call, 16] to test each byte position
    p = 0.25
    keep = attncc.dropout_mask(2, 4, 256, 256, p, seed=3, offset=5).float()
    # query 16g + 8w' + r, key 32a + 16j' + 8y' + 2c + e: call (g, r, a, c), byte 8w' + 4j' + 2y' + e
    calls = keep.reshape(2, 4, 16, 2, 8, 8, 2, 2, 4, 2).permute(0, 1, 2, 4, 5, 8, 3, 6, 7, 9).reshape(-1, 16)
    n = calls.shape[0]
    sigma = ((p * (1 - p)) / n) ** 0.5
    for lane in range(16):
        assert abs(calls[:, lane].mean().item() - (1 - p)) < 5 * sigma, lane
    # bytes of one word, neighbouring words, the two rows of a call
    for a, b in [(0, 1), (1, 2), (3, 4), (0, 8), (7, 15)]:
        both = (calls[:, a] * calls[:, b]).mean().item()
        assert abs(both - (1 - p) ** 2) < 5 * (((1 - p) ** 2 * (1 - (1 - p) ** 2)) / n) ** 0.5, (a, b)


def test_dropout_p_is_rounded_to_the_kernels_8_bit_grid():
    assert attncc.Variant(dropout_p=0.1).dropout_p == 26 / 256
    assert attncc.Variant(dropout_p=0.5).dropout_p == 0.5
    assert attncc.Variant(dropout_p=0.9999999).dropout_p == 255 / 256  # stays below 1
    # the mask applies the rounded probability exactly: threshold 1 of 256 keeps u >= 1
    keep = attncc.dropout_mask(1, 1, 256, 256, 1 / 256, seed=1, offset=0)
    rate = 1 - keep.float().mean().item()
    assert abs(rate - 1 / 256) < 5 * ((1 / 256 * 255 / 256) / keep.numel()) ** 0.5, rate


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
