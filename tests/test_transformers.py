"""attncc as transformers' attn_implementation="attncc" (attncc.integrations.transformers), against
attn_implementation="eager" on the same random weights in float32: logits of left-padded
batches (at real tokens; padded rows are fully masked, attncc gives them 0) and of packed
sequences (position_ids, no attention_mask), the gradients of a training step, and greedy
generate() tokens, for Llama, Mistral (sliding window), Gemma-2 (softcap, alternating local and
global layers), Qwen2 and gpt-oss (attention sinks) when the installed transformers has it. All
models use GQA (4 query heads over 2 key/value heads). Also: decoding takes attncc's inference
kernel; a StaticCache; a chunk of queries after a cached prefix, with and without gradients; user
mods (set_mods, register); dropout; a 4-D mask passed in and overlay masks (dense fallback);
consecutive forwards with different padding of one shape; torch.compile(fullgraph=True) training
step, packed forward and decode steps with no graph break.

Tiny configs (hidden 64, head dim 16, 2 layers, 12 tokens) keep the Triton interpreter fast.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("transformers")

import attncc.integrations.transformers as attncc_hf  # noqa: E402  (before transformers' model code imports triton)
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import attncc  # noqa: E402

VOCAB, B, L, PAD = 97, 2, 12, 0
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=PAD,
              initializer_range=0.2)  # larger weights than the default: scores far from 0, softcap bites


def _configs():
    out = {
        "llama": transformers.LlamaConfig(**COMMON),
        "mistral": transformers.MistralConfig(**COMMON, sliding_window=4),
        "gemma2": transformers.Gemma2Config(**COMMON, sliding_window=4, attn_logit_softcapping=2.0,
                                            final_logit_softcapping=None, query_pre_attn_scalar=16),
        "qwen2": transformers.Qwen2Config(**COMMON),
    }
    if hasattr(transformers, "GptOssConfig"):
        oss = dict(COMMON, intermediate_size=64)
        out["gpt_oss"] = transformers.GptOssConfig(**oss, sliding_window=4, num_local_experts=4, num_experts_per_tok=2,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return out


CONFIGS = _configs()
MODELS = list(CONFIGS)


def build(name: str, attn: str, seed: int = 0, **overrides):
    """A random-weight model of ``name`` with attention ``attn``; equal seeds, equal weights."""
    cfg = copy.deepcopy(CONFIGS[name])  # from_config writes the implementation into the config
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0.0, 1.0)  # initialised to 0 or tiny: make the sink matter
    return model.eval()


def pair(name: str, **overrides):
    return build(name, "eager", **overrides), build(name, attncc_hf.NAME, **overrides)


def padded_batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :5] = 0  # left padding
    ids[mask == 0] = PAD
    return ids, mask


def packed_batch(seed: int = 2):
    """Two rows of packed documents (lengths 5+7 and 3+4+5): position_ids restart per document."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, L), generator=g)
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(3)) + list(range(4)) + list(range(5))])
    return ids, pos


def close(a, b, tol=2e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", MODELS)
def test_left_padded_logits(name):
    eager, ours = pair(name)
    ids, mask = padded_batch()
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    real = mask.bool()
    close(got[real], want[real])


@pytest.mark.parametrize("name", MODELS)
def test_packed_logits(name):
    eager, ours = pair(name)
    ids, pos = packed_batch()
    with torch.no_grad():  # packed documents are masked apart only without a cache, as in transformers
        want = eager(ids, position_ids=pos, use_cache=False).logits
        got = ours(ids, position_ids=pos, use_cache=False).logits
        unpacked = eager(ids, use_cache=False).logits
    close(got, want)
    assert (want - unpacked).abs().max() > 1e-3  # the documents mattered


def _train_step(model, ids, **kw):
    model.train()
    model.zero_grad()
    labels = ids.clone()
    if "attention_mask" in kw:  # no loss on padding, nor on tokens predicted from padding (its rows differ)
        pad = kw["attention_mask"] == 0
        labels[pad | torch.cat([pad[:, :1], pad[:, :-1]], dim=1)] = -100
    loss = model(ids, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    return loss.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_training_gradients(name):
    eager, ours = pair(name)
    ids, mask = padded_batch()
    want_loss, want = _train_step(eager, ids, attention_mask=mask)
    got_loss, got = _train_step(ours, ids, attention_mask=mask)
    close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for n in want:
        close(got[n], want[n], tol=1e-3)


def test_packed_training_gradients():
    eager, ours = pair("mistral")
    ids, pos = packed_batch()
    want_loss, want = _train_step(eager, ids, position_ids=pos)
    got_loss, got = _train_step(ours, ids, position_ids=pos)
    close(got_loss, want_loss)
    for n in want:
        close(got[n], want[n], tol=1e-3)


@pytest.mark.parametrize("name", MODELS)
def test_generate_greedy(name, monkeypatch):
    eager, ours = pair(name)
    ids, mask = padded_batch()
    ids, mask = ids[:, 3:], mask[:, 3:]  # 9 prompt tokens, 6 new: the sliding windows (4) fill up
    runs = []
    run = attncc.inference.run
    monkeypatch.setattr(attncc.inference, "run", lambda *a, **k: runs.append(k["max_q_len"]) or run(*a, **k))
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    want, got = eager.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(got, want)
    assert runs and set(runs) == {1}  # each decode step took attncc's inference kernel


@pytest.mark.parametrize("padded", [True, False])
def test_generate_static_cache(padded):
    eager, ours = pair("llama")
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask if padded else None, max_new_tokens=4, do_sample=False, pad_token_id=PAD,
              cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    want, got = eager.generate(ids, **kw), ours.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):  # the empty slots of the cache stay unseen
        close(a, b)


def test_compiled_decode_steps():
    """Decode steps under torch.compile(fullgraph=True) over a DynamicCache with left padding and
    a sliding window: the queries' offset is a captured tensor there."""
    torch._dynamo.reset()
    eager, ours = pair("mistral")
    ids, mask = padded_batch()
    key = "cache" if "cache" in inspect.signature(ours.forward).parameters else "past_key_values"

    def steps(model, compile_steps: bool):
        cache = transformers.DynamicCache(config=model.config)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        step = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_steps else model
        out, logits, m = model(ids, attention_mask=mask, position_ids=pos, **{key: cache}), [], mask
        nxt, p = out.logits[:, -1:].argmax(-1), pos[:, -1:]
        for _ in range(3):
            m, p = torch.cat([m, torch.ones_like(m[:, :1])], dim=-1), p + 1
            logits.append(step(nxt, attention_mask=m, position_ids=p, **{key: cache}).logits[:, -1])
            nxt = logits[-1][:, None].argmax(-1)
        return torch.stack(logits)

    with torch.no_grad():
        close(steps(ours, True), steps(eager, False))
    torch._dynamo.reset()


@pytest.mark.parametrize("grad", [False, True])
def test_chunk_after_a_cached_prefix(grad):
    """Four queries after eight cached tokens (chunked prefill): the inference kernel without
    gradients, the training kernels with the queries' offset as a captured tensor with them."""
    eager, ours = pair("mistral")
    ids, mask = padded_batch()
    key = "cache" if "cache" in inspect.signature(ours.forward).parameters else "past_key_values"
    results = []
    for model in (eager, ours):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :8], attention_mask=mask[:, :8], **{key: cache})
        model.zero_grad()
        with torch.set_grad_enabled(grad):
            logits = model(ids[:, 8:], attention_mask=mask, **{key: cache}).logits
        if grad:
            logits.sum().backward()
        results.append((logits.detach(), [p.grad for p in model.parameters()] if grad else []))
    (want, want_grads), (got, got_grads) = results
    close(got, want)
    for a, b in zip(got_grads, want_grads):
        close(a, b, tol=1e-3)


def test_user_mods_on_top():
    """Llama with a window mask_mod and a score_mod reading a captured tensor equals Mistral's
    eager sliding window (the same architecture) with the scores doubled."""
    H = COMMON["num_attention_heads"]
    factor = torch.full((H,), 2.0)

    def double(score, b, h, q_idx, kv_idx):
        return score * factor[h]

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 4

    eager = build("mistral", "eager")
    for m in eager.modules():
        if hasattr(m, "scaling"):
            m.scaling *= 2
    ours = build("llama", attncc_hf.NAME)
    ours.load_state_dict(eager.state_dict())
    assert len(attncc_hf.set_mods(ours, double, window)) == COMMON["num_hidden_layers"]
    ids, mask = padded_batch()
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    close(got[mask.bool()], want[mask.bool()])
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=PAD)
    assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))

    attncc_hf.set_mods(ours)  # removed: plain Llama again
    name = attncc_hf.register("attncc_test_window", mask_mod=window)
    ours.set_attn_implementation(name)
    eager.set_attn_implementation("eager")
    for m in eager.modules():
        if hasattr(m, "scaling"):
            m.scaling /= 2
    with torch.no_grad():
        want, got = eager(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    close(got[mask.bool()], want[mask.bool()])


def test_dropout_in_training():
    ours = build("llama", attncc_hf.NAME, attention_dropout=0.5).train()
    ids, _ = padded_batch()

    def logits(seed):
        torch.manual_seed(seed)
        return ours(ids, use_cache=False).logits

    first, again, other = logits(0), logits(0), logits(1)
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # reproducible from torch's generator
    assert (first - other).abs().max() > 1e-2
    first.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    eager = build("llama", "eager", attention_dropout=0.5)
    with torch.no_grad():  # eval mode: no dropout
        close(ours.eval()(ids).logits, eager(ids).logits)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the interpreter scales finfo.min by log2(e)
def test_4d_mask_passed_in():
    eager, ours = pair("qwen2")
    ids, _ = padded_batch()
    g = torch.Generator().manual_seed(3)
    keep = (torch.rand(B, 1, L, L, generator=g) > 0.3) | torch.eye(L, dtype=torch.bool)
    additive = torch.zeros(B, 1, L, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, got = eager(ids, attention_mask=additive).logits, ours(ids, attention_mask=additive).logits
    close(got, want)


def test_overlay_masks_fall_back_to_dense(monkeypatch):
    """Gemma-3 with bidirectional attention builds its masks with an or_mask_function overlay,
    which attncc does not read off: it evaluates them densely, with a warning, and agrees."""
    cfg = transformers.Gemma3TextConfig(**COMMON, sliding_window=4, use_bidirectional_attention=True,
                                        layer_types=["sliding_attention", "full_attention"])
    models = []
    for attn in ("eager", attncc_hf.NAME):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn).eval())
    from attncc.integrations import _hf_masks
    dense = []
    sdpa_mask = _hf_masks.sdpa_mask
    monkeypatch.setattr(_hf_masks, "sdpa_mask", lambda **kw: dense.append(kw["q_length"]) or sdpa_mask(**kw))
    ids, mask = padded_batch()
    with torch.no_grad():
        want, got = (m(ids, attention_mask=mask).logits for m in models)
    close(got[mask.bool()], want[mask.bool()])
    assert dense == [L, L]  # one dense mask per type (full, sliding) and forward


@pytest.mark.parametrize("compiled", [False, True])
def test_consecutive_masks_of_one_shape(compiled):
    """Forwards with different padding of one shape: each new padding tensor may land where the
    last one was freed, and must not get the tile classes attncc cached for that one."""
    torch._dynamo.reset()
    eager, ours = pair("llama")
    run = torch.compile(ours, fullgraph=True, backend="aot_eager") if compiled else ours
    n = 64
    ids = torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(4))
    for pad in (50, 5, 35, 1, 60, 3, 45, 32, 17, 1, 55, 7):
        mask = torch.ones(1, n, dtype=torch.long)
        mask[0, :pad] = 0
        with torch.no_grad():
            want, got = eager(ids, attention_mask=mask, use_cache=False).logits, run(ids, attention_mask=mask,
                                                                                      use_cache=False).logits
        close(got[mask.bool()], want[mask.bool()])
    torch._dynamo.reset()


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    eager, ours = pair("gemma2")
    ids, mask = padded_batch()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    want_loss, want = _train_step(eager, ids, attention_mask=mask)
    got_loss, got = _train_step(compiled, ids, attention_mask=mask)
    close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for n in want:
        close(got[n], want[n], tol=1e-3)
    ids, pos = packed_batch()
    with torch.no_grad():
        close(compiled.eval()(ids, position_ids=pos, use_cache=False).logits,
              eager.eval()(ids, position_ids=pos, use_cache=False).logits)
    torch._dynamo.reset()
