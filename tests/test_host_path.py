"""The host path of a call (issue 33): what attncc caches between calls, and that a cache never
answers for inputs it was not built from.

    decisions   a call's checks and decisions (Spec, module) are kept per signature
                (checks.signature): a repeated call takes them after one lookup; any change the
                checks or decisions read (shape, stride, dtype, enable_gqa, a captured tensor's
                shape, a knob) makes a new signature, checked and decided afresh; freed storage
                is checked on every call
    registry    the op finds its CompiledAttention by weak reference, and another one once it dies
    graphs      dropout calls are attncc::attention_dropout ops, kept out of CUDA graphs;
                captured calls classify block-sparse tiles without the caches (autograd.Launch.blocks)

Results are compared with the float64 reference on fresh inputs after every change.
"""
from __future__ import annotations

import copy
import gc
from types import SimpleNamespace

import pytest
import torch

import attncc
from attncc import autograd, blocks, runtime
from conftest import assert_close_to_reference, check, randn_qkv

runtime.target_for(torch.device("cpu"))  # the interpreter, before torch.compile imports triton


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi_kernel(H=2, **kw):
    slopes = torch.rand(H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return attncc.compile(attncc.Variant(alibi, causal, **kw)), slopes


@pytest.fixture
def decisions(monkeypatch):
    """Counts of fresh decisions (autograd._launch) and of with_fallback runs."""
    counts = {"launch": 0, "fallback": 0}
    launch, fallback = autograd._launch, autograd.with_fallback

    def counting_launch(*args, **kwargs):
        counts["launch"] += 1
        return launch(*args, **kwargs)

    def counting_fallback(*args, **kwargs):
        counts["fallback"] += 1
        return fallback(*args, **kwargs)
    monkeypatch.setattr(autograd, "_launch", counting_launch)
    monkeypatch.setattr(autograd, "with_fallback", counting_fallback)
    return counts


def test_a_repeated_call_takes_the_kept_decision_and_module(decisions):
    kernel, slopes = alibi_kernel()
    for i in range(3):
        q, k, v = randn_qkv(1, 2, 2, 40, 40, 16)
        check(q, k, v, kernel=kernel, score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), mask_mod=causal)
        assert decisions == {"launch": 1, "fallback": 1}, i
    assert len(kernel._calls) == 1


@pytest.mark.parametrize("change", ["length", "dtype", "stride", "head dim", "gqa", "capture shape",
                                    "index-check knob", "tiles knob"])
def test_a_change_the_decisions_read_decides_afresh(change, decisions, monkeypatch):
    H = 4
    table = torch.randn(H, 64)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx]
    kernel = attncc.compile(attncc.Variant(bias, causal))
    score_mod = lambda s, b, h, qi, ki: s + table[h, ki]  # noqa: E731 (the reference's)
    q, k, v = randn_qkv(1, H, H, 24, 24, 16)
    kernel(q, k, v)
    assert decisions["launch"] == 1
    gqa = False
    if change == "length":
        q, k, v = randn_qkv(1, H, H, 24, 40, 16)
    elif change == "dtype":
        q, k, v = randn_qkv(1, H, H, 24, 24, 16, dtype=torch.float16)
    elif change == "stride":  # (B, L, H, D) memory seen as (B, H, L, D)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in randn_qkv(1, H, H, 24, 24, 16))
    elif change == "head dim":
        q, k, v = randn_qkv(1, H, H, 24, 24, 32)
    elif change == "gqa":
        q, k, v, gqa = *randn_qkv(1, H, 2, 24, 24, 16), True
    elif change == "capture shape":  # the same tensor object, more columns
        table.data = torch.randn(H, 80)
    elif change == "index-check knob":
        monkeypatch.setenv("ATTNCC_INDEX_CHECK", "all")
    elif change == "tiles knob":
        monkeypatch.setenv("ATTNCC_TILES", '{"attn_fwd": [32, 32, 4, 1]}')
    check(q, k, v, kernel=kernel, score_mod=score_mod, mask_mod=causal, enable_gqa=gqa)
    assert decisions["launch"] == 2
    assert len(kernel._calls) == 2


def test_checks_whose_inputs_a_signature_lacks_still_run_on_every_call():
    kernel, _ = alibi_kernel()
    q, k, v = randn_qkv(1, 2, 2, 24, 24, 16)
    kernel(q, k, v)
    freed = k.clone()
    freed.untyped_storage().resize_(0)
    with pytest.raises(attncc.AttnccError, match="key .* has no storage"):
        kernel(q, freed, v)  # the same signature as the call before


def test_a_captured_tensor_grown_too_small_is_refused_again(monkeypatch):
    table = torch.randn(2, 64)
    kernel = attncc.compile(attncc.Variant(lambda s, b, h, qi, ki: s + table[h, ki]))
    q, k, v = randn_qkv(1, 2, 2, 24, 48, 16)
    kernel(q, k, v)
    table.data = torch.randn(2, 32)  # now too small for 48 keys: a new signature, checked
    with pytest.raises(attncc.AttnccError, match="too small for its index `kv_idx`"):
        kernel(q, k, v)
    monkeypatch.setenv("ATTNCC_TMA", "sometimes")  # a bad knob raises on a kept signature too
    table.data = torch.randn(2, 64)
    with pytest.raises(attncc.AttnccError, match="ATTNCC_TMA"):
        kernel(q, k, v)


def test_bad_inputs_are_refused_after_good_ones_with_the_same_message():
    kernel, _ = alibi_kernel()
    q, k, v = randn_qkv(1, 2, 2, 24, 24, 16)
    kernel(q, k, v)
    with pytest.raises(attncc.AttnccError, match="pass enable_gqa=True"):
        kernel(q, *randn_qkv(1, 2, 1, 24, 24, 16)[1:])
    with pytest.raises(attncc.AttnccError, match="must be 4-D"):
        kernel(q[0], k, v)
    with pytest.raises(attncc.AttnccError, match="must be a torch.Tensor"):
        kernel(q.tolist(), k, v)
    with pytest.raises(attncc.AttnccError, match="layout"):
        kernel(q.to_sparse(), k, v)


def test_captures_other_than_the_variants_own_are_checked_every_call(decisions):
    """nn.Attention passes its attributes; reassigned, they are not the tensors the variant's
    index check reads, so such calls keep no decision."""
    H = 2
    slopes = torch.rand(H)
    attn = attncc.nn.Attention(attncc.Variant(lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), causal))
    name = attn._capture_names[0]
    setattr(attn, name, torch.rand(H))  # another tensor of the same shape, under the capture's name
    q, k, v = randn_qkv(1, H, H, 24, 24, 16)
    for _ in range(2):
        out = attn(q, k, v)
    assert decisions["launch"] == 2 and not attn.compiled._calls
    ref = attncc.reference.attention(q.double(), k.double(), v.double(),
                                     lambda s, b, h, qi, ki: s + getattr(attn, name)[h].double() * (ki - qi), causal)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_gradients_through_the_kept_path_equal_the_reference():
    kernel, slopes = alibi_kernel()
    slopes.requires_grad_()
    for _ in range(2):  # the second call takes the kept decision and module
        q, k, v = (t.requires_grad_() for t in randn_qkv(1, 2, 2, 40, 40, 16))
        grads = torch.autograd.grad(kernel(q, k, v).square().sum(), (q, k, v, slopes))
        qd, kd, vd, sd = (t.detach().double().requires_grad_() for t in (q, k, v, slopes))
        ref = attncc.reference.attention(qd, kd, vd, lambda s, b, h, qi, ki: s + sd[h] * (ki - qi), causal)
        want = torch.autograd.grad(ref.square().sum(), (qd, kd, vd, sd))
        for g, w in zip(grads, want):
            assert ((g.double() - w).norm() / w.norm()).item() < 1e-4


def test_the_op_keeps_decisions_apart_from_eager_calls_and_from_its_backward(decisions):
    kernel, slopes = alibi_kernel()
    key = kernel.variant.ir_key
    q, k, v = (t.requires_grad_() for t in randn_qkv(1, 2, 2, 24, 24, 16))
    for _ in range(2):
        out, lse = torch.ops.attncc.attention.default(q, k, v, [slopes], None, key, None, 0.0, False)
        torch.autograd.grad(out.sum(), (q, k, v))
    kernel(q, k, v)
    assert decisions["launch"] == 3  # op forward, op backward, eager: three signatures, each decided once
    want_out, want_lse = kernel(q, k, v, return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_the_decision_table_is_bounded(monkeypatch):
    monkeypatch.setattr(autograd, "MAX_DECISIONS", 2)
    kernel, _ = alibi_kernel()
    for L in (20, 24, 28, 32):
        kernel(*randn_qkv(1, 2, 2, L, L, 16))
        assert len(kernel._calls) <= 2


def test_copies_after_calls_start_with_no_decisions():
    kernel, slopes = alibi_kernel()
    attn = attncc.nn.Attention(kernel)
    q, k, v = randn_qkv(1, 2, 2, 24, 24, 16)
    want = attn(q, k, v)
    twin = copy.deepcopy(attn)
    assert twin.compiled._calls == {} and kernel._calls  # a cache of the original only
    assert torch.equal(twin(q, k, v), want)


def test_the_op_finds_another_live_kernel_once_the_one_it_found_is_gone():
    q, k, v = randn_qkv(1, 2, 2, 24, 24, 16)

    def kernel():
        return attncc.compile(attncc.Variant(None, causal))
    first = kernel()
    key = first.variant.ir_key
    assert autograd._find(key) is first
    second = kernel()
    del first
    gc.collect()
    assert autograd._find(key) is second
    out = torch.ops.attncc.attention.default(q, k, v, [], None, key, None, 0.0, False)[0]
    assert torch.equal(out, second(q, k, v))


def test_dropout_calls_are_ops_kept_out_of_cuda_graphs():
    unsafe = getattr(torch._C.Tag, "cudagraph_unsafe", None)
    if unsafe is None:
        pytest.skip("this torch has no cudagraph_unsafe tag")
    ops = torch.ops.attncc
    assert unsafe in ops.attention_dropout.default.tags and unsafe in ops.attention_dropout_backward.default.tags
    assert unsafe not in ops.attention.default.tags and unsafe not in ops.attention_backward.default.tags


def test_compiled_dropout_traces_to_the_dropout_op():
    import torch._dynamo
    kernel, _ = alibi_kernel(dropout_p=0.25)
    q, k, v = randn_qkv(1, 2, 2, 24, 24, 16)
    torch._dynamo.reset()
    train = torch._dynamo.explain(lambda q, k, v: kernel(q, k, v))(q, k, v)
    evaluate = torch._dynamo.explain(lambda q, k, v: kernel(q, k, v, training=False))(q, k, v)
    torch._dynamo.reset()
    assert train.graph_break_count == 0 and "torch.ops.attncc.attention_dropout.default" in train.graphs[0].code
    assert "attention_dropout" not in evaluate.graphs[0].code


def test_opcheck_dropout_ops():
    kernel, slopes = alibi_kernel(dropout_p=0.2)
    q, k, v = (t.requires_grad_() for t in randn_qkv(1, 2, 2, 20, 20, 16))
    slopes.requires_grad_()
    key = kernel.variant.ir_key
    args = (q, k, v, [slopes], torch.tensor([5, 9]), key, None, 0.2, False)
    torch.library.opcheck(torch.ops.attncc.attention_dropout.default, args)
    out, lse = torch.ops.attncc.attention_dropout.default(*args)
    bargs = (torch.randn_like(out), torch.randn_like(lse), *(t.detach() for t in (q, k, v, out, lse)),
             [slopes.detach()], torch.tensor([5, 9]), key, None, 0.2, False, [0])
    torch.library.opcheck(torch.ops.attncc.attention_dropout_backward.default, bargs)
    # the same numbers as the op without the tag
    assert torch.equal(out, torch.ops.attncc.attention.default(*args)[0])


def test_dropout_seeds_are_refused_inside_a_cuda_graph_capture(monkeypatch):
    """A captured dropout call would replay its seeds: refused (autograd._seeds)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    rng = torch.tensor([5, 9])
    assert autograd._seeds(rng, 0.25, torch.zeros(1)) == (5, 9, 0.25)  # a CPU call is never captured
    with pytest.raises(attncc.AttnccError, match="CUDA graph"):
        autograd._seeds(rng, 0.25, SimpleNamespace(is_cuda=True))
    assert autograd._seeds(None, 0.0, SimpleNamespace(is_cuda=True)) == ()


def test_tile_lists_made_for_a_capture_equal_the_cached_ones():
    """Launch.blocks under a CUDA graph capture classifies afresh (no cache): the same lists."""
    L = 96
    docs = torch.tensor([0] * 40 + [1] * 30 + [2] * 26, dtype=torch.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
    kernel = attncc.compile(attncc.Variant(None, same_doc))
    q, k, v = randn_qkv(1, 2, 2, L, L, 16)
    launch = autograd._launch(kernel, q, k, v, [docs], None, None, 0.0, False)
    fwd = kernel.module("fwd", launch.spec)
    assert fwd.BLOCK_SPARSE
    args = (fwd, fwd, [docs], 1, 2, L, L, fwd.CLASS_PER_HEAD, q.device)
    cached, fresh = blocks.for_module(*args), autograd._captured_blocks(*args)
    assert cached.keys() == fresh.keys()
    for fn in cached:
        for a, b in zip(cached[fn], fresh[fn]):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), fn
    out, lse = kernel(q, k, v, return_lse=True)
    ref, ref_lse = attncc.reference.attention_variant(kernel.variant, q.double(), k.double(), v.double(),
                                                      return_lse=True)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.float32)


def test_calls_for_a_cuda_graph_are_told_apart(monkeypatch):
    """Launch.blocks leaves its caches alone for calls captured by a CUDA graph and for the warm-up
    run of cudagraph trees (their allocations come from the graphs' pool)."""
    import sys
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert autograd._graph_pool_call(cpu)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    manager = SimpleNamespace(in_warmup=True)
    trees = SimpleNamespace(get_manager=lambda index, create_if_none_exists: manager)
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    assert autograd._graph_pool_call(torch.device("cuda", 0))
    manager.in_warmup = False
    assert not autograd._graph_pool_call(torch.device("cuda", 0))
    trees.get_manager = lambda index, create_if_none_exists: None
    assert not autograd._graph_pool_call(torch.device("cuda", 0))
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    assert not autograd._graph_pool_call(torch.device("cuda", 0))
