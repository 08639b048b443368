"""KV caches against bad input and edited state: refused calls leave a cache as it was, its
lengths and block table are its own (copies out, checked edits in), packed appends check their
offsets, and no state of a cache makes the kernel read outside the cache's storage."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import attncc
from conftest import assert_close_to_reference, reference
from variants import causal_mask


def _check_cache(compiled_out, q, keys, values, mask_mod=causal_mask):
    """out, lse (B, Lq, Hq, Dv) of a cache call against the float64 reference on each sequence's
    keys (lists of (L_b, Hkv, D)), with the queries as the newest tokens."""
    out, lse = compiled_out
    for b, (kb, vb) in enumerate(zip(keys, values)):
        t = lambda x: x.transpose(0, 1)[None]  # noqa: E731  (L, H, D) -> (1, H, L, D)
        ref, ref_lse = reference(t(q[b]), t(kb), t(vb), None, mask_mod, enable_gqa=True,
                                 q_offset=len(kb) - q.shape[1], b_offset=b)
        assert_close_to_reference(t(out[b]), lse[b].transpose(0, 1)[None], ref, ref_lse, q.dtype)


def _caches(hkv=2, d=16, dv=None):
    return [attncc.KVCache(2, 64, hkv, d, torch.float32, "cpu", head_dim_v=dv),
            attncc.PagedKVCache(12, 16, hkv, d, torch.float32, "cpu", head_dim_v=dv, seed=1)]


def _state(cache):
    paged = isinstance(cache, attncc.PagedKVCache)
    return cache.lengths(), cache.free_pages if paged else None, cache.block_table.tolist() if paged else None


@pytest.mark.parametrize("kind", [0, 1], ids=["contiguous", "paged"])
def test_refused_with_kvcache_call_leaves_the_cache_as_it_was(kind):
    """Every check of with_kvcache runs before its append: query heads that are no multiple of
    the cache's K/V heads, or a value head dim the kernel does not take, are refused with the
    cache's lengths, pages and block table unchanged (the heads used to be checked after the
    append: lengths 2 -> 3)."""
    torch.manual_seed(0)
    cache = _caches()[kind]
    k0, v0 = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    cache.append(k0, v0)
    before = _state(cache)
    k1, v1 = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    compiled = attncc.compile(attncc.Variant(mask_mod=causal_mask))
    with torch.no_grad(), pytest.raises(attncc.AttnccError, match=r"query heads \(3\) must be a multiple of "
                                                                    r"key/value heads \(2\)"):
        compiled.with_kvcache(torch.randn(2, 1, 3, 16), cache, k1, v1)
    assert _state(cache) == before
    q = torch.randn(2, 1, 4, 16)
    with torch.no_grad():
        result = compiled.with_kvcache(q, cache, k1, v1, return_lse=True)
    _check_cache(result, q, torch.cat([k0, k1], 1), torch.cat([v0, v1], 1))

    wide = _caches(hkv=1, dv=600)[kind]  # value head dim 600 > the kernel's 512
    wide.append(torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 600))
    before = _state(wide)
    with torch.no_grad(), pytest.raises(attncc.AttnccError, match=r"head dims 16 \(query/key\) and 600 \(value\)"):
        compiled.with_kvcache(torch.randn(2, 1, 1, 16), wide, torch.randn(2, 1, 1, 16), torch.randn(2, 1, 1, 600))
    assert _state(wide) == before


@pytest.mark.parametrize("page_size", [4, 16, 64])
def test_cache_state_handed_out_is_a_copy(page_size):
    """block_table and cache_seqlens are copies: editing them (pages 7 and -5, lengths 1000, as
    a FlashAttention user might) changes nothing; the results still equal the reference. Page
    sizes 4, 16, 64: a block-table read per key, per tile, and per split up front."""
    torch.manual_seed(1)
    compiled = attncc.compile(attncc.Variant(mask_mod=causal_mask))
    cache = attncc.PagedKVCache(3 * -(-40 // page_size) + 2, page_size, 1, 16, torch.float32, "cpu", seed=2)
    k, v = torch.randn(2, 40, 1, 16), torch.randn(2, 40, 1, 16)
    cache.append(k, v)
    table, lens = cache.block_table, cache.cache_seqlens
    assert table.dtype == lens.dtype == torch.int32 and lens.tolist() == [40, 40]
    table[0, 0], table[1, :] = 7, -5
    lens.fill_(1000)
    cache.cache_seqlens.fill_(1000)
    assert cache.block_table.tolist() != table.tolist() and cache.cache_seqlens.tolist() == [40, 40]
    q = torch.randn(2, 2, 2, 16)
    with torch.no_grad():
        _check_cache(compiled.with_kvcache(q, cache, return_lse=True), q, k, v)
    flat = attncc.KVCache(2, 48, 1, 16, torch.float32, "cpu")
    flat.append(k, v)
    flat.cache_seqlens.fill_(1000)
    with torch.no_grad():
        _check_cache(compiled.with_kvcache(q, flat, return_lse=True), q, k, v)


_CORRUPT = """
import torch, attncc
compiled = attncc.compile(attncc.Variant())
q = torch.randn(2, 1, 2, 16)
with torch.no_grad():
    for cache in (attncc.PagedKVCache(6, 4, 1, 16, torch.float32, "cpu"),
                  attncc.PagedKVCache(4, 16, 1, 16, torch.float32, "cpu"),
                  attncc.PagedKVCache(4, 64, 1, 16, torch.float32, "cpu"),
                  attncc.KVCache(2, 12, 1, 16, torch.float32, "cpu")):
        cache.append(torch.randn(2, 12, 1, 16), torch.randn(2, 12, 1, 16))
        state = cache.kernel_args()  # the tensors the kernel reads, changed behind the cache's back
        for page, length in ((10**6, 10**6), (-5, -7), (7, 1000)):
            if state["block_table"] is not None:
                state["block_table"][0].fill_(page)
                state["block_table"][1, 0] = -page
            state["kv_lens"].fill_(length)
            out = compiled.with_kvcache(q, cache)
            assert torch.isfinite(out).all(), (cache, page, length)
print("ok")
"""


def test_corrupt_cache_state_cannot_reach_outside_the_cache():
    """The kernel clamps block-table entries to the pool's pages and keeps its reads in a
    sequence's row of the table (or a contiguous cache's max_len), so that even state changed
    behind the cache's back (entries 10**6, -5 and 7 in a pool of 4 to 6 pages; lengths 10**6,
    -7 and 1000) reads inside the cache: finite output, never a segfault (the old kernel's
    fate). In a child process, so that a crash fails this test alone."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(_CORRUPT)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-2000:])


_SAME = None  # with_kvcache refuses the offsets as cu_seqlens_q, at most the queries' rows


@pytest.mark.parametrize("cu, message, call_message", [
    (torch.tensor([0.0, 3.0]), r"cu_seqlens must hold integers \(int32\), got torch.float32", _SAME),
    ([0, 3], r"cu_seqlens must be a 1-d int32 tensor of batch \+ 1 offsets .* got list", _SAME),
    (torch.tensor([], dtype=torch.int32), r"cu_seqlens must be a 1-d int32 tensor .* got shape \(0,\)", _SAME),
    (torch.tensor([[0, 3]], dtype=torch.int32), r"cu_seqlens must be a 1-d int32 tensor .* got shape \(1, 2\)",
     _SAME),
    (torch.tensor([0, 3], dtype=torch.int32, device="meta"), "cu_seqlens is a meta tensor", _SAME),
    (torch.tensor([0, 2, 1, 3], dtype=torch.int32), r"cu_seqlens must rise from 0 to the 3 packed tokens, "
                                                    r"got \[0, 2, 1, 3\]", _SAME),
    (torch.tensor([1, 3], dtype=torch.int32), r"cu_seqlens must rise from 0 to the 3 packed tokens, got \[1, 3\]",
     _SAME),
    (torch.tensor([0, 2], dtype=torch.int32), r"cu_seqlens must rise from 0 to the 3 packed tokens, got \[0, 2\]",
     "cu_seqlens_q ends at 2 but the new keys have 3 packed tokens"),
], ids=["float", "list", "empty", "2-d", "meta", "falling", "shifted", "short"])
def test_packed_append_checks_cu_seqlens(cu, message, call_message):
    """A packed append checks its offsets with the check varlen uses, before it changes
    anything: floats, lists, empty, 2-d or meta tensors, falling, shifted or short offsets are
    refused (they gave TypeError, AttributeError, IndexError or NotImplementedError). So does
    with_kvcache, whose cu_seqlens_q offsets the queries (at most their rows) and the new keys
    (all of theirs)."""
    if call_message is _SAME:
        call_message = message.replace("cu_seqlens", "cu_seqlens_q").replace("to the 3", "to at most the 3")
    for cache in _caches():
        cache.append(torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))
        before = _state(cache)
        with pytest.raises(attncc.AttnccError, match=message):
            cache.append(torch.randn(3, 2, 16), torch.randn(3, 2, 16), cu_seqlens=cu)
        with pytest.raises(attncc.AttnccError, match=message):
            cache.lengths_after(torch.randn(3, 2, 16), torch.randn(3, 2, 16), cu_seqlens=cu)
        with torch.no_grad(), pytest.raises(attncc.AttnccError, match=call_message):
            attncc.attention_with_kvcache(torch.randn(3, 4, 16), cache, torch.randn(3, 2, 16), torch.randn(3, 2, 16),
                                          cu_seqlens_q=cu)
        assert _state(cache) == before


def test_varlen_shares_the_cu_seqlens_check():
    q = torch.randn(3, 2, 16)
    with torch.no_grad():
        for cu, message in ([0, 3], "cu_seqlens_kv must be a 1-d int32 tensor"), \
                           (torch.tensor([0.0, 3.0]), r"cu_seqlens_kv must hold integers \(int32\)"):
            with pytest.raises(attncc.AttnccError, match=message):
                attncc.attention_varlen(q, q, q, torch.tensor([0, 3], dtype=torch.int32), cu)


def test_sequence_numbers_are_checked():
    """reset, free and truncate take a sequence number 0..batch-1: -1 no longer means the last
    sequence, and floats or bools are refused, with the lengths unchanged."""
    flat, paged = _caches()
    for cache in (flat, paged):
        cache.append(torch.randn(2, 5, 2, 16), torch.randn(2, 5, 2, 16))
        before = _state(cache)
        clear = cache.reset if cache is flat else cache.free
        for b, message in ((-1, "no sequence -1: the cache holds 2"), (2, "no sequence 2"),
                           (1.0, "sequence number must be an int, got 1.0"), (True, "must be an int, got True")):
            with pytest.raises(attncc.AttnccError, match=message):
                clear(b)
            with pytest.raises(attncc.AttnccError, match=message):
                cache.truncate(b, 0)
        assert _state(cache) == before
    flat.reset(1)
    flat.reset()
    assert flat.lengths() == [0, 0]


@pytest.mark.parametrize("kind", [0, 1], ids=["contiguous", "paged"])
def test_truncate(kind):
    """truncate(b, n) keeps a sequence's first n tokens (a speculative decoder drops rejected
    draft tokens); a paged cache takes back the pages past them. Attention then sees exactly the
    kept tokens plus what is appended after them."""
    torch.manual_seed(3)
    cache = _caches()[kind]
    k, v = torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 16)
    cache.append(k, v)
    free = cache.free_pages if kind else None
    cache.truncate(0, 17)
    cache.truncate(1, 40)
    assert cache.lengths() == [17, 40] and cache.cache_seqlens.tolist() == [17, 40]
    if kind:
        assert cache.free_pages == free + 1  # 40 tokens took 3 pages of 16, 17 tokens take 2
    with pytest.raises(attncc.AttnccError, match="sequence 0 holds 17 tokens, so it can keep 0 to 17 of them, not 18"):
        cache.truncate(0, 18)
    with pytest.raises(attncc.AttnccError, match="not -1"):
        cache.truncate(0, -1)
    k1, v1 = torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    q = torch.randn(2, 1, 4, 16)
    with torch.no_grad():
        result = attncc.attention_with_kvcache(q, cache, k1, v1, mask_mod=causal_mask, return_lse=True)
    _check_cache(result, q, [torch.cat([k[0, :17], k1[0]]), torch.cat([k[1], k1[1]])],
                 [torch.cat([v[0, :17], v1[0]]), torch.cat([v[1], v1[1]])])
