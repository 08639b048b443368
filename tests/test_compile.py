"""attncc under torch.compile: one ``attncc::attention`` custom op per call, so fullgraph=True
compiles without graph breaks; outputs and gradients (captured tensors' too) equal eager; no
recompilation when only lengths change (dynamic=True, mark_dynamic, and automatic dynamic
after one recompile with the default dynamic=None); dropout differs per call and follows
torch.manual_seed. CPU tests run the inductor backend with the kernels interpreted; the
gpu-marked tests repeat the main checks on CUDA in bf16 and fp16.
"""
from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import attncc
from attncc import runtime
from conftest import assert_close_to_reference, rel_err

# torch.compile imports triton; CPU tensors need triton's interpreter, which attncc switches on
# only when it imports triton first (attncc.runtime._triton). Do that before any compilation.
if not torch.cuda.is_available() or any(os.environ.get(v, "") not in ("", "0")
                                        for v in ("TRITON_INTERPRET", "ATTNCC_INTERPRET")):
    runtime.target_for(torch.device("cpu"))

import torch._dynamo  # noqa: E402  (after the interpreter is on)
from torch._dynamo.utils import counters  # noqa: E402

causal = lambda b, h, q, k: q >= k
D = 16
LENGTHS = (24, 40, 57)  # none equals D, B or H: dynamo's duck sizing would tie them


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    """Graphs dynamo has compiled (since this test began). Not the backend's call count: with a
    cold inductor cache the first compilation may call the backend twice for one graph."""
    return counters["stats"]["unique_graphs"]


def alibi_kernel(H=2, device="cpu", dropout_p=0.0):
    slopes = torch.rand(H, device=device, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return attncc.compile(attncc.Variant(alibi, causal, dropout_p=dropout_p)), slopes


def qkv(L, B=2, H=2, Hkv=2, dtype=torch.float32, device="cpu", requires_grad=True, seed=0):
    g = torch.Generator(device=device).manual_seed(seed + L)
    return [torch.randn(B, h, L, D, generator=g, device=device).to(dtype).requires_grad_(requires_grad)
            for h in (H, Hkv, Hkv)]


def grads(fn, inputs, seed=1):
    out, lse = fn(*inputs[:3])
    g = torch.Generator(device=out.device).manual_seed(seed)
    do = torch.randn(out.shape, generator=g, device=out.device).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g, device=out.device)
    loss = (out.float() * do).sum() + (lse * dlse).sum()
    return out, lse, torch.autograd.grad(loss, inputs)


def test_fullgraph_matches_eager_and_reference():
    kernel, slopes = alibi_kernel()
    fn = lambda q, k, v: kernel(q, k, v, return_lse=True)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True)
    inputs = [*qkv(40), slopes]
    out, lse, got = grads(compiled, inputs)
    want_out, want_lse, want = grads(fn, inputs)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for name, g, w in zip(["dq", "dk", "dv", "dslopes"], got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=name)
    q, k, v = inputs[:3]
    ref, ref_lse = attncc.reference.attention_variant(kernel.variant, q.double(), k.double(), v.double(),
                                                      return_lse=True)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.float32)


def test_no_graph_breaks():
    kernel, _ = alibi_kernel()

    def fn(q, k, v):
        return kernel(torch.sin(q), k, v).sum(dim=-1)
    explanation = torch._dynamo.explain(fn)(*qkv(24))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    assert "torch.ops.attncc.attention.default" in explanation.graphs[0].code


def test_dynamic_true_no_recompile_across_lengths():
    kernel, slopes = alibi_kernel()
    fn = lambda q, k, v: kernel(q, k, v, return_lse=True)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=True)
    for L in LENGTHS:
        inputs = [*qkv(L), slopes]
        out, _, got = grads(compiled, inputs)
        want_out, _, want = grads(fn, inputs)
        assert torch.equal(out, want_out)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert graphs() == 1


def test_mark_dynamic_no_recompile_across_lengths():
    kernel, _ = alibi_kernel()
    compiled = torch.compile(lambda q, k, v: kernel(q, k, v), backend="inductor", fullgraph=True)
    for L in LENGTHS:
        q, k, v = qkv(L, requires_grad=False)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        assert torch.equal(compiled(q, k, v), kernel(q, k, v))
    assert graphs() == 1


def test_default_dynamic_recompiles_once_then_generalises():
    kernel, _ = alibi_kernel()
    compiled = torch.compile(lambda q, k, v: kernel(q, k, v), backend="inductor", fullgraph=True)
    counts = []
    for L in LENGTHS:
        q, k, v = qkv(L, requires_grad=False)
        assert torch.equal(compiled(q, k, v), kernel(q, k, v))
        counts.append(graphs())
    assert counts == [1, 2, 2]  # static, then one dynamic-length graph for every later length


def test_module_with_learnable_captures_fullgraph():
    """A small block (projections around attncc.nn.Attention, (B, L, H, D) layout, MQA): the
    compiled gradients of every parameter, the captured ALiBi slopes included, equal eager."""
    torch.manual_seed(0)
    slopes = torch.rand(2, requires_grad=True)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(2 * D, 2 * D, bias=False)
            self.kv = torch.nn.Linear(2 * D, 2 * D, bias=False)
            self.attn = attncc.nn.Attention(attncc.Variant(lambda s, b, h, q, k: s + slopes[h] * (k - q), causal),
                                            layout="blhd")

        def forward(self, x):
            B, L, _ = x.shape
            k, v = self.kv(x).view(B, L, 2, D).chunk(2, dim=2)  # 1 key/value head for 2 query heads
            return self.attn(self.q(x).view(B, L, 2, D), k, v).reshape(B, L, 2 * D)

    block = Block()
    compiled = torch.compile(block, backend="inductor", fullgraph=True, dynamic=True)
    names = [n for n, _ in block.named_parameters()]
    assert names == ["q.weight", "kv.weight", "attn.slopes"]
    for L in (24, 40):
        x = torch.randn(1, L, 2 * D)
        got = torch.autograd.grad(compiled(x).square().sum(), list(block.parameters()))
        want = torch.autograd.grad(block(x).square().sum(), list(block.parameters()))
        for name, g, w in zip(names, got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)
    assert graphs() == 1


def test_dropout_fresh_per_call_and_seeded():
    kernel, _ = alibi_kernel(dropout_p=0.3)
    compiled = torch.compile(lambda q, k, v, training: kernel(q, k, v, training=training), backend="inductor",
                             fullgraph=True)
    q, k, v = qkv(40, requires_grad=False)
    torch.manual_seed(3)
    a, b = compiled(q, k, v, True), compiled(q, k, v, True)
    torch.manual_seed(3)
    assert torch.equal(compiled(q, k, v, True), a)
    assert not torch.equal(a, b)
    assert torch.equal(compiled(q, k, v, False), kernel(q, k, v, training=False))
    assert not torch.equal(a, compiled(q, k, v, False))


def test_dropout_with_torch_rng_equals_eager():
    """With inductor drawing from torch's generator (fallback_random), a compiled call draws the
    same (seed, offset) as eager: outputs and gradients then equal eager, which test_dropout
    checks against the reference with attncc.dropout_mask."""
    import torch._inductor.config as inductor_config
    kernel, slopes = alibi_kernel(dropout_p=0.3)
    fn = lambda q, k, v: kernel(q, k, v, return_lse=True)
    inputs = [*qkv(40), slopes]
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(fn, backend="inductor", fullgraph=True)
        torch.manual_seed(11)
        out, _, got = grads(compiled, inputs)
    torch.manual_seed(11)
    want_out, _, want = grads(fn, inputs)
    assert torch.equal(out, want_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_functional_attention_needs_a_kernel_built_outside():
    q, k, v = qkv(24, requires_grad=False)
    fn = lambda q, k, v: attncc.attention(q, k, v, mask_mod=causal)
    with pytest.raises(Exception, match="build the kernel once outside the compiled code"):
        torch.compile(fn, backend="inductor", fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    # without fullgraph dynamo leaves the call to eager: correct, with a graph break
    assert torch.equal(torch.compile(fn, backend="inductor")(q, k, v), fn(q, k, v))


def test_opcheck():
    """torch.library.opcheck: schema (no mutation, no aliasing), fake tensors, autograd
    registration and AOT dispatch with dynamic shapes, on the op with a learnable capture and dropout."""
    kernel, slopes = alibi_kernel(dropout_p=0.2)
    q, k, v = qkv(20)
    v_ = kernel.variant
    args = (q, k, v, [slopes], torch.tensor([5, 9]), v_.ir_key, None, 0.2, False)
    torch.library.opcheck(torch.ops.attncc.attention.default, args)
    out, lse = torch.ops.attncc.attention.default(*args)
    bargs = (torch.randn_like(out), torch.randn_like(lse), *(t.detach() for t in (q, k, v, out, lse)),
             [slopes.detach()], torch.tensor([5, 9]), v_.ir_key, None, 0.2, False, [0])
    torch.library.opcheck(torch.ops.attncc.attention_backward.default, bargs)


def test_op_called_eagerly_equals_the_function_path():
    """The op's own autograd (what torch.compile traces), here run eagerly, with a gradient
    through lse only (no output gradient): the same numbers as the eager Function."""
    kernel, slopes = alibi_kernel()
    q, k, v = qkv(24)
    v_ = kernel.variant
    out, lse = torch.ops.attncc.attention.default(q, k, v, [slopes], None, v_.ir_key, None, 0.0, False)
    got = torch.autograd.grad(lse.sum(), (q, k, v, slopes))
    want_out, want_lse = kernel(q, k, v, return_lse=True)
    want = torch.autograd.grad(want_lse.sum(), (q, k, v, slopes))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_captured_tensor_too_small_for_a_compiled_length():
    """The capture index check (attncc.checks.check_capture_indices) runs inside the op, so it
    sees every length a dynamic graph is called with."""
    table = torch.randn(2, 40)
    kernel = attncc.compile(attncc.Variant(lambda s, b, h, qi, ki: s + table[h, qi]))
    compiled = torch.compile(lambda q, k, v: kernel(q, k, v), backend="inductor", fullgraph=True, dynamic=True)
    q, k, v = qkv(24, requires_grad=False)
    assert torch.equal(compiled(q, k, v), kernel(q, k, v))
    with pytest.raises(attncc.AttnccError, match="too small for its index `q_idx`"):
        compiled(*qkv(57, requires_grad=False))
    with pytest.raises(attncc.AttnccError, match="too small for its index `q_idx`"):
        kernel(*qkv(57, requires_grad=False))


def test_op_needs_a_live_kernel_and_the_registry_holds_none():
    q, k, v = qkv(24, requires_grad=False)
    with pytest.raises(attncc.AttnccError, match="no live attncc.CompiledAttention"):
        torch.ops.attncc.attention.default(q, k, v, [], None, "no such variant", None, 0.0, False)

    def run_once():
        bias = torch.rand(2)
        attncc.compile(attncc.Variant(lambda s, b, h, qi, ki: s + bias[h]))(q, k, v)
        return weakref.ref(bias)
    alive = run_once()
    gc.collect()
    assert alive() is None  # the registry keeps no captured tensor alive


def test_eager_backward_after_the_kernel_is_gone():
    q, k, v = qkv(24)
    out = attncc.attention(q, k, v, lambda s, b, h, qi, ki: s * 0.5, causal)  # its CompiledAttention is dropped
    gc.collect()
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# GPU (bf16, fp16)

GPU_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_fullgraph_dynamic_matches_eager(dtype):
    kernel, slopes = alibi_kernel(H=8, device="cuda")
    fn = lambda q, k, v: kernel(q, k, v, enable_gqa=True, return_lse=True)
    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=True)
    for L in (300, 517, 1024):
        inputs = [*qkv(L, B=2, H=8, Hkv=2, dtype=dtype, device="cuda"), slopes]
        out, lse, got = grads(compiled, inputs)
        want_out, want_lse, want = grads(fn, inputs)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        for g, w in zip(got, want):  # the same kernels; only atomics (capture grads) may reorder sums
            assert rel_err(g, w) < 1e-3
        q, k, v = inputs[:3]
        ref, ref_lse = attncc.reference.attention_variant(kernel.variant, q.double(), k.double(), v.double(),
                                                          enable_gqa=True, return_lse=True)
        assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    assert graphs() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_module_fullgraph_and_dropout(dtype):
    torch.manual_seed(0)
    slopes = torch.rand(8, device="cuda", requires_grad=True)
    attn = attncc.nn.Attention(attncc.Variant(lambda s, b, h, q, k: s + slopes[h] * (k - q), causal,
                                              dropout_p=0.1), layout="blhd")
    compiled = torch.compile(attn, backend="inductor", fullgraph=True, dynamic=True)
    for L in (256, 300):
        q, k, v = (torch.randn(2, L, h, 64, device="cuda", dtype=dtype) for h in (8, 2, 2))
        torch.manual_seed(5)
        a = compiled(q, k, v)
        b = compiled(q, k, v)
        torch.manual_seed(5)
        assert torch.equal(compiled(q, k, v), a) and not torch.equal(a, b)
        (ds,) = torch.autograd.grad(a.float().sum(), slopes)
        assert torch.isfinite(ds).all()
        attn.eval()
        out = compiled(q, k, v)
        attn.train()
        ref = attncc.reference.attention_variant(attn.variant, *(t.transpose(1, 2).double() for t in (q, k, v)),
                                                 enable_gqa=True).transpose(1, 2)
        assert rel_err(out, ref) < GPU_TOL[dtype]
    assert graphs() == 2  # train and eval (module.training is guarded), for both lengths
