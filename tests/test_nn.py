"""attncc.nn.Attention: layouts, GQA, captured tensors as parameters and buffers (the same
objects the mods read), optimizer updates, dropout in training mode only; against the float64
reference. CPU through the interpreter; the gpu-marked tests repeat the checks in bf16/fp16."""
from __future__ import annotations

import copy
import os

import pytest
import torch

import attncc
from attncc import runtime
from conftest import REL_TOL, rel_err

# Creating a torch optimizer imports torch._dynamo and with it triton; CPU tensors need triton's
# interpreter, which attncc switches on only when it imports triton first (attncc.runtime._triton).
if not torch.cuda.is_available() or any(os.environ.get(v, "") not in ("", "0")
                                        for v in ("TRITON_INTERPRET", "ATTNCC_INTERPRET")):
    runtime.target_for(torch.device("cpu"))

causal = lambda b, h, q, k: q >= k


def alibi_module(H=4, layout="bhld", dropout_p=0.0, device="cpu", learnable=True):
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], device=device,
                          requires_grad=learnable)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return attncc.nn.Attention(attncc.Variant(alibi, causal, dropout_p=dropout_p), layout=layout), slopes


def qkv(B, Hq, Hkv, L, D, layout="bhld", dtype=torch.float32, device="cpu", seed=0, requires_grad=False):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (lambda h: (B, h, L, D)) if layout == "bhld" else (lambda h: (B, L, h, D))
    return [torch.randn(*shape(h), generator=g, device=device).to(dtype).requires_grad_(requires_grad)
            for h in (Hq, Hkv, Hkv)]


def reference(module, q, k, v, layout="bhld", **kw):
    """float64 attncc.reference of the module's variant, in the module's layout."""
    if layout == "blhd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = attncc.reference.attention_variant(module.variant, q.double(), k.double(), v.double(),
                                             enable_gqa=True, **kw)
    return out.transpose(1, 2) if layout == "blhd" else out


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_layouts_and_gqa_against_reference(layout, heads):
    m, _ = alibi_module(H=heads[0], layout=layout)
    q, k, v = qkv(2, *heads, 37, 16, layout)
    out = m(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    if layout == "blhd":  # returned in the given layout, from a transposed kernel output: no copy
        assert out.is_contiguous()
    assert rel_err(out, reference(m, q, k, v, layout)) < REL_TOL[torch.float32]


def test_blhd_equals_bhld_on_transposed_inputs():
    m_bhld, _ = alibi_module(layout="bhld")
    m_blhd = attncc.nn.Attention(m_bhld.compiled, layout="blhd")
    q, k, v = qkv(2, 4, 2, 29, 16)
    want = m_bhld(q, k, v)
    got = m_blhd(*(t.transpose(1, 2).contiguous() for t in (q, k, v)))
    assert torch.equal(got.transpose(1, 2), want)


def test_captures_become_parameters_and_buffers_as_the_same_objects():
    H = 2
    slopes = torch.rand(H, requires_grad=True)         # float leaf with grad -> parameter
    table = torch.nn.Parameter(0.1 * torch.randn(H, 65))  # nn.Parameter -> parameter
    doc = torch.tensor([0] * 20 + [1] * 12)            # int -> buffer
    frozen = torch.rand(H)                              # float without grad -> buffer

    def score(s, b, h, q, k):
        return s + slopes[h] * (k - q) + table[h, q - k + 32] + frozen[h]

    def mask(b, h, q, k):
        return (doc[q] == doc[k]) & (q >= k)
    m = attncc.nn.Attention(attncc.Variant(score, mask))
    params, buffers = dict(m.named_parameters()), dict(m.named_buffers())
    assert set(params) == {"slopes", "table"} and set(buffers) == {"doc", "frozen"}
    assert params["slopes"] is slopes and params["table"] is table
    assert buffers["doc"] is doc and buffers["frozen"] is frozen
    assert isinstance(slopes, torch.nn.Parameter)
    assert set(m.state_dict()) == {"slopes", "table"}  # buffers are how the variant was built
    q, k, v = qkv(1, H, H, 32, 16)
    assert rel_err(m(q, k, v), reference(m, q, k, v)) < REL_TOL[torch.float32]


def test_learnable_capture_gradients_against_reference():
    m, slopes = alibi_module(H=4)
    q, k, v = qkv(2, 4, 2, 40, 16, requires_grad=True)
    do = torch.randn(2, 4, 40, 16)
    got = torch.autograd.grad(m(q, k, v), (q, k, v, slopes), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference(m, qd, kd, vd), (qd, kd, vd, slopes), do.double())
    for name, g, w in zip(["dq", "dk", "dv", "dslopes"], got, want):
        assert rel_err(g, w) < 1e-5, name


def test_optimizer_step_is_seen_by_the_kernel():
    m, slopes = alibi_module(H=4)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    q, k, v = qkv(1, 4, 4, 33, 16)
    before = m(q, k, v)
    before.square().sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0
    old = slopes.detach().clone()
    opt.step()
    assert not torch.equal(slopes.detach(), old)
    after = m(q, k, v)
    assert not torch.equal(after, before)
    assert rel_err(after, reference(m, q, k, v)) < REL_TOL[torch.float32]  # the updated slopes


def test_load_state_dict_keeps_the_captured_objects():
    m, slopes = alibi_module(H=4)
    state = {"slopes": torch.full((4,), 0.25)}
    m.load_state_dict(state)
    assert m.slopes is slopes and torch.equal(slopes.detach(), state["slopes"])
    q, k, v = qkv(1, 4, 4, 20, 16)
    assert rel_err(m(q, k, v), reference(m, q, k, v)) < REL_TOL[torch.float32]


def test_to_moves_buffers_in_place():
    doc = torch.tensor([0] * 10 + [1] * 14)
    frozen = torch.rand(2)
    m = attncc.nn.Attention(attncc.Variant(lambda s, b, h, q, k: s + frozen[h], lambda b, h, q, k: doc[q] == doc[k]))
    m.half()
    assert m.doc is doc and m.frozen is frozen and frozen.dtype == torch.float16 and doc.dtype == torch.int64
    q, k, v = qkv(1, 2, 2, 24, 16, dtype=torch.float16)
    out = m(q, k, v)
    assert out.dtype == torch.float16
    assert rel_err(out, reference(m, q, k, v)) < REL_TOL[torch.float16]


def test_dropout_only_in_training_mode():
    m, _ = alibi_module(H=2, dropout_p=0.3)
    plain, _ = alibi_module(H=2)
    q, k, v = qkv(1, 2, 2, 45, 16)
    assert m.training
    torch.manual_seed(7)
    a = m(q, k, v)
    b = m(q, k, v)
    torch.manual_seed(7)
    keep = attncc.dropout_mask(1, 2, 45, 45, 0.3)  # the mask of the first call after this seed
    torch.manual_seed(7)
    assert torch.equal(m(q, k, v), a)
    assert not torch.equal(a, b)
    assert rel_err(a, reference(m, q, k, v, dropout_mask=keep)) < REL_TOL[torch.float32]
    m.eval()
    assert torch.equal(m(q, k, v), plain(q, k, v))


def test_deepcopy_is_independent_and_consistent():
    m, slopes = alibi_module(H=2)
    c = copy.deepcopy(m)
    assert c.slopes is not slopes and c.slopes is c.variant.captures[0].tensor
    q, k, v = qkv(1, 2, 2, 24, 16)
    assert torch.equal(c(q, k, v), m(q, k, v))
    with torch.no_grad():
        c.slopes.mul_(4)
    assert not torch.equal(c(q, k, v), m(q, k, v))
    del m
    assert rel_err(c(q, k, v), reference(c, q, k, v)) < REL_TOL[torch.float32]


def test_capture_names_that_are_module_attributes_get_numbered():
    training = torch.rand(2)
    m = attncc.nn.Attention(attncc.Variant(lambda s, b, h, q, k: s + training[h]))
    assert dict(m.named_buffers())["cap0"] is training and m.training is True


def test_errors():
    with pytest.raises(attncc.AttnccError, match="takes an attncc.Variant"):
        attncc.nn.Attention(lambda s, b, h, q, k: s)
    with pytest.raises(attncc.AttnccError, match="layout must be 'bhld'.*'blhd'"):
        attncc.nn.Attention(attncc.Variant(), layout="bshd")
    base = torch.rand(2, requires_grad=True)
    derived = base * 2
    with pytest.raises(attncc.AttnccError, match="computed from tensors that require grad"):
        attncc.nn.Attention(attncc.Variant(lambda s, b, h, q, k: s + derived[h]))
    m = attncc.nn.Attention(attncc.Variant())
    q, k, v = qkv(1, 3, 2, 8, 16)
    with pytest.raises(attncc.AttnccError, match="multiple of key/value heads"):
        m(q, k, v)


# ----------------------------------------------------------------------------------------------
# GPU (bf16, fp16): compiled kernels

GPU_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["bhld", "blhd"])
def test_gpu_layouts_gqa_and_grads(dtype, layout):
    m, slopes = alibi_module(H=8, layout=layout, device="cuda")
    q, k, v = qkv(2, 8, 2, 300, 64, layout, dtype=dtype, device="cuda", requires_grad=True)
    out = m(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, slopes), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(m, qd, kd, vd, layout)
    want = torch.autograd.grad(ref, (qd, kd, vd, slopes), do.double())
    assert rel_err(out, ref) < GPU_TOL[dtype]
    for i, (g, w) in enumerate(zip(got, want)):
        bound = 2 * GPU_TOL[dtype] * (1 if i < 3 else 10)  # capture grads sum many rounded terms
        assert rel_err(g, w) < bound, i


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_optimizer_step_and_eval_dropout(dtype):
    m, slopes = alibi_module(H=4, dropout_p=0.2, device="cuda")
    q, k, v = qkv(2, 4, 4, 257, 64, dtype=dtype, device="cuda")
    m.eval()
    before = m(q, k, v)
    assert torch.equal(m(q, k, v), before)  # eval: no dropout, deterministic
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    m(q, k, v).float().square().sum().backward()
    opt.step()
    m.eval()
    after = m(q, k, v)
    assert not torch.equal(after, before)
    assert rel_err(after, reference(m, q, k, v)) < GPU_TOL[dtype]
