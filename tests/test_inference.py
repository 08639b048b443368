"""Inference kernels (attn_kv) against the float64 reference: split-KV decoding, contiguous and
paged KV caches, ragged (varlen) batches, merge_states, and their errors."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc import inference
from conftest import LSE_TOL, REL_TOL, rel_err
from variants import BUILDERS, NAMES, causal_mask


def _close(out, lse, ref, ref_lse, dtype=torch.float32):
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert rel_err(out, ref) < REL_TOL[dtype], rel_err(out, ref)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite.cpu())
    if finite.any():
        assert (lse.double().cpu()[finite] - ref_lse.cpu()[finite]).abs().max() < LSE_TOL[dtype]


def _ref_seq(variant_mods, q, k, v, q_offset, b):
    """Reference for one sequence: q (Lq, Hq, D), k/v (Lkv, Hkv, D) -> out (Lq, Hq, Dv), lse (Lq, Hq)."""
    score_mod, mask_mod = variant_mods
    out, lse = attncc.reference.attention(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        score_mod, mask_mod, enable_gqa=True, return_lse=True, q_offset=q_offset, b_offset=b)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("lq,lkv,hq,hkv", [(1, 300, 4, 2), (3, 257, 2, 2), (16, 333, 4, 1)])
def test_decode_kernel(name, lq, lkv, hq, hkv):
    """attncc.attention's decode path (few queries, many keys, q_idx from 0) equals the reference."""
    torch.manual_seed(0)
    B, D = 2, 16
    mods = BUILDERS[name](B, hq, lq, lkv, "cpu")
    q, k, v = torch.randn(B, hq, lq, D), torch.randn(B, hkv, lkv, D), torch.randn(B, hkv, lkv, D)
    compiled = attncc.compile(attncc.Variant(*mods))
    out, lse = inference.decode(compiled, q, k, v, enable_gqa=True, return_lse=True)
    ref, ref_lse = attncc.reference.attention(q.double(), k.double(), v.double(), *mods, enable_gqa=True,
                                              return_lse=True)
    _close(out, lse, ref, ref_lse)


def test_decode_splits_are_used():
    """The CPU tests must exercise the split-KV path and its merge."""
    splits, split_len = inference.num_splits(programs=2, max_kv_len=300, block_n=32, slots=16, interpret=True)
    assert splits > 1 and split_len % 32 == 0 and (splits - 1) * split_len < 300 <= splits * split_len
    # on a GPU (132 SMs, 2 programs each): no split for short contexts or when the rows fill the
    # GPU; otherwise one wave of programs, each split a multiple of the tile
    assert inference.num_splits(programs=4, max_kv_len=1024, block_n=64, slots=264) == (1, None)
    # while a CUDA graph is being captured: split from SPLIT_MIN_KV_CAPTURED keys
    assert inference.num_splits(programs=4, max_kv_len=1024, block_n=64, slots=264,
                                min_kv=inference.SPLIT_MIN_KV_CAPTURED) == (4, 256)
    assert inference.num_splits(programs=4, max_kv_len=256, block_n=64, slots=264,
                                min_kv=inference.SPLIT_MIN_KV_CAPTURED) == (1, None)
    assert inference.num_splits(programs=264, max_kv_len=131072, block_n=64, slots=264) == (1, None)
    for n_prog, kv in [(4, 4096), (4, 131072), (32, 16384), (100, 5000)]:
        splits, split_len = inference.num_splits(programs=n_prog, max_kv_len=kv, block_n=64, slots=264)
        assert splits > 1 and n_prog * splits <= 264, (n_prog, kv, splits)  # one wave
        assert split_len % 64 == 0 and split_len >= 64 * inference.SPLIT_MIN_TILES
        assert (splits - 1) * split_len < kv <= splits * split_len
    # one wave: B=1 with 4 K/V heads over 128k keys gets 64 splits of 2048 keys
    assert inference.num_splits(programs=4, max_kv_len=131072, block_n=64, slots=264) == (64, 2048)


def test_resident_programs():
    """Shared memory bounds the decode programs per SM (bf16, 64-key tiles, D=128, 3 stages: 2)."""
    assert inference.resident_programs(64, 128, 128, 3, 2) == 2
    assert inference.resident_programs(64, 128, 128, 5, 2) == 1
    assert inference.resident_programs(32, 64, 64, 2, 2) == 4


def test_attention_dispatches_to_decode(monkeypatch):
    """Few queries over many keys without grad take the decode kernel; with grad, the training kernel."""
    calls = []
    real = inference.decode
    monkeypatch.setattr(inference, "decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    with torch.no_grad():
        out = attncc.attention(q, k, v, mask_mod=causal_mask)
    assert calls == [1]
    ref = attncc.reference.attention(q.double(), k.double(), v.double(), None, causal_mask)
    assert rel_err(out, ref) < REL_TOL[torch.float32]
    q.requires_grad_(True)
    attncc.attention(q, k, v, mask_mod=causal_mask).sum().backward()
    assert calls == [1] and q.grad is not None
    with torch.no_grad():
        attncc.attention(q, k[:, :, :200], v[:, :, :200], mask_mod=causal_mask)  # too few keys
        attncc.attention(torch.randn(1, 2, 17, 16), k, v)  # too many queries
    assert calls == [1]
    slopes = torch.rand(2, requires_grad=True)  # a learnable capture needs the training kernels

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    attncc.attention(q.detach(), k, v, score_mod=alibi).sum().backward()
    assert calls == [1] and slopes.grad is not None and slopes.grad.abs().sum() > 0


def _make_cache(kind, B, max_len, hkv, D, dv, seed=0):
    if kind == "contiguous":
        return attncc.KVCache(B, max_len, hkv, D, torch.float32, "cpu", head_dim_v=dv)
    page_size = {"paged16": 16, "paged48": 48}[kind]
    pages = B * -(-max_len // page_size) + 3
    return attncc.PagedKVCache(pages, page_size, hkv, D, torch.float32, "cpu", head_dim_v=dv, seed=seed)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["contiguous", "paged16", "paged48"])
def test_kvcache_prefill_then_decode(name, kind):
    """Ragged prefill into the cache, then decode steps: every step equals the reference with
    queries at their true positions."""
    torch.manual_seed(1)
    B, hq, hkv, D, dv, L = 3, 4, 2, 16, 24, 160
    mods = BUILDERS[name](B, hq, L, L, "cpu")
    compiled = attncc.compile(attncc.Variant(*mods))
    cache = _make_cache(kind, B, L, hkv, D, dv)
    keys, values = [torch.empty(0, hkv, D)] * B, [torch.empty(0, hkv, dv)] * B
    lens = [37, 1, 70]
    cu = torch.tensor([0, 37, 38, 108], dtype=torch.int32)
    q = torch.randn(108, hq, D)
    k, v = torch.randn(108, hkv, D), torch.randn(108, hkv, dv)
    with torch.no_grad():
        out, lse = compiled.with_kvcache(q, cache, k, v, cu_seqlens_q=cu, return_lse=True)
    for b in range(B):
        s = slice(cu[b], cu[b + 1])
        keys[b], values[b] = k[s], v[s]
        ref, ref_lse = _ref_seq(mods, q[s], keys[b], values[b], 0, b)
        _close(out[s], lse[s], ref, ref_lse)
    for step in range(2):
        q, k, v = torch.randn(B, 1 + step, hq, D), torch.randn(B, 1 + step, hkv, D), torch.randn(B, 1 + step, hkv, dv)
        with torch.no_grad():
            out, lse = compiled.with_kvcache(q, cache, k, v, return_lse=True)
        for b in range(B):
            keys[b], values[b] = torch.cat([keys[b], k[b]]), torch.cat([values[b], v[b]])
            ref, ref_lse = _ref_seq(mods, q[b], keys[b], values[b], len(keys[b]) - q.shape[1], b)
            _close(out[b], lse[b], ref, ref_lse)
    assert cache.lengths() == [n + 3 for n in lens]


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
def test_paged_equals_contiguous(page_size, split, monkeypatch):
    """Scattered pages (shuffled free list, interleaved appends) give bit-identical results, with
    split-KV (pages of whole tiles: each split reads its block-table entries up front) and
    without (a block-table read per tile, or per key for pages smaller than a tile)."""
    if not split:
        monkeypatch.setattr(inference, "num_splits", lambda *a, **kw: (1, None))
    torch.manual_seed(2)
    B, hq, hkv, D = 2, 4, 2, 16
    slopes = torch.rand(hq)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    compiled = attncc.compile(attncc.Variant(alibi, causal_mask))
    flat = attncc.KVCache(B, 600, hkv, D, torch.float32, "cpu")
    paged = attncc.PagedKVCache(2 * -(-600 // page_size) + 1, page_size, hkv, D, torch.float32, "cpu", seed=7)
    for n in (100, 1, 200, 3):  # interleaved growth scatters each sequence's pages
        k, v = torch.randn(B, n, hkv, D), torch.randn(B, n, hkv, D)
        flat.append(k, v)
        paged.append(k, v)
    q = torch.randn(B, 2, hq, D)
    with torch.no_grad():
        a = compiled.with_kvcache(q, flat)
        b = compiled.with_kvcache(q, paged)
    assert torch.equal(a, b)
    pages = paged.block_table[0, :-(-304 // page_size)].tolist()
    assert page_size == 256 or pages != sorted(pages) or len(pages) < 3  # not one contiguous run


def test_paged_cache_errors_and_free():
    cache = attncc.PagedKVCache(4, 16, 1, 16, torch.float32, "cpu")
    cache.append(torch.randn(2, 20, 1, 16), torch.randn(2, 20, 1, 16))  # 2 pages each: all 4 used
    with pytest.raises(attncc.AttnccError, match=r"out of pages: sequence 0 needs 1 more, sequence 1 needs 1 more "
                                                  r"page\(s\) of 16 tokens but 0 of 4 are free"):
        cache.append(torch.randn(2, 20, 1, 16), torch.randn(2, 20, 1, 16))
    assert cache.lengths() == [20, 20] and cache.free_pages == 0  # a failed append changes nothing
    cache.free(1)
    assert cache.free_pages >= 2 and cache.lengths() == [20, 0]
    cache.append(torch.randn(20, 1, 16), torch.randn(20, 1, 16), cu_seqlens=torch.tensor([0, 0, 20]))
    assert cache.lengths() == [20, 20]
    assert cache.cache_seqlens.tolist() == [20, 20] and cache.cache_seqlens.dtype == torch.int32
    with pytest.raises(attncc.AttnccError, match="no sequence 5"):
        cache.free(5)
    three = attncc.PagedKVCache(3, 16, 1, 16, torch.float32, "cpu")  # 2 + 2 pages needed, 3 free: none taken
    with pytest.raises(attncc.AttnccError, match="out of pages"):
        three.append(torch.randn(2, 20, 1, 16), torch.randn(2, 20, 1, 16))
    assert three.free_pages == 3 and three.lengths() == []
    three.append(torch.randn(5, 1, 16), torch.randn(5, 1, 16), cu_seqlens=torch.tensor([0, 0, 5]))
    assert three.lengths() == [0, 5] and three.block_table.shape[0] == 2  # an empty sequence has a row too
    three.free(0)
    flat = attncc.KVCache(1, 8, 1, 16, torch.float32, "cpu")
    with pytest.raises(attncc.AttnccError, match="KVCache overflow: sequence 0 would hold 9 tokens but max_len is 8"):
        flat.append(torch.randn(1, 9, 1, 16), torch.randn(1, 9, 1, 16))


def test_kvcache_input_errors():
    cache = attncc.KVCache(2, 32, 2, 16, torch.float32, "cpu")
    with pytest.raises(attncc.AttnccError, match=r"k must be \(batch, new_len, 2, 16\)"):
        cache.append(torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 16))
    with pytest.raises(attncc.AttnccError, match="float16 on cpu but the cache holds torch.float32"):
        cache.append(torch.randn(2, 3, 2, 16, dtype=torch.float16), torch.randn(2, 3, 2, 16))
    with pytest.raises(attncc.AttnccError, match="only 0 cached tokens"):
        with torch.no_grad():
            attncc.attention_with_kvcache(torch.randn(2, 1, 4, 16), cache)
    q = torch.randn(2, 1, 4, 16, requires_grad=True)
    with pytest.raises(attncc.AttnccError, match="forward-only"):
        attncc.attention_with_kvcache(q, cache, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))
    with pytest.raises(attncc.AttnccError, match="cache must be an attncc.KVCache"):
        attncc.attention_with_kvcache(q, "cache")
    table = torch.zeros(64, device="meta")  # a captured tensor on another device than the cache

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx]
    with pytest.raises(attncc.AttnccError, match="is on meta but the inputs are on cpu"):
        with torch.no_grad():
            attncc.attention_with_kvcache(q.detach(), cache, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16),
                                          score_mod=bias)
    slopes = torch.rand(4, requires_grad=True)  # a learnable capture would silently get no gradient

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    with pytest.raises(attncc.AttnccError, match="captured tensor requires grad"):
        attncc.attention_with_kvcache(q.detach(), cache, torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16),
                                      score_mod=alibi)
    assert cache.lengths() == [0, 0]  # a refused call appends nothing


@pytest.mark.parametrize("name", ["causal", "sliding_window", "alibi", "document"])
def test_varlen_ragged(name):
    """Packed sequences of lengths 1, 0, 17, 90 with Lq != Lkv: each equals its own reference."""
    torch.manual_seed(3)
    hq, hkv, D = 4, 2, 48  # head dim 48 = 32 + 16: the kernel's two-piece head dim
    lq, lkv = [1, 0, 17, 40], [1, 5, 17, 90]
    mods = BUILDERS[name](len(lq), hq, 90, 90, "cpu")
    cu_q = torch.tensor([0, 1, 1, 18, 58], dtype=torch.int32)
    cu_kv = torch.tensor([0, 1, 6, 23, 113], dtype=torch.int32)
    q, k, v = torch.randn(58, hq, D), torch.randn(113, hkv, D), torch.randn(113, hkv, D)
    with torch.no_grad():
        out, lse = attncc.compile(attncc.Variant(*mods)).varlen(q, k, v, cu_q, cu_kv, return_lse=True)
    for b in range(4):
        sq, skv = slice(cu_q[b], cu_q[b + 1]), slice(cu_kv[b], cu_kv[b + 1])
        if lq[b] == 0:
            continue
        ref, ref_lse = _ref_seq(mods, q[sq], k[skv], v[skv], lkv[b] - lq[b], b)
        _close(out[sq], lse[sq], ref, ref_lse)


def test_merge_states_equals_one_pass():
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 3, 20, 16), torch.randn(2, 3, 70, 16), torch.randn(2, 3, 70, 24)
    full, full_lse = attncc.attention(q, k, v, return_lse=True)
    parts = [attncc.attention(q, k[:, :, a:b], v[:, :, a:b], return_lse=True) for a, b in ((0, 9), (9, 50), (50, 70))]
    out, lse = attncc.merge_states(*parts[0], *parts[1])
    two, two_lse = attncc.attention(q, k[:, :, :50], v[:, :, :50], return_lse=True)
    assert rel_err(out, two) < 1e-5 and (lse - two_lse).abs().max() < 1e-5
    out, lse = attncc.merge_states([p[0] for p in parts], [p[1] for p in parts])
    assert rel_err(out, full) < 1e-5 and (lse - full_lse).abs().max() < 1e-5
    # a part with no keys for some rows (lse = -inf) contributes nothing; all -inf gives 0 and -inf
    empty_o, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    out2, lse2 = attncc.merge_states(out, lse, empty_o, empty_lse)
    assert torch.equal(lse2, lse) and rel_err(out2, out) < 1e-6
    out3, lse3 = attncc.merge_states(empty_o, empty_lse, empty_o, empty_lse)
    assert (out3 == 0).all() and torch.isinf(lse3).all()
    with pytest.raises(attncc.AttnccError, match="merge_states: every output"):
        attncc.merge_states(out, lse, out[:, :1], lse)


def test_merge_of_more_partials_than_one_chunk():
    """merge_splits reads 64 partials at a time with a running max: 150 partials (three chunks,
    the largest lse in the last one for some rows), a first chunk with no keys for other rows,
    and a row with no keys at all, against torch's logsumexp."""
    torch.manual_seed(5)
    n, rows, dv = 150, 6, 24
    outs, lses = torch.randn(n, rows, dv), torch.randn(n, rows) * 4
    lses[140:, 0] += 30.0      # row 0: the largest weights come in the last chunk
    lses[:64, 1] = float("-inf")  # row 1: the whole first chunk is empty
    lses[:, 2] = float("-inf")  # row 2: no keys
    out, lse = attncc.merge_states(list(outs), list(lses))
    want_lse = torch.logsumexp(lses.double(), 0)
    weights = torch.exp(lses.double() - want_lse.nan_to_num(neginf=0.0))
    want = (weights[..., None] * outs.double()).sum(0)
    ok = [0, 1, 3, 4, 5]
    assert (lse[ok].double() - want_lse[ok]).abs().max() < 1e-5
    assert rel_err(out[ok], want[ok]) < 1e-5
    assert torch.isinf(lse[2]) and lse[2] < 0 and (out[2] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kvcache_half_dtypes(dtype):
    """fp16 and bf16 caches (bf16 runs upcast in the interpreter) within the dtype's tolerance."""
    torch.manual_seed(5)
    cache = attncc.PagedKVCache(8, 32, 2, 16, dtype, "cpu")
    k, v = torch.randn(2, 50, 2, 16, dtype=dtype), torch.randn(2, 50, 2, 16, dtype=dtype)
    q = torch.randn(2, 1, 4, 16, dtype=dtype)
    with torch.no_grad():
        out, lse = attncc.attention_with_kvcache(q, cache, k, v, mask_mod=causal_mask, return_lse=True)
    for b in range(2):
        ref, ref_lse = _ref_seq((None, causal_mask), q[b], k[b], v[b], 49, b)
        _close(out[b], lse[b], ref, ref_lse, dtype)


def test_capture_too_small_for_cache_positions():
    """Index checks use the cache's true positions: a table indexed by q_idx must cover them."""
    table = torch.zeros(40)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx]
    cache = attncc.KVCache(1, 64, 1, 16, torch.float32, "cpu")
    cache.append(torch.randn(1, 50, 1, 16), torch.randn(1, 50, 1, 16))
    with pytest.raises(attncc.AttnccError, match="too small"):
        with torch.no_grad():
            attncc.attention_with_kvcache(torch.randn(1, 1, 1, 16), cache, score_mod=bias)


def test_generated_inference_kernel_snapshot():
    """The kv kernel's source: slopes[h] loaded once per program (h is a per-row vector there),
    mask code only in the last tile loop (a causal mask's whole tiles start at key 0, so there is
    no masked loop before them), the head dim 80 split as 64 + 16."""
    slopes = torch.rand(8)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    src = attncc.compile(attncc.Variant(alibi, causal_mask)).source("kv", torch.float16, head_dim=80, gqa=4)
    kernel = src[src.index("def attn_kv("):src.index("def merge_splits(")]
    assert "range(lo, full_lo, BLOCK_N)" not in kernel and "# full_lo = lo: no tile before the whole ones" in kernel
    before, loops = kernel.split("for start_n in range(full_lo, full_hi, BLOCK_N)")
    unmasked, last = loops.split("for start_n in range(full_hi, hi, BLOCK_N)")
    assert "tl.load(cap0_ptr + (h).to(tl.int64)" in before and "cap0_ptr" not in loops
    assert "keep = (kv_idx <= q_idx)" in last and "keep" not in before
    assert "keep" not in unmasked and "col_ok" not in unmasked
    assert "BLOCK_D=64, BLOCK_D2=16" in src and "GROUP=4" in src
    assert "h = h_kv * GROUP + (rows % GROUP)[:, None]" in kernel  # GQA packing: one K/V read per group
    # a sliding window cuts tiles before its whole ones too: that loop stays
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 256)  # noqa: E731
    window_src = attncc.compile(attncc.Variant(mask_mod=window)).source("kv", torch.float16, head_dim=64)
    assert "for start_n in range(lo, full_lo, BLOCK_N):  # tiles the mask cuts" in window_src


def test_merge_is_a_programmatic_dependent_launch_on_hopper():
    """From sm90 on, merge_splits is launched with PDL and waits (gdc_wait) for attn_kv, which lets
    it start early (gdc_launch_dependents); an older GPU or the interpreter (which has no GDC
    instructions) gets neither."""
    compiled = attncc.compile(attncc.Variant())
    for target, pdl in (("cuda-sm90", True), ("cuda-sm100", True), ("cuda-sm80", False), ("interpreter", False)):
        src = compiled.source("kv", torch.float16, head_dim=64, gqa=4, target=target)
        kernel = src[src.index("def attn_kv("):src.index("def merge_splits(")]
        merge = src[src.index("def merge_splits("):src.index("# kernels launched from Python")]
        assert ("tl.extra.cuda.gdc_launch_dependents()" in kernel) == pdl, target
        assert ("tl.extra.cuda.gdc_wait()" in merge) == pdl, target
        assert ("launch_pdl=True" in merge) == pdl, target


def test_max_seqlen_below_the_longest_sequence_is_refused():
    """FlashAttention's max_seqlen_q/kv are upper bounds: one below the longest sequence would
    leave rows unwritten (varlen returned 58 of 90 rows as uninitialised memory) or keys unread
    (split-KV covers max_seqlen_kv keys). The host reads the offsets anyway: it refuses such a
    hint, and launches with the true maxima whatever larger hint is given."""
    torch.manual_seed(6)
    compiled = attncc.compile(attncc.Variant(mask_mod=causal_mask))
    q, k, v = torch.randn(100, 2, 16), torch.randn(130, 1, 16), torch.randn(130, 1, 16)
    cu_q = torch.tensor([0, 90, 100], dtype=torch.int32)
    cu_kv = torch.tensor([0, 95, 130], dtype=torch.int32)
    with torch.no_grad():
        with pytest.raises(attncc.AttnccError, match="max_seqlen_q=32 is below the longest sequence: sequence 0 "
                                                      "has 90 tokens"):
            compiled.varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=32)
        with pytest.raises(attncc.AttnccError, match="max_seqlen_kv=64 is below the longest sequence: sequence 0 "
                                                      "has 95 tokens"):
            compiled.varlen(q, k, v, cu_q, cu_kv, max_seqlen_kv=64)
        with pytest.raises(attncc.AttnccError, match="max_seqlen_q must be an int, got 90.0"):
            compiled.varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=90.0)
        out, lse = compiled.varlen(q, k, v, cu_q, cu_kv, max_seqlen_q=4096, max_seqlen_kv=4096, return_lse=True)
        assert torch.equal(out, compiled.varlen(q, k, v, cu_q, cu_kv))  # a larger hint changes nothing
    for b, (sq, skv) in enumerate([(slice(0, 90), slice(0, 95)), (slice(90, 100), slice(95, 130))]):
        _close(out[sq], lse[sq], *_ref_seq((None, causal_mask), q[sq], k[skv], v[skv], skv.stop - skv.start
                                           - (sq.stop - sq.start), b))

    cache = attncc.PagedKVCache(16, 16, 1, 16, torch.float32, "cpu")
    with torch.no_grad(), pytest.raises(attncc.AttnccError, match="max_seqlen_q=32 is below"):
        compiled.with_kvcache(q, cache, k[:100], v[:100], cu_seqlens_q=cu_q, max_seqlen_q=32)
    assert cache.lengths() == [] and cache.free_pages == 16  # refused before the append
    with torch.no_grad():
        out, lse = compiled.with_kvcache(q, cache, k[:100], v[:100], cu_seqlens_q=cu_q, max_seqlen_q=90,
                                         return_lse=True)
    for b, s in enumerate([slice(0, 90), slice(90, 100)]):
        _close(out[s], lse[s], *_ref_seq((None, causal_mask), q[s], k[s], v[s], 0, b))


@pytest.mark.parametrize("path", ["varlen", "with_kvcache"])
def test_packed_rows_after_the_last_offset_are_zero(path):
    """Packed queries may have rows after cu_seqlens_q[-1] (a padded buffer): they belong to no
    sequence, and come back as 0 with lse -inf, not as uninitialised memory."""
    torch.manual_seed(7)
    compiled = attncc.compile(attncc.Variant(mask_mod=causal_mask))
    q, k, v = torch.randn(70, 4, 16), torch.randn(50, 2, 16), torch.randn(50, 2, 16)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    with torch.no_grad():
        if path == "varlen":
            out, lse = compiled.varlen(q, k, v, cu, cu, return_lse=True)
        else:
            cache = attncc.KVCache(2, 64, 2, 16, torch.float32, "cpu")
            out, lse = compiled.with_kvcache(q, cache, k, v, cu_seqlens_q=cu, return_lse=True)
    assert (out[50:] == 0).all() and torch.isneginf(lse[50:]).all()
    for b, s in enumerate([slice(0, 20), slice(20, 50)]):
        _close(out[s], lse[s], *_ref_seq((None, causal_mask), q[s], k[s], v[s], 0, b))
