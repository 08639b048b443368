"""attncc.flex_attention on the GPU (skipped without CUDA): the FlexAttention-style variants of
tests/test_flex_compat.py at larger sizes in bf16 and fp16 against the float64 reference (forward,
lse, backward), and against torch.compile(flex_attention) on the same mods and BlockMasks, including
a hand-built BlockMask whose blocks are the mask (which torch's eager path does not honour)."""
from __future__ import annotations

import math

import pytest
import torch

import attncc
from conftest import REL_TOL, assert_close_to_reference, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from test_flex_compat import B, BUILDERS, H, OPS, build  # noqa: E402
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention as torch_flex  # noqa: E402

DEV = "cuda"
D = 64
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
_compiled_flex = None


def torch_compiled_flex(*args, **kwargs):
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(torch_flex)
    return _compiled_flex(*args, **kwargs)


def _block_mask(case):
    if case.mask_mod is None:
        return None
    return create_block_mask(case.mask_mod, B if case.per_bh else None, H if case.per_bh else None, case.Lq,
                             case.Lkv, device=DEV, BLOCK_SIZE=128)


def _inputs(case, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, device=DEV).to(dtype) for L in (case.Lq, case.Lkv, case.Lkv))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_gpu_against_reference(name, dtype):
    """The math functions' GPU forms (libdevice, tl.erf, tl.ceil, ...) and their derivatives."""
    mod, is_mask, _ = OPS[name]
    score_mod, mask_mod = (None, mod) if is_mask else (mod, None)
    g = torch.Generator(device=DEV).manual_seed(9)
    q, k, v = (torch.randn(1, 2, L, D, generator=g, device=DEV).to(dtype).requires_grad_() for L in (200, 300, 300))
    out, lse = attncc.attention(q, k, v, score_mod, mask_mod, return_lse=True)
    ref, ref_lse = reference(q.detach(), k.detach(), v.detach(), score_mod, mask_mod)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, score_mod, mask_mod), (qd, kd, vd), do.double())
    for i, (a, w) in enumerate(zip(got, want)):
        assert _rel(a, w) < {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype], (i, _rel(a, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_variant_gpu_against_reference(name, dtype):
    case = build(name, n=4, device=DEV)
    bm = _block_mask(case)
    q, k, v = (t.requires_grad_() for t in _inputs(case, dtype))
    out, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True, max_scores=True))
    ref, ref_lse = reference(q.detach(), k.detach(), v.detach(), case.score_mod, case.mask_mod)
    assert_close_to_reference(out, aux.lse, ref, ref_lse, dtype)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *case.learnable), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want_out = attncc.reference.attention(qd, kd, vd, case.score_mod, case.mask_mod)
    want = torch.autograd.grad(want_out, (qd, kd, vd, *case.learnable), do.double())
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all()
        assert _rel(g, w) < GRAD_TOL[dtype] * (1 if i < 3 else 10), (i, _rel(g, w))


COMPILED = ["combinators", "natten_2d", "morton", "flamingo", "alibi_exp2", "softcap", "rope_dot", "bias_4d",
            "document", "sta"]  # each costs an inductor compile of FlexAttention


@pytest.mark.parametrize("name", COMPILED)
def test_variant_gpu_against_compiled_flex_attention(name):
    """attncc.flex_attention and torch.compile(flex_attention), bf16, same mods and BlockMask: both against
    the float64 reference, and max_scores against torch's."""
    case = build(name, n=4, device=DEV)
    bm = _block_mask(case)
    q, k, v = _inputs(case, torch.bfloat16, seed=1)
    with torch.no_grad():
        ref, ref_lse = reference(q, k, v, case.score_mod, case.mask_mod)
        ours, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True, max_scores=True))
    err_ours = assert_close_to_reference(ours, aux.lse, ref, ref_lse, torch.bfloat16)
    try:
        with torch.no_grad():
            theirs, their_aux = torch_compiled_flex(q, k, v, case.score_mod, bm,
                                                    return_aux=AuxRequest(lse=True, max_scores=True))
    except Exception as e:  # torch's kernel, not attncc's: bias_4d needs 245760 bytes of shared memory (H100, torch 2.11)
        if "out of resource" not in str(e):
            raise
        pytest.skip(f"attncc matched the float64 reference; torch.compile(flex_attention) could not compile this case: {e}")
    err_theirs = _rel(theirs, ref)
    assert err_ours <= max(2 * err_theirs, REL_TOL[torch.bfloat16] / 2), (err_ours, err_theirs)
    finite = torch.isfinite(their_aux.max_scores)
    assert torch.equal(torch.isfinite(aux.max_scores), finite)
    assert (aux.max_scores - their_aux.max_scores.float())[finite].abs().max() < 0.05


def test_blocks_that_are_the_mask_gpu():
    """from_kv_blocks without mask_mod: the listed blocks are the mask (compiled FlexAttention skips the
    others; its eager path would not). Partial and full blocks, Lq != Lkv, a per-head block table."""
    Lq, Lkv, blk = 384, 640, 128
    nq, nk = Lq // blk, Lkv // blk
    g = torch.Generator().manual_seed(8)
    dense = torch.rand(B, H, nq, nk, generator=g) < 0.5
    dense[..., 0] = True
    full = dense & (torch.rand(B, H, nq, nk, generator=g) < 0.5)
    partial = dense & ~full

    def ordered(m):
        return m.sum(-1).int().to(DEV), torch.argsort(m.int(), dim=-1, descending=True, stable=True).int().to(DEV)
    bm = BlockMask.from_kv_blocks(*ordered(partial), *ordered(full), BLOCK_SIZE=blk, seq_lengths=(Lq, Lkv))
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for L in (Lq, Lkv, Lkv))
    allowed = dense.to(DEV).repeat_interleave(blk, -2).repeat_interleave(blk, -1)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    want = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v.double()
    with torch.no_grad():
        ours = attncc.flex_attention(q, k, v, block_mask=bm)
        theirs = torch_compiled_flex(q, k, v, block_mask=bm)
    assert _rel(ours, want) < REL_TOL[torch.bfloat16]
    assert _rel(theirs, want) < REL_TOL[torch.bfloat16]
    assert "reads the block table" in attncc.flex.explain(None, bm)


@pytest.mark.parametrize("name", ["document", "learned_distance", "natten_2d"])
def test_inside_torch_compile_fullgraph_gpu(name):
    case = build(name, n=4, device=DEV)
    bm = _block_mask(case)

    @torch.compile(fullgraph=True)
    def step(q, k, v):
        out, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    q, k, v = (t.requires_grad_() for t in _inputs(case, torch.bfloat16, seed=2))
    out, lse = step(q, k, v)
    out.float().sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    ref, ref_lse = reference(q.detach(), k.detach(), v.detach(), case.score_mod, case.mask_mod)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
    for t in (q, k, v):
        t.grad = None
    attncc.flex_attention(q, k, v, case.score_mod, bm).float().sum().backward()
    for g, t in zip(got, (q, k, v)):
        assert _rel(g, t.grad) < GRAD_TOL[torch.bfloat16], _rel(g, t.grad)


@pytest.mark.parametrize("rows", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("r", [4, 40])
def test_row_products_gpu(rows, r):
    """A query's row dotted with a key's row (MLA's decoupled RoPE term) runs as a tile product
    (_row_dot) in the forward and both backward kernels, and as r products in the decode kernel:
    forward, lse and gradients against the float64 reference, GQA, Lq != Lkv, odd lengths."""
    g = torch.Generator(device=DEV).manual_seed(11)
    q_rows = (0.3 * torch.randn(4, 333, r, generator=g, device=DEV)).to(rows)
    k_rows = (0.3 * torch.randn(1000, r, generator=g, device=DEV)).to(rows)
    score_mod = lambda s, b, h, q_idx, kv_idx: s + torch.dot(q_rows[h, q_idx], k_rows[kv_idx])  # noqa: E731
    mask_mod = lambda b, h, q_idx, kv_idx: q_idx + 700 >= kv_idx  # noqa: E731
    q = torch.randn(2, 4, 333, D, generator=g, device=DEV).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2, 1000, D, generator=g, device=DEV).to(torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True)
    ref, ref_lse = reference(q.detach(), k.detach(), v.detach(), score_mod, mask_mod, enable_gqa=True)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = torch.autograd.grad(attncc.reference.attention(qd, kd, vd, score_mod, mask_mod, enable_gqa=True),
                               (qd, kd, vd), do.double())
    for i, (a, w) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all() and _rel(a, w) < GRAD_TOL[torch.bfloat16], (i, _rel(a, w))
    with torch.no_grad():  # decoding: two queries at the end of the keys
        out, lse = attncc.attention(q[:, :, -2:], k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True)
        ref, ref_lse = reference(q[:, :, -2:].detach(), k.detach(), v.detach(), score_mod, mask_mod, enable_gqa=True)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
