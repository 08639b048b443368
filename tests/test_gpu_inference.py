"""The inference kernels on a CUDA GPU in bf16 and fp16: decode, KV caches (contiguous and paged),
varlen, MLA head dims and merge_states against the float64 reference."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc import inference
from conftest import LSE_TOL, REL_TOL, rel_err
from variants import BUILDERS, NAMES, causal_mask

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16]


def _close(out, lse, ref, ref_lse, dtype):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_err(out, ref) < REL_TOL[dtype], rel_err(out, ref)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < LSE_TOL[dtype] * 4


def _ref_seq(mods, q, k, v, q_offset, b):
    out, lse = attncc.reference.attention(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        *mods, enable_gqa=True, return_lse=True, q_offset=q_offset, b_offset=b)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lq,lkv,hq,hkv,d", [(1, 4097, 32, 4, 128), (4, 1000, 8, 8, 64), (16, 20000, 8, 1, 128)])
def test_decode(name, dtype, lq, lkv, hq, hkv, d):
    torch.manual_seed(0)
    B = 2
    mods = BUILDERS[name](B, hq, lq, lkv, "cuda")
    q = torch.randn(B, hq, lq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, hkv, lkv, d, device="cuda", dtype=dtype) for _ in range(2))
    with torch.no_grad():
        out, lse = attncc.compile(attncc.Variant(*mods))(q, k, v, enable_gqa=True, return_lse=True)
    ref, ref_lse = attncc.reference.attention(q.double(), k.double(), v.double(), *mods, enable_gqa=True,
                                              return_lse=True)
    _close(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_alibi_a_million_positions_in(dtype):
    """ALiBi's slope * (kv_idx - q_idx) runs on float copies of the positions (exact below 2**24):
    the keys that matter sit next to the query, a million positions in, where a rewrite such as
    slope * kv_idx - slope * q_idx would lose ~0.06 to float32 rounding."""
    torch.manual_seed(4)
    hq, hkv, D, L = 2, 1, 32, 1 << 20
    mods = BUILDERS["alibi"](1, hq, 1, L + 1, "cuda")
    compiled = attncc.compile(attncc.Variant(*mods))
    cache = attncc.KVCache(1, L + 1, hkv, D, dtype, "cuda")
    k, v = (torch.randn(1, L + 1, hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    cache.append(k[:, :L], v[:, :L])
    q = torch.randn(1, 1, hq, D, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, lse = compiled.with_kvcache(q, cache, k[:, L:], v[:, L:], return_lse=True)
    _close(out[0], lse[0], *_ref_seq(mods, q[0], k[0], v[0], L, 0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("page_size", [0, 16, 64, 256])
def test_kvcache(name, dtype, page_size):
    """Ragged prefill then two decode steps, contiguous (page_size 0) or paged with scattered pages."""
    torch.manual_seed(1)
    B, hq, hkv, D, L = 3, 16, 4, 128, 3000
    mods = BUILDERS[name](B, hq, L, L, "cuda")
    compiled = attncc.compile(attncc.Variant(*mods))
    if page_size:
        cache = attncc.PagedKVCache(B * -(-L // page_size) + 4, page_size, hkv, D, dtype, "cuda", seed=3)
    else:
        cache = attncc.KVCache(B, L, hkv, D, dtype, "cuda")
    lens = [1000, 1, 2900]
    cu = torch.tensor([0, 1000, 1001, 3901], dtype=torch.int32, device="cuda")
    q = torch.randn(3901, hq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(3901, hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    keys, values = [], []
    with torch.no_grad():
        out, lse = compiled.with_kvcache(q, cache, k, v, cu_seqlens_q=cu, return_lse=True)
    for b in range(B):
        s = slice(int(cu[b]), int(cu[b + 1]))
        keys.append(k[s])
        values.append(v[s])
        if b != 2:  # the 2900-token prompt's dense reference is large; decode steps cover it
            _close(out[s], lse[s], *_ref_seq(mods, q[s], k[s], v[s], 0, b), dtype)
    for n in (1, 5):
        q = torch.randn(B, n, hq, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(B, n, hkv, D, device="cuda", dtype=dtype) for _ in range(2))
        with torch.no_grad():
            out, lse = compiled.with_kvcache(q, cache, k, v, return_lse=True)
        for b in range(B):
            keys[b], values[b] = torch.cat([keys[b], k[b]]), torch.cat([values[b], v[b]])
            _close(out[b], lse[b], *_ref_seq(mods, q[b], keys[b], values[b], len(keys[b]) - n, b), dtype)
    assert cache.lengths() == [x + 6 for x in lens]


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_equals_contiguous(dtype):
    torch.manual_seed(2)
    compiled = attncc.compile(attncc.Variant(None, causal_mask))
    flat = attncc.KVCache(4, 9000, 8, 128, dtype, "cuda")
    paged = attncc.PagedKVCache(4 * 9000 // 64 + 8, 64, 8, 128, dtype, "cuda", seed=0)
    for n in (3000, 7, 5000):
        k, v = (torch.randn(4, n, 8, 128, device="cuda", dtype=dtype) for _ in range(2))
        flat.append(k, v)
        paged.append(k, v)
    q = torch.randn(4, 1, 32, 128, device="cuda", dtype=dtype)
    with torch.no_grad():
        assert torch.equal(compiled.with_kvcache(q, flat), compiled.with_kvcache(q, paged))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_captured_in_a_cuda_graph(dtype, monkeypatch):
    """While a CUDA graph is captured, decoding splits the keys from SPLIT_MIN_KV_CAPTURED on (an
    eager call would not split 1000 keys); the replayed graph gives the reference's result, with
    a contiguous and a paged cache alike, and replays with new inputs copied in."""
    torch.manual_seed(6)
    splits = []
    num_splits = inference.num_splits
    monkeypatch.setattr(inference, "num_splits", lambda *a, **kw: splits.append(num_splits(*a, **kw)[0]) or
                        num_splits(*a, **kw))
    mods = BUILDERS["softcap"](2, 32, 1, 1000, "cuda")  # position-free: the cache sees q_idx = 999
    compiled = attncc.compile(attncc.Variant(*mods))
    k, v = (torch.randn(2, 4, 1000, 128, device="cuda", dtype=dtype) for _ in range(2))
    paged = attncc.PagedKVCache(2 * 1000 // 64 + 4, 64, 4, 128, dtype, "cuda", seed=0)
    paged.append(k.transpose(1, 2), v.transpose(1, 2))
    q = torch.zeros(2, 32, 1, 128, device="cuda", dtype=dtype)
    with torch.no_grad():
        step = lambda: (compiled(q, k, v, enable_gqa=True, return_lse=True),  # noqa: E731
                        compiled.with_kvcache(q.transpose(1, 2), paged))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        assert splits[-2:] == [1, 1]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (out, lse), out_paged = step()
        assert splits[-2] > 1 and splits[-1] == splits[-2]
        for _ in range(2):
            q.copy_(torch.randn_like(q))
            graph.replay()
            torch.cuda.synchronize()
            ref, ref_lse = attncc.reference.attention(q.double(), k.double(), v.double(), *mods, enable_gqa=True,
                                                      return_lse=True)
            _close(out, lse, ref, ref_lse, dtype)
            assert torch.equal(out_paged.transpose(1, 2), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["causal", "document", "alibi", "softcap"])
def test_varlen(name, dtype):
    torch.manual_seed(3)
    lq, lkv = [1, 700, 17, 1500], [1, 900, 17, 1500]
    mods = BUILDERS[name](4, 8, 1500, 1500, "cuda")
    cu_q = torch.tensor([0, 1, 701, 718, 2218], dtype=torch.int32, device="cuda")
    cu_kv = torch.tensor([0, 1, 901, 918, 2418], dtype=torch.int32, device="cuda")
    q = torch.randn(2218, 8, 96, device="cuda", dtype=dtype)  # head dim 96 = 64 + 32
    k, v = (torch.randn(2418, 2, 96, device="cuda", dtype=dtype) for _ in range(2))
    with torch.no_grad():
        out, lse = attncc.compile(attncc.Variant(*mods)).varlen(q, k, v, cu_q, cu_kv, return_lse=True)
    for b in range(4):
        sq, skv = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_kv[b]), int(cu_kv[b + 1]))
        _close(out[sq], lse[sq], *_ref_seq(mods, q[sq], k[skv], v[skv], lkv[b] - lq[b], b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,lq", [(16, 1), (128, 1), (128, 2)])
def test_mla_latent_cache(dtype, heads, lq):
    """MLA's absorbed decode: MQA over keys of dim 576 (= 512 + 64) whose first 512 channels are the values."""
    torch.manual_seed(4)
    B, L = 2, 5000
    cache = attncc.KVCache(B, L, 1, 576, dtype, "cuda", head_dim_v=512, value_from_key=True)
    cache.append(torch.randn(B, L - lq, 1, 576, device="cuda", dtype=dtype))
    q = torch.randn(B, lq, heads, 576, device="cuda", dtype=dtype)
    new = torch.randn(B, lq, 1, 576, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, lse = attncc.attention_with_kvcache(q, cache, new, mask_mod=causal_mask, scale=0.1, return_lse=True)
    for b in range(B):
        ref, ref_lse = attncc.reference.attention(
            q[b].double().transpose(0, 1)[None], cache.k[b:b + 1].double(),
            cache.v[b:b + 1].double(), None, causal_mask, scale=0.1, enable_gqa=True,
            return_lse=True, q_offset=L - lq)
        _close(out[b], lse[b], ref[0].transpose(0, 1), ref_lse[0].transpose(0, 1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states(dtype):
    torch.manual_seed(5)
    q = torch.randn(2, 8, 300, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(2, 8, 5000, 128, device="cuda", dtype=dtype) for _ in range(2))
    parts = [attncc.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 1000), (1000, 5000))]
    out, lse = attncc.merge_states(*parts[0], *parts[1])
    ref, ref_lse = attncc.reference.attention(q.double(), k.double(), v.double(), return_lse=True)
    _close(out, lse, ref, ref_lse, dtype)
    assert out.dtype == dtype


def test_dispatch_only_without_grad():
    q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert inference.use_decode(q, k, v, dropout=False)
    assert not inference.use_decode(q.requires_grad_(), k, v, dropout=False)
