"""FlexAttention code on attncc: torch's helpers and constants trace, the math functions compile with
their derivatives, unsupported Python fails with located messages, and attncc.flex_attention runs
FlexAttention-style variants (ported from attention-gym's patterns, in our own words) with torch's
BlockMasks, against the float64 reference and against torch's own flex_attention (eager, float64).

torch's eager flex_attention evaluates mask_mod densely and ignores the BlockMask's block structure
(only its compiled kernels skip blocks), so CPU comparisons with torch use BlockMasks whose blocks
agree with their mask_mod; a BlockMask whose blocks are the mask (from_kv_blocks without mask_mod)
is checked against its dense form (BlockMask.to_dense) instead, and on the GPU against compiled
FlexAttention (tests/test_gpu_flex_compat.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

import attncc
from attncc import flex, ir
from conftest import REL_TOL, assert_close_to_reference, reference

# attncc must import triton before torch's flex_attention does (it compiles with dynamo), so that
# the Triton interpreter is on for CPU tensors (README, Limitations)
try:
    attncc.runtime.target_for(torch.device("cpu"))
except attncc.AttnccError:
    pass  # a GPU machine without the interpreter: conftest skips the CPU tests there

from torch.nn.attention.flex_attention import (AuxRequest, BlockMask, _identity, and_masks,  # noqa: E402
                                               create_block_mask, noop_mask, or_masks)
from torch.nn.attention.flex_attention import flex_attention as torch_flex  # noqa: E402

F = torch.nn.functional
HERE = os.path.abspath(__file__)
B, H, D = 2, 2, 16
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning",
                                        "ignore::FutureWarning", "ignore::DeprecationWarning")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(n):
    def sliding(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < n
    return sliding


def prefix(n):
    def prefix_lm(b, h, q_idx, kv_idx):
        return kv_idx < n
    return prefix_lm


# ----------------------------------------------------------------------------------------------
# Item 1: torch's combinators and constants


def test_combinators_trace_to_the_plain_expressions():
    both = attncc.Variant(None, and_masks(causal, window(8))).analysis.mask
    assert both == attncc.Variant(None, lambda b, h, q, kv: (q >= kv) & (q - kv < 8)).analysis.mask
    either = attncc.Variant(None, or_masks(prefix(4), causal)).analysis.mask
    assert either == attncc.Variant(None, lambda b, h, q, kv: (kv < 4) | (q >= kv)).analysis.mask
    nested = attncc.Variant(None, and_masks(or_masks(prefix(4), causal), window(8))).analysis.mask
    assert nested == attncc.Variant(None, lambda b, h, q, kv: ((kv < 4) | (q >= kv)) & (q - kv < 8)).analysis.mask
    plain = attncc.Variant(_identity, noop_mask)
    assert plain.score_ir is ir.score and plain.analysis.facts.mask_trivial and plain.analysis.facts.score_identity


CONSTANTS = {  # mod -> the constant it must add to the score
    "new_ones": (lambda s, b, h, q, kv: s + b.new_ones(()), 1.0),
    "new_ones_size_kw": (lambda s, b, h, q, kv: s + b.new_ones(size=(), dtype=torch.float32, device=b.device), 1.0),
    "new_zeros": (lambda s, b, h, q, kv: s + q.new_zeros([]), 0.0),
    "new_full": (lambda s, b, h, q, kv: s + s.new_full((), 2.5), 2.5),
    "new_tensor": (lambda s, b, h, q, kv: s + s.new_tensor(0.25), 0.25),
    "ones_like": (lambda s, b, h, q, kv: s + torch.ones_like(s) * 3, 3.0),
    "zeros_like": (lambda s, b, h, q, kv: s + torch.zeros_like(kv), 0.0),
    "full_like": (lambda s, b, h, q, kv: s + torch.full_like(s, -1.5), -1.5),
    "torch_ones": (lambda s, b, h, q, kv: s + torch.ones(()), 1.0),
    "torch_zeros_1": (lambda s, b, h, q, kv: s + torch.zeros(1), 0.0),
    "torch_full": (lambda s, b, h, q, kv: s + torch.full((), 4.0), 4.0),
    "torch_tensor": (lambda s, b, h, q, kv: s + torch.tensor(0.5), 0.5),
    "torch_tensor_int": (lambda s, b, h, q, kv: s + torch.tensor(2), 2.0),
    "scalar_tensor": (lambda s, b, h, q, kv: s + torch.scalar_tensor(-2.0), -2.0),
    "as_tensor": (lambda s, b, h, q, kv: s + torch.as_tensor(0.75), 0.75),
    "finfo_of_dtype": (lambda s, b, h, q, kv: s + torch.finfo(s.dtype).eps * 0, 0.0),
}


@pytest.mark.parametrize("name", list(CONSTANTS))
def test_made_values_become_constants(name):
    mod, value = CONSTANTS[name]
    v = attncc.Variant(mod)
    assert not v.captures, f"{name} became a captured tensor: {v!r}"
    assert (v.analysis.score - attncc.Variant(lambda s, b, h, q, kv: s + value).analysis.score).is_zero


def test_made_values_of_traced_values_and_masks():
    v = attncc.Variant(lambda s, b, h, q, kv: torch.tensor(q, dtype=torch.float32) * s)
    assert v.analysis.score == attncc.Variant(lambda s, b, h, q, kv: q * s).analysis.score
    m = attncc.Variant(None, lambda b, h, q, kv: torch.full((), True) & (q >= kv) & b.new_ones((), dtype=torch.bool))
    assert m.analysis.mask == attncc.Variant(None, causal).analysis.mask
    w = attncc.Variant(lambda s, b, h, q, kv: torch.where(q >= kv, s, torch.tensor(float("-inf"))))
    plain = attncc.Variant(lambda s, b, h, q, kv: torch.where(q >= kv, s, float("-inf")))
    assert w.analysis.score == plain.analysis.score


def test_captured_zero_dim_tensor_stays_a_runtime_argument():
    temp = torch.tensor(0.5)
    v = attncc.Variant(lambda s, b, h, q, kv: s * temp)
    assert [c.tensor for c in v.captures] == [temp]


# ----------------------------------------------------------------------------------------------
# Item 2: operations, each traced, compiled (forward and backward) and against the reference

OPS = {  # name -> (score_mod or mask_mod, is_mask, IR ops that must appear)
    "sin_cos": (lambda s, b, h, q, kv: torch.sin(s) + torch.cos(kv * 0.3), False, {"sin", "cos"}),
    "tan": (lambda s, b, h, q, kv: torch.tan(s * 0.3), False, {"tan"}),
    "atan": (lambda s, b, h, q, kv: torch.atan(s * 3.0) + torch.arctan((q - kv) * 0.5), False, {"atan"}),
    "erf": (lambda s, b, h, q, kv: torch.erf(s) + torch.special.erf(q * 0.1), False, {"erf"}),
    "silu": (lambda s, b, h, q, kv: F.silu(s), False, {"sigmoid", "mul"}),
    "gelu": (lambda s, b, h, q, kv: F.gelu(s), False, {"erf"}),
    "gelu_tanh": (lambda s, b, h, q, kv: F.gelu(s, approximate="tanh"), False, {"tanh"}),
    "softplus": (lambda s, b, h, q, kv: F.softplus(s, beta=2.0, threshold=1.0), False, {"log1p", "exp", "where"}),
    "relu": (lambda s, b, h, q, kv: torch.relu(s) + F.relu(s - 1) + F.leaky_relu(s, 0.1) + F.elu(s),
             False, {"where", "expm1"}),
    "log1p_expm1": (lambda s, b, h, q, kv: torch.log1p(s.abs()) + torch.expm1(s * 0.5), False, {"log1p", "expm1"}),
    "sign": (lambda s, b, h, q, kv: s * torch.sign(s) + torch.sgn(q - kv) * 0.25, False, {"sign"}),
    # (s * 1.5 + ...: with `s + round(s)` the backward fails, a bug of plan.py: test_piecewise_constant_...)
    "round": (lambda s, b, h, q, kv: s * 1.5 + torch.round(s * 2.0) + s.round(), False, {"round"}),
    "ceil_trunc": (lambda s, b, h, q, kv: s * 1.5 + torch.ceil(s) + torch.trunc(s * 3.0) + torch.fix(s), False,
                   {"ceil", "trunc"}),
    "pow_float": (lambda s, b, h, q, kv: s.abs() ** 1.5 + torch.pow(s * s + 1.0, 0.75) + 2.0 ** (s * 0.5), False,
                  {"pow"}),
    "fmod_remainder": (lambda s, b, h, q, kv: s + torch.fmod(s * 2.0, 0.7) + torch.remainder(s, 0.6)
                       + torch.fmod(q - kv, 3) * 0.1, False, {"fmod", "mod"}),
    "shifts_xor": (lambda b, h, q, kv: (((q >> 2) ^ (kv >> 2)) & 1 == 0) | ((q << 1) >= (kv << 1)), True,
                   {"lshift", "rshift", "xor"}),
}


@pytest.mark.parametrize("name", list(OPS))
def test_op_forward_lse_and_backward(name):
    mod, is_mask, ops = OPS[name]
    score_mod, mask_mod = (None, mod) if is_mask else (mod, None)
    v = attncc.Variant(score_mod, mask_mod)
    found = {n.op for r in (v.score_ir, v.mask_ir) if r is not None for n in ir.walk(r)}
    assert ops <= found, f"IR lacks {ops - found}: {v!r}"
    torch.manual_seed(sum(map(ord, name)))
    q, k, val = (torch.randn(1, 2, L, D) for L in (20, 28, 28))
    check_forward_and_grads(q, k, val, score_mod, mask_mod, lambda *a: attncc.attention(*a[:3], score_mod, mask_mod,
                                                                                          return_lse=True))


def test_new_op_tables_are_covered():
    seen = set()
    for mod, is_mask, _ in OPS.values():
        v = attncc.Variant(None, mod) if is_mask else attncc.Variant(mod)
        seen |= {n.op for r in (v.score_ir, v.mask_ir) if r is not None for n in ir.walk(r)}
    missing = (set(ir.UNARY_MATH) | set(ir.BINARY_MATH)) - seen
    assert not missing, f"no case uses {missing}"


def test_op_derivatives_are_sympy_expressions():
    import sympy as sp

    from attncc.passes.derive import derive
    from attncc.passes.symbolic import SCORE
    for name in ("sin_cos", "tan", "atan", "erf", "silu", "gelu", "softplus", "log1p_expm1", "sign", "round",
                 "ceil_trunc", "fmod_remainder"):
        d = derive(attncc.Variant(OPS[name][0]).analysis.score).dscore
        assert not d.has(sp.Derivative, sp.Subs, sp.DiracDelta), f"{name}: {d}"
    assert derive(attncc.Variant(lambda s, b, h, q, kv: torch.round(s) + torch.sign(s)).analysis.score).dscore == 0
    atan = derive(attncc.Variant(lambda s, b, h, q, kv: torch.atan(s)).analysis.score).dscore
    assert sp.simplify(atan - 1 / (1 + SCORE ** 2)) == 0


@pytest.mark.parametrize("fn", [torch.floor, torch.round])
def test_piecewise_constant_term_plus_score_backward(fn):
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
    mod = lambda s, b, h, qi, kv: s + fn(s)  # noqa: E731
    check_forward_and_grads(q, k, v, mod, None, lambda *a: attncc.attention(*a[:3], mod, return_lse=True))


def test_round_is_half_to_even_like_torch():
    from attncc.reference import evaluate
    xs = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.49999997, 8388609.0])
    got = evaluate(ir.round(ir.score), {"score": xs}, torch.float32, "cpu")
    assert torch.equal(got, torch.round(xs))
    # the kernels' form (interpreter): scores chosen so that score * scale hits the ties exactly
    q = torch.zeros(1, 1, 9, 1)
    q[0, 0, :, 0] = xs
    k = torch.ones(1, 1, 1, 1)
    v = torch.ones(1, 1, 1, 1)
    _, lse = attncc.attention(q, k, v, lambda s, b, h, qi, kv: torch.round(s), scale=1.0, return_lse=True)
    assert torch.equal(lse[0, 0], torch.round(xs))  # one key: lse is the modified score


# ----------------------------------------------------------------------------------------------
# Shared checks


def check_forward_and_grads(q, k, v, score_mod, mask_mod, run, caps=(), enable_gqa=False, tol=2e-5):
    """``run(q, k, v, *caps) -> (out, lse)`` in float32 against attncc.reference in float64: out and lse
    (conftest's bounds) and the gradients of q, k, v and ``caps`` (learnable captured tensors)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = run(q, k, v, *caps)
    ref, ref_lse = reference(q.detach(), k.detach(), v.detach(), score_mod, mask_mod, enable_gqa=enable_gqa)
    assert_close_to_reference(out, lse, ref, ref_lse, q.dtype)
    do = torch.randn(out.shape, dtype=torch.float64)
    dlse = torch.randn(lse.shape, dtype=torch.float64)

    def loss(o, s):
        return (o.double() * do).sum() + torch.where(torch.isfinite(s), s.double() * dlse, 0.0).sum()
    got = torch.autograd.grad(loss(out, lse), (q, k, v, *caps), allow_unused=True)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, l64 = attncc.reference.attention(qd, kd, vd, score_mod, mask_mod, enable_gqa=enable_gqa, return_lse=True)
    want = torch.autograd.grad(loss(o64, l64), (qd, kd, vd, *caps), allow_unused=True)
    size = max(w.norm().item() for w in want[:3] if w is not None)
    for name, g, w in zip(["dq", "dk", "dv"] + [f"dcap{i}" for i in range(len(caps))], got, want):
        assert g is not None and w is not None, name
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        err = (g.double() - w.double()).norm().item()
        assert err <= tol * max(w.norm().item(), 0.1 * size), f"{name}: |err| {err:.3e} vs |ref| {w.norm().item():.3e}"


# ----------------------------------------------------------------------------------------------
# FlexAttention-style variants (attention-gym's patterns, written anew)



@dataclass
class Case:
    """One variant: mods, lengths, the learnable captured tensors, and its BlockMask's shape."""
    score_mod: object = None
    mask_mod: object = None
    Lq: int = 40
    Lkv: int = 56
    learnable: tuple = ()
    per_bh: bool = False        # the mask reads b or h: a BlockMask per (batch, head)
    block: object = 16          # BLOCK_SIZE of the BlockMask


def _grid_natten_2d(n, device):
    rows, cols, kr, kc = 8 * n, 8 * n, 3, 5  # an image of rows x cols tokens, kernel kr x kc

    def natten_2d(b, h, q_idx, kv_idx):
        qr, qc = q_idx // cols, q_idx % cols
        kvr, kvc = kv_idx // cols, kv_idx % cols
        center_r = qr.clamp(kr // 2, rows - 1 - kr // 2)  # windows shift inward at the image border
        center_c = qc.clamp(kc // 2, cols - 1 - kc // 2)
        return ((center_r - kvr).abs() <= kr // 2) & ((center_c - kvc).abs() <= kc // 2)
    L = rows * cols
    return Case(None, natten_2d, L, L)


def _grid_natten_3d(n, device):
    frames, rows, cols, k = 2, 4 * n, 4 * n, 3

    def natten_3d(b, h, q_idx, kv_idx):
        def coords(i):
            return i // (rows * cols), (i // cols) % rows, i % cols
        qt, qr, qc = coords(q_idx)
        kt, kr_, kc = coords(kv_idx)
        ct = qt.clamp(0, frames - 1)
        cr = qr.clamp(k // 2, rows - 1 - k // 2)
        cc = qc.clamp(k // 2, cols - 1 - k // 2)
        return ((ct - kt).abs() <= 1) & ((cr - kr_).abs() <= k // 2) & ((cc - kc).abs() <= k // 2)
    L = frames * rows * cols
    return Case(lambda s, b, h, q, kv: s * 0.5, natten_3d, L, L)


def _morton(n, device):
    bits = 3 + (n > 1)  # a 2**bits x 2**bits image whose tokens are in Z (Morton) order

    def decode(m):
        x, y = m * 0, m * 0
        for i in range(bits):
            x = x | (((m >> (2 * i)) & 1) << i)
            y = y | (((m >> (2 * i + 1)) & 1) << i)
        return x, y

    def morton_neighbours(b, h, q_idx, kv_idx):
        qx, qy = decode(q_idx)
        kx, ky = decode(kv_idx)
        return ((qx - kx).abs() <= 1) & ((qy - ky).abs() <= 2)
    L = 4 ** bits
    return Case(None, morton_neighbours, L, L, block=(16, 8))


def _flamingo(n, device):
    per_image, images, Lq = 8 * n, 4, 40 * n  # text tokens attend to the latest image's tokens
    Lkv = per_image * images
    media = torch.full((Lq,), -1, dtype=torch.int32, device=device)  # -1: no image yet (row fully masked)
    for start, image in ((6 * n, 0), (15 * n, 1), (22 * n, 2), (31 * n, 3)):
        media[start:] = image

    def flamingo(b, h, q_idx, kv_idx):
        return media[q_idx] == kv_idx // per_image
    return Case(lambda s, b, h, q, kv: s + 0.1 * h, flamingo, Lq, Lkv)


def _dilated(n, device):
    dilation, reach = 3, 4

    def dilated_window(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d.abs() <= reach * dilation) & (d % dilation == 0)
    return Case(None, dilated_window, 40 * n, 56 * n)


def _sta(n, device):
    nt, nh, nw, tile = 2, 3 * n, 3 * n, 4  # tiles of 1 x 2 x 2 tokens, in tile-major order; window 1 x 3 x 3 tiles

    def sta(b, h, q_idx, kv_idx):
        def tile_coords(i):
            t = i // tile
            return t // (nh * nw), (t // nw) % nh, t % nw
        qt, qh, qw = tile_coords(q_idx)
        kt, kh, kw = tile_coords(kv_idx)
        ch = qh.clamp(1, nh - 2)
        cw = qw.clamp(1, nw - 2)
        return (qt == kt) & ((ch - kh).abs() <= 1) & ((cw - kw).abs() <= 1)
    L = nt * nh * nw * tile
    return Case(None, sta, L, L)


def _alibi_exp2(n, device):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + torch.exp2(-((h + 1) * 8.0 / H)) * (kv_idx - q_idx)
    return Case(alibi, causal, 40 * n, 56 * n, block=(16, 32))


def _softcap(n, device):
    def softcap(score, b, h, q_idx, kv_idx):
        return 2.0 * torch.tanh(score / 2.0)
    return Case(softcap, and_masks(causal, window(24 * n)), 40 * n, 56 * n)


def _trig(n, device):
    def trig(score, b, h, q_idx, kv_idx):
        return score + 0.5 * torch.sin(q_idx * 0.2) * torch.cos(kv_idx * 0.3) + torch.atan(score) * 0.1
    return Case(trig, or_masks(prefix(8 * n), causal), 40 * n, 56 * n)


def _silu(n, device):
    return Case(lambda score, b, h, q, kv: F.silu(score) + F.gelu(score, approximate="tanh") * 0.5,
                noop_mask, 40 * n, 56 * n)


def _rope_dot(n, device):
    Lq, Lkv = 40 * n, 56 * n
    g = torch.Generator(device=device).manual_seed(3)
    xq = 0.5 * torch.randn(Lq, 2, generator=g, device=device)
    xk = 0.5 * torch.randn(Lkv, 2, generator=g, device=device)
    theta = torch.tensor([0.05, 0.13], device=device, requires_grad=True)  # learnable angles

    def rope_dot(score, b, h, q_idx, kv_idx):
        a, c = q_idx * theta[h], kv_idx * theta[h]  # rotate each position's 2-vector, then dot them
        q0 = xq[q_idx, 0] * torch.cos(a) - xq[q_idx, 1] * torch.sin(a)
        q1 = xq[q_idx, 0] * torch.sin(a) + xq[q_idx, 1] * torch.cos(a)
        k0 = xk[kv_idx, 0] * torch.cos(c) - xk[kv_idx, 1] * torch.sin(c)
        k1 = xk[kv_idx, 0] * torch.sin(c) + xk[kv_idx, 1] * torch.cos(c)
        return score + q0 * k0 + q1 * k1
    return Case(rope_dot, None, Lq, Lkv, (theta,))


def _decoupled_rope_rows(n, device):
    """MLA's decoupled RoPE term: a query row per head and position dotted with a key row per
    position (rows of 16, float32: torch's eager flex_attention rounds a dot of bf16 rows to
    bf16): the kernels' tile product (attncc.passes.rowdots), tf32x3 on a GPU."""
    Lq, Lkv = 40 * n, 56 * n
    g = torch.Generator(device=device).manual_seed(8)
    q_rows = 0.3 * torch.randn(H, Lq, 16, generator=g, device=device)
    k_rows = 0.3 * torch.randn(Lkv, 16, generator=g, device=device)

    def decoupled_rope_rows(score, b, h, q_idx, kv_idx):
        return score + torch.dot(q_rows[h, q_idx], k_rows[kv_idx])
    return Case(decoupled_rope_rows, causal, Lq, Lkv)


def _learned_distance(n, device):
    far = 16
    table = (0.3 * torch.randn(H, far + 1, generator=torch.Generator(device=device).manual_seed(4),
                               device=device)).requires_grad_()

    def learned_distance(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx - kv_idx).abs().clamp(max=far)]
    return Case(learned_distance, causal, 40 * n, 56 * n, (table,))


def _scalar_temperature(n, device):
    temp = torch.tensor(0.7, device=device, requires_grad=True)
    offset = torch.tensor(0.3, device=device)

    def temperature(score, b, h, q_idx, kv_idx):
        return score * temp + offset * (q_idx > kv_idx)
    return Case(temperature, causal, 40 * n, 56 * n, (temp,))


def _bias_4d(n, device):
    Lq, Lkv = 40 * n, 56 * n
    bias = (0.5 * torch.randn(B, H, Lq, Lkv, generator=torch.Generator(device=device).manual_seed(5),
                              device=device)).requires_grad_()

    def bias_4d(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, q_idx, kv_idx]

    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 8 * h) | (b == 1)
    return Case(bias_4d, per_head, Lq, Lkv, (bias,), per_bh=True)


def _document(n, device):
    Lq = Lkv = 48 * n
    ids = torch.sort(torch.randint(0, 4, (Lq,), generator=torch.Generator(device=device).manual_seed(6),
                                   device=device)).values

    def document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    return Case(None, document, Lq, Lkv)


BUILDERS = {
    "combinators": lambda n, dev: Case(None, and_masks(or_masks(prefix(5 * n), causal), window(16 * n)), 40 * n, 56 * n),
    "natten_2d": _grid_natten_2d, "natten_3d": _grid_natten_3d, "morton": _morton, "flamingo": _flamingo,
    "dilated": _dilated, "sta": _sta, "alibi_exp2": _alibi_exp2, "softcap": _softcap, "trig": _trig,
    "silu": _silu, "rope_dot": _rope_dot, "decoupled_rope_rows": _decoupled_rope_rows,
    "learned_distance": _learned_distance,
    "scalar_temperature": _scalar_temperature, "bias_4d": _bias_4d, "document": _document,
}


def build(name: str, n: int = 1, device="cpu") -> Case:
    return BUILDERS[name](n, device)


def block_mask_of(case: Case, device="cpu"):
    if case.mask_mod is None:
        return None
    return create_block_mask(case.mask_mod, B if case.per_bh else None, H if case.per_bh else None, case.Lq,
                             case.Lkv, device=device, BLOCK_SIZE=case.block)


def inputs(case: Case, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(B, H, L, D, generator=g, device=device).to(dtype) for L in (case.Lq, case.Lkv, case.Lkv))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_variant_forward_lse_backward_against_reference(name):
    case = build(name)
    bm = block_mask_of(case)

    def run(q, k, v, *caps):
        out, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    check_forward_and_grads(*inputs(case), case.score_mod, case.mask_mod, run, case.learnable)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_variant_against_torch_flex_attention(name):
    case = build(name)
    bm = block_mask_of(case)
    q, k, v = (t.double() for t in inputs(case, seed=1))
    with torch.no_grad():
        want, want_aux = torch_flex(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True))
        got, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True, max_scores=True))
        # float64 both (attncc's reference path); 1e-6, not 1e-15: torch computes a Python float times
        # an int32 index (0.1 * h) in float32
        assert (got - want).abs().max() < 1e-6 and torch.equal(torch.isneginf(aux.lse), torch.isneginf(want_aux.lse))
        finite = torch.isfinite(want_aux.lse)
        assert (aux.lse - want_aux.lse)[finite].abs().max() < 1e-6
        want_max = _torch_max_scores(q, k, v, case.score_mod, bm)
        assert torch.equal(torch.isneginf(aux.max_scores), torch.isneginf(want_max))
        assert (aux.max_scores - want_max)[finite].abs().max() < 1e-6
        out32, aux32 = attncc.flex_attention(q.float(), k.float(), v.float(), case.score_mod, bm,
                                             return_aux=AuxRequest(lse=True, max_scores=True))
    assert_close_to_reference(out32, aux32.lse, want, want_aux.lse, torch.float32)
    finite = torch.isfinite(aux.max_scores)
    assert torch.equal(torch.isfinite(aux32.max_scores), finite)
    assert (aux32.max_scores.double() - aux.max_scores)[finite].abs().max() < 1e-4


def _torch_max_scores(q, k, v, score_mod, bm):
    """torch's own max_scores (its eager implementation; the public API refuses max_scores on the CPU)."""
    from torch._higher_order_ops.flex_attention import math_attention
    if bm is None:
        bm = create_block_mask(noop_mask, None, None, q.shape[2], k.shape[2], device=q.device)
    _, _, mx = math_attention(q, k, v, score_mod or _identity, bm.as_tuple(), 1 / math.sqrt(q.shape[-1]), {})
    return mx * math.log(2)  # its kernels keep stats in log2 units; flex_attention converts back


# ----------------------------------------------------------------------------------------------
# Item 5: attncc.flex_attention's BlockMask handling, returns, caching and torch.compile


def _dense_attention(q, k, v, allowed, score_mod=None):
    """Softmax attention under an explicit (B or 1, H or 1, Lq, Lkv) bool mask, float64; 0 on empty rows."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    return p @ v.double()


def _block_local(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx // 16 - kv_idx // 16 <= 1)


def test_block_mask_from_kv_blocks_by_hand():
    """Hand-built BlockMasks, Lq != Lkv: blocks that agree with mask_mod (checked against torch), blocks
    that are the mask (noop mask_mod, with full blocks), and full blocks where mask_mod says False."""
    Lq, Lkv = 48, 64
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for L in (Lq, Lkv, Lkv))
    # q block i: kv block i - 1 in full, kv block i partial (causal inside); 3 q blocks, 4 kv blocks
    partial_num = torch.tensor([1, 1, 1], dtype=torch.int32).view(1, 1, 3)
    partial_idx = torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3], [2, 0, 1, 3]], dtype=torch.int32).view(1, 1, 3, 4)
    full_num = torch.tensor([0, 1, 1], dtype=torch.int32).view(1, 1, 3)
    full_idx = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [1, 0, 2, 3]], dtype=torch.int32).view(1, 1, 3, 4)
    agree = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=16,
                                     mask_mod=_block_local, seq_lengths=(Lq, Lkv))
    with torch.no_grad():
        want = torch_flex(q, k, v, block_mask=agree)
        assert (attncc.flex_attention(q, k, v, block_mask=agree) - want).abs().max() < 1e-12
        out32 = attncc.flex_attention(q.float(), k.float(), v.float(), block_mask=agree)
    assert (out32.double() - want).norm() / want.norm() < REL_TOL[torch.float32]
    assert "mask_mod alone" in flex.explain(None, agree)

    blocks_only = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=16,
                                           seq_lengths=(Lq, Lkv))  # mask_mod = noop: the blocks are the mask
    dense = blocks_only.to_dense().bool().repeat_interleave(16, -2).repeat_interleave(16, -1)[..., :Lq, :Lkv]
    want = _dense_attention(q, k, v, dense)
    with torch.no_grad():
        assert (attncc.flex_attention(q, k, v, block_mask=blocks_only) - want).abs().max() < 1e-12
        got = attncc.flex_attention(q.float(), k.float(), v.float(), block_mask=blocks_only)
    assert (got.double() - want).norm() / want.norm() < REL_TOL[torch.float32]
    text = flex.explain(None, blocks_only)
    assert "reads the block table" in text and "left out but mask_mod is True" in text

    # full blocks ignore mask_mod (FlexAttention skips mask_mod there): kv block i - 1 is listed full, causal
    # inside it anyway; make mask_mod False in it to see the difference
    def diagonal_blocks_only(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // 16 == kv_idx // 16)
    full_wins = BlockMask.from_kv_blocks(partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=16,
                                         mask_mod=diagonal_blocks_only, seq_lengths=(Lq, Lkv))
    qi, ki = torch.arange(Lq).view(-1, 1), torch.arange(Lkv).view(1, -1)
    allowed = (qi // 16 - ki // 16 == 1) | ((qi >= ki) & (qi // 16 == ki // 16))
    want = _dense_attention(q, k, v, allowed)
    with torch.no_grad():
        got = attncc.flex_attention(q.float(), k.float(), v.float(), block_mask=full_wins)
    assert (got.double() - want).norm() / want.norm() < REL_TOL[torch.float32]
    assert "listed full but mask_mod is False" in flex.explain(None, full_wins)


@pytest.mark.parametrize("block", [32, 64, 48], ids=["32", "64", "48"])
def test_block_table_gives_the_tile_classes_when_its_blocks_are_whole_tiles(block, monkeypatch):
    """A BlockMask that is the mask (blocks per batch and head, partial and full, ragged lengths):
    with block sizes that are multiples of 32 the kernels' tile classes come straight from its
    table (the mask is not classified again); 48 is classified. Forward, lse and gradients against
    the dense reference of the same blocks."""
    Lq, Lkv = 100, 150
    nq, nkv = -(-Lq // block), -(-Lkv // block)
    g = torch.Generator().manual_seed(block)
    cls = torch.randint(0, 3, (B, H, nq, nkv), generator=g)
    cls[..., 0] = 2  # every query row attends somewhere
    order = torch.argsort(torch.rand(B, H, nq, nkv, generator=g), dim=-1)

    def listed(c):
        sel = (cls == c).gather(-1, order)
        idx = order.gather(-1, torch.argsort((~sel).to(torch.int8), dim=-1, stable=True))
        return sel.sum(-1).to(torch.int32), idx.to(torch.int32)
    bm = BlockMask.from_kv_blocks(*listed(1), *listed(2), BLOCK_SIZE=block, seq_lengths=(Lq, Lkv))
    tables = []
    real = attncc.blocks.fine_table
    monkeypatch.setattr(attncc.blocks, "fine_table", lambda *a: tables.append(real(*a)) or tables[-1])
    dense = (cls > 0).repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :Lq, :Lkv]
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for L in (Lq, Lkv, Lkv))
    want = _dense_attention(q, k, v, dense)
    with torch.no_grad():
        got = attncc.flex_attention(q.float(), k.float(), v.float(), block_mask=bm)
    assert (got.double() - want).norm() / want.norm() < REL_TOL[torch.float32]
    assert tables and all((t is not None) == (block % 32 == 0) for t in tables)
    assert ("read off the table" if block % 32 == 0 else "rebuilds them") in flex.explain(None, bm)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    attncc.flex_attention(qf, kf, vf, block_mask=bm).square().sum().backward()
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    _dense_attention(qd, kd, vd, dense).square().sum().backward()
    for got_g, want_g in ((qf.grad, qd.grad), (kf.grad, kd.grad), (vf.grad, vd.grad)):
        assert torch.isfinite(got_g).all() and (got_g.double() - want_g).norm() / want_g.norm() < 1e-4


def test_block_mask_per_batch_and_head_with_gqa():
    Hq, Hkv, Lq, Lkv = 4, 2, 40, 48

    def per_head(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + 4 * h) & ((kv_idx >= 8 * b) | (q_idx == kv_idx))
    bm = create_block_mask(per_head, B, Hq, Lq, Lkv, device="cpu", BLOCK_SIZE=16)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    q = torch.randn(B, Hq, Lq, D, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Lkv, D, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        want, want_aux = torch_flex(q, k, v, alibi, bm, enable_gqa=True, return_aux=AuxRequest(lse=True))
        got, aux = attncc.flex_attention(q.float(), k.float(), v.float(), alibi, bm, enable_gqa=True,
                                         return_aux=AuxRequest(lse=True))
    assert_close_to_reference(got, aux.lse, want, want_aux.lse, torch.float32)
    check_forward_and_grads(q.float(), k.float(), v.float(), alibi, per_head,
                            lambda q, k, v: attncc.flex_attention(q, k, v, alibi, bm, enable_gqa=True, return_lse=True),
                            enable_gqa=True)


def test_return_conventions_and_argument_errors():
    case = build("alibi_exp2")
    bm = block_mask_of(case)
    q, k, v = inputs(case)
    out = attncc.flex_attention(q, k, v, case.score_mod, bm)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = attncc.flex_attention(q, k, v, case.score_mod, bm, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    out3, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True))
    assert torch.equal(out, out3) and torch.equal(aux.lse, lse) and aux.max_scores is None
    _, aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == q.shape[:3] and aux.max_scores.dtype == torch.float32
    assert type(aux).__name__ == "AuxOutput"
    same = attncc.flex_attention(q, k, v, case.score_mod, bm, kernel_options={"BLOCK_M": 64, "BACKEND": "TRITON"})
    assert torch.equal(out, same)  # FlexAttention's Triton knobs are accepted and ignored
    with pytest.raises(attncc.AttnccError, match="not both"):
        attncc.flex_attention(q, k, v, block_mask=bm, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(attncc.AttnccError, match="created for lengths"):
        attncc.flex_attention(q[:, :, :16], k, v, block_mask=bm)
    with pytest.raises(attncc.AttnccError, match="_adjust"):
        attncc.flex_attention(q, k[:, :, :48], v[:, :, :48], block_mask=bm)
    with pytest.raises(attncc.AttnccError, match="sliced"):
        attncc.flex_attention(q, k, v, block_mask=bm[:, :1])  # slicing resets mask_mod (torch raises too)


def test_training_loop_traces_and_checks_once(monkeypatch):
    calls = []
    real_trace = attncc.trace.trace
    monkeypatch.setattr(attncc.trace, "trace", lambda fn, kind: calls.append(fn) or real_trace(fn, kind))
    bias = torch.randn(H)

    def counted(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    checks = []
    real = attncc.blockmask.disagreement
    monkeypatch.setattr(attncc.blockmask, "disagreement", lambda *a: checks.append(1) or real(*a))
    bm = create_block_mask(_block_local, None, None, 40, 56, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, H, L, D) for L in (40, 56, 56))
    first = attncc.flex_attention(q, k, v, counted, bm)
    assert counted in calls and len(checks) == 1
    traced = len(calls)
    for _ in range(3):
        assert torch.equal(attncc.flex_attention(q, k, v, counted, bm), first)
    assert len(calls) == traced and len(checks) == 1

    def make(t):
        def shifted(score, b, h, q_idx, kv_idx):
            return score + t[h]
        return shifted
    other = torch.randn(H)
    out = attncc.flex_attention(q, k, v, make(other), bm)  # a new closure over a new tensor: traced anew
    ref, _ = reference(q, k, v, make(other), _block_local)
    assert (out.double() - ref).norm() / ref.norm() < REL_TOL[torch.float32]
    bias.add_(1.0)  # in place: the same trace reads the new values
    ref, _ = reference(q, k, v, counted, _block_local)
    assert (attncc.flex_attention(q, k, v, counted, bm).double() - ref).norm() / ref.norm() < REL_TOL[torch.float32]
    assert len(calls) == traced + 1 and calls[-1] is not counted  # the new closure's trace; none for counted


class _Biased:
    def __init__(self, bias):
        self.bias = bias

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[h] * (kv_idx - q_idx)


def test_bound_method_mods_are_keyed_on_their_object():
    q, k, v = (torch.randn(1, H, 24, D) for _ in range(3))
    first, second = _Biased(torch.tensor([0.5, -0.5])), _Biased(torch.tensor([-1.0, 1.0]))
    for mod in (first.score_mod, second.score_mod):
        out = attncc.flex_attention(q, k, v, mod)
        ref, _ = reference(q, k, v, mod)
        assert (out.double() - ref).norm() / ref.norm() < REL_TOL[torch.float32]
    with pytest.raises(attncc.AttnccError, match="must be a torch.nn.attention.flex_attention.BlockMask"):
        attncc.flex_attention(q, k, v, block_mask=causal)


def test_torch_compile_fullgraph():
    case = build("learned_distance")
    bm = block_mask_of(case)
    table = case.learnable[0]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, k, v, score_mod, block_mask):
        out, aux = attncc.flex_attention(q, k, v, score_mod, block_mask, return_aux=AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores
    q, k, v = (t.requires_grad_() for t in inputs(case, seed=2))
    out, lse, mx = step(q, k, v, case.score_mod, bm)
    (out.sum() + lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v, table)]
    for t in (q, k, v, table):
        t.grad = None
    e_out, e_aux = attncc.flex_attention(q, k, v, case.score_mod, bm, return_aux=AuxRequest(lse=True, max_scores=True))
    (e_out.sum() + e_aux.lse.sum()).backward()
    assert torch.allclose(out, e_out, atol=1e-6) and torch.allclose(lse, e_aux.lse, atol=1e-5)
    assert torch.equal(mx, e_aux.max_scores)
    for g, t in zip(grads, (q, k, v, table)):
        assert torch.allclose(g, t.grad, atol=1e-5)
    # the same code over another tensor: the compiled graph reads that tensor
    other = build("learned_distance")
    with torch.no_grad():
        other.learnable[0].copy_(torch.randn(other.learnable[0].shape))
        got = step(q, k, v, other.score_mod, bm)[0]
        want = attncc.flex_attention(q, k, v, other.score_mod, bm)
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, out, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# Item 4: what a mod cannot do fails with the mod, the line, and what to write instead


def _matmul(s, b, h, q, kv):
    return s @ s


def _dict_key(s, b, h, q, kv):
    return {s: 1.0}[s]


def _attribute(s, b, h, q, kv):
    return s.softmax_scale


def _list_index(s, b, h, q, kv):
    return s + [1.0, 2.0][q]


def _divmod(s, b, h, q, kv):
    return divmod(s, 2)[0]


def _softmax(s, b, h, q, kv):
    return torch.softmax(s, 0)


def _math_sin(s, b, h, q, kv):
    return math.sin(s)


def _python_if(s, b, h, q, kv):
    return s if q > kv else 0.0


def _item(s, b, h, q, kv):
    return s + q.item()


def _whole_tensor(s, b, h, q, kv):
    return s + torch.zeros(3)


def _big_constant(s, b, h, q, kv):
    return s + s.new_ones(3)


def _string(s, b, h, q, kv):
    return s + "bias"


def _python_round(s, b, h, q, kv):
    return round(s)


def _float_shift(s, b, h, q, kv):
    return s << 1


BAD_MODS = [_matmul, _dict_key, _attribute, _list_index, _divmod, _softmax, _math_sin, _python_if, _item,
            _whole_tensor, _big_constant, _string, _python_round, _float_shift]


@pytest.mark.parametrize("mod", BAD_MODS, ids=lambda f: f.__name__)
def test_unsupported_constructs_name_the_mod_line_and_fix(mod):
    with pytest.raises(attncc.AttnccError) as info:
        attncc.flex_attention(*(torch.randn(1, 1, 8, 16) for _ in range(3)), score_mod=mod)
    text = str(info.value)
    line = mod.__code__.co_firstlineno + 1
    assert mod.__name__ in text and f"{HERE}:{line}" in text, text
    assert any(w in text for w in ("use ", "Use ", "write", "Supported", "index it", "make a", "scale first",
                                   "shift integers", "instead")), text


def _inner_matmul(b, h, q, kv):
    return q @ kv


def _inner_returns_list(b, h, q, kv):
    return [q]


@pytest.mark.parametrize("inner", [_inner_matmul, _inner_returns_list], ids=lambda f: f.__name__)
def test_failure_inside_torch_helpers_names_the_users_line(inner):
    with pytest.raises(attncc.AttnccError) as info:
        attncc.Variant(None, and_masks(causal, inner))
    text = str(info.value)
    assert "and_mask" in text and HERE in text, text
    if inner is _inner_returns_list:  # the failing frame is torch's and_mask: it is named, and our line
        assert "through torch's" in text and "flex_attention.py" in text, text
    else:
        assert f"{HERE}:{inner.__code__.co_firstlineno + 1}" in text, text
