"""Tracing mods into IR: the IR and facts it produces, canonical keys, and every supported
operation traced, compiled and run against the float64 reference (small shapes, fp32)."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc import ir
from conftest import check, randn_qkv
from variants import BUILDERS

B, H, LQ, LKV, D = 2, 2, 37, 45, 16  # ragged against the interpreter's 32x32 tiles


def ops_of(variant: attncc.Variant) -> set:
    roots = [variant.score_ir] + ([variant.mask_ir] if variant.mask_ir is not None else [])
    return {n.op for r in roots for n in ir.walk(r)}


def variant_of(name: str) -> attncc.Variant:
    return attncc.Variant(*BUILDERS[name](B, H, LQ, LKV, "cpu"))


# ----------------------------------------------------------------------------------------------
# IR, facts and canonical keys


def test_traced_ir_of_causal_and_alibi():
    causal = variant_of("causal")
    assert causal.score_ir is ir.score
    assert causal.mask_ir == ir.binary("ge", ir.q_idx, ir.kv_idx)
    alibi = variant_of("alibi")
    slopes = alibi.captures[0].tensor
    assert alibi.score_ir == ir.score + ir.load(slopes, ir.h) * (ir.kv_idx - ir.q_idx)
    assert [c.tensor for c in alibi.captures] == [slopes]


def test_explain_mentions_ir_simplified_form_and_facts():
    text = attncc.compile(variant_of("alibi")).explain()
    for needle in ("IR (as traced)", "Simplified (sympy)", "Derived facts", "score_mod is a pure additive bias",
                   "mask depends only on q_idx, kv_idx", "Captured tensors"):
        assert needle in text, f"explain() lacks {needle!r}:\n{text}"
    assert "slopes" in text  # the captured tensor keeps its Python name
    lines = {line.split(":")[0].strip(): line.split(":")[-1].strip() for line in text.splitlines() if ":" in line}
    assert lines["score_mod is a pure additive bias"] == "yes"
    assert lines["mask depends only on q_idx, kv_idx"] == "yes"
    assert lines["score_mod is the identity"] == "no"


@pytest.mark.parametrize("name,identity,bias,affine,mask_trivial,index_only", [
    ("full", True, True, True, True, False),
    ("causal", True, True, True, False, True),
    ("sliding_window", True, True, True, False, True),
    ("prefix_lm", True, True, True, False, True),
    ("document", True, True, True, False, False),
    ("alibi", False, True, True, False, True),
    ("rel_bias", False, True, True, True, False),
    ("softcap", False, False, False, True, False),
])
def test_facts_of_example_variants(name, identity, bias, affine, mask_trivial, index_only):
    f = variant_of(name).analysis.facts
    assert (f.score_identity, f.score_bias, f.score_affine) == (identity, bias, affine)
    assert (f.mask_trivial, f.mask_index_only) == (mask_trivial, index_only)


def test_facts_of_scaled_and_temperature_scores():
    scaled = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score * 2.0).analysis.facts
    assert scaled.score_affine and not scaled.score_bias and not scaled.score_identity
    per_head = torch.rand(H)
    temp = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score * per_head[h] + q_idx).analysis.facts
    assert temp.score_affine and not temp.score_bias
    assert temp.captures_in_score == (0,) and temp.captures_in_mask == ()


def test_facts_list_what_mods_read():
    f = variant_of("document").analysis.facts
    assert set(f.mask_reads) == {"q_idx", "kv_idx", "cap0", "cap1"}
    assert f.captures_in_mask == (0, 1)
    f = variant_of("alibi").analysis.facts
    assert set(f.score_reads) == {"score", "h", "q_idx", "kv_idx", "cap0"}


def test_identity_score_mod_is_recognised():
    v = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score * 1 + 0)
    assert v.analysis.facts.score_identity
    assert v.analysis.key == attncc.Variant().analysis.key


def test_canonical_key_is_order_independent():
    bias_a, bias_b = torch.randn(H), torch.randn(H)
    v1 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + bias_a[h])
    v2 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: bias_b[h] + score)
    assert v1.analysis.key == v2.analysis.key
    m1 = attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (kv_idx < 9))
    m2 = attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx < 9) & (q_idx >= kv_idx))
    assert m1.analysis.key == m2.analysis.key
    p1 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score * bias_a[h] * 2.0)
    p2 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: 2.0 * (bias_b[h] * score))
    assert p1.analysis.key == p2.analysis.key
    src = [attncc.compile(v).source("fwd", dtype=torch.float16, head_dim=64) for v in (v1, v2)]
    assert src[0] == src[1]


def test_different_variants_get_different_keys():
    keys = {variant_of(name).analysis.key for name in BUILDERS}
    assert len(keys) == len(BUILDERS)
    window = [attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx, w=w: q_idx - kv_idx < w).analysis.key
              for w in (4, 5)]
    assert window[0] != window[1]


def test_ir_key_names_captures_by_position_not_identity():
    a, b_ = torch.randn(H), torch.randn(H)
    k1 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + a[h]).ir_key
    k2 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + b_[h]).ir_key
    assert k1 == k2
    i = torch.randint(0, 3, (H,))
    k3 = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + i[h]).ir_key
    assert k3 != k1  # an int capture is a different kernel


# ----------------------------------------------------------------------------------------------
# Every supported operation: traced into the expected IR op, compiled, matching the reference

_g = torch.Generator().manual_seed(1234)
BIAS_KV = torch.randn(LKV, generator=_g)
SLOPES = torch.rand(H, generator=_g)
PAIR = torch.randn(LQ, LKV, generator=_g)
PER_BATCH_HEAD = torch.randn(B, H, generator=_g)
TABLE = torch.randn(H, LQ + LKV + 1, generator=_g)
DOC = torch.sort(torch.randint(0, 4, (max(LQ, LKV),), generator=_g)).values
ALLOWED = torch.rand(LQ, LKV, generator=_g) > 0.3
TEMP = torch.tensor(0.75)
INT_SHIFT = torch.tensor(2)


def _s(fn):
    return fn, None


def _m(fn):
    return None, fn


# id -> ((score_mod, mask_mod), IR ops that must appear)
OPS = {
    "add": (_s(lambda s, b, h, q, kv: s + q * 0.01), {"add", "mul"}),
    "radd_int": (_s(lambda s, b, h, q, kv: 3 + s), {"add"}),
    "sub": (_s(lambda s, b, h, q, kv: s - kv * 0.02), {"sub"}),
    "rsub": (_s(lambda s, b, h, q, kv: 1.0 - s), {"sub"}),
    "mul": (_s(lambda s, b, h, q, kv: s * 1.5), {"mul"}),
    "truediv": (_s(lambda s, b, h, q, kv: s / 1.7), {"truediv"}),
    "rtruediv_float": (_s(lambda s, b, h, q, kv: s + 2.0 / (kv + 1)), {"truediv"}),
    "int_truediv": (_s(lambda s, b, h, q, kv: s + (q - kv) / 7), {"truediv"}),
    "floordiv_int": (_m(lambda b, h, q, kv: (q // 4) >= (kv // 4)), {"floordiv"}),
    "floordiv_float": (_s(lambda s, b, h, q, kv: s // 0.5), {"floordiv"}),
    "mod_int": (_m(lambda b, h, q, kv: (q - kv) % 3 != 1), {"mod", "ne"}),
    "mod_float": (_s(lambda s, b, h, q, kv: s % 0.7), {"mod"}),
    "neg": (_s(lambda s, b, h, q, kv: -s), {"neg"}),
    "pow_int": (_s(lambda s, b, h, q, kv: s - (q - kv) ** 2 * 0.001), {"pow"}),
    "rpow": (_s(lambda s, b, h, q, kv: 2 ** torch.tanh(s)), {"pow"}),
    "lt": (_m(lambda b, h, q, kv: kv < q + 1), {"lt"}),
    "le": (_m(lambda b, h, q, kv: kv <= q), {"le"}),
    "gt": (_m(lambda b, h, q, kv: q + 3 > kv), {"gt"}),
    "ge": (_m(lambda b, h, q, kv: q >= kv), {"ge"}),
    "eq": (_m(lambda b, h, q, kv: (q % 4) == (kv % 4)), {"eq"}),
    "ne": (_m(lambda b, h, q, kv: q != kv), {"ne"}),
    "and_or_invert": (_m(lambda b, h, q, kv: ~((q < kv) | (kv == 5)) & (h >= 0)), {"and", "or", "invert"}),
    "xor": (_m(lambda b, h, q, kv: (q >= kv) ^ (kv < 4)), {"xor"}),
    "bitwise_int": (_m(lambda b, h, q, kv: ((q & 3) == (kv & 3)) | ((q | kv) == q)), {"and", "or"}),
    "bitwise_not_int": (_s(lambda s, b, h, q, kv: s + (~q) * 0.01), {"invert"}),
    "logical_fns": (_m(lambda b, h, q, kv: torch.logical_or(torch.logical_and(q >= kv, kv > 2),
                                                            torch.logical_not(kv != 0))), {"and", "or", "invert"}),
    "where": (_s(lambda s, b, h, q, kv: torch.where(q >= kv, s, s * 0.5)), {"where"}),
    "where_scalars": (_s(lambda s, b, h, q, kv: s + torch.where(kv > q, 1, 0)), {"where"}),
    "where_minus_inf": (_s(lambda s, b, h, q, kv: torch.where(q >= kv, s, float("-inf"))), {"where"}),
    "exp": (_s(lambda s, b, h, q, kv: torch.exp(torch.tanh(s))), {"exp"}),
    "exp_method": (_s(lambda s, b, h, q, kv: (s * 0.3).exp()), {"exp"}),
    "exp2": (_s(lambda s, b, h, q, kv: torch.exp2(torch.sigmoid(s))), {"exp2"}),
    "log": (_s(lambda s, b, h, q, kv: torch.log(s.abs() + 1.0)), {"log"}),
    "log2": (_s(lambda s, b, h, q, kv: s + torch.log2(kv + 1.0)), {"log2"}),
    "tanh": (_s(lambda s, b, h, q, kv: 5.0 * torch.tanh(s / 5.0)), {"tanh"}),
    "sigmoid": (_s(lambda s, b, h, q, kv: s * torch.sigmoid(s)), {"sigmoid"}),
    "abs": (_s(lambda s, b, h, q, kv: abs(s) - torch.abs(q - kv) * 0.05), {"abs"}),
    "sqrt": (_s(lambda s, b, h, q, kv: torch.sqrt(s.abs() + 0.5)), {"sqrt"}),
    "rsqrt": (_s(lambda s, b, h, q, kv: s * torch.rsqrt(s * s + 1.0)), {"rsqrt"}),
    "minimum": (_s(lambda s, b, h, q, kv: torch.minimum(s, (q - kv) * 0.1)), {"minimum"}),
    "maximum": (_s(lambda s, b, h, q, kv: torch.maximum(s, (kv - q) * 0.1)), {"maximum"}),
    "clamp": (_s(lambda s, b, h, q, kv: s.clamp(-0.5, 0.5)), {"minimum", "maximum"}),
    "clamp_kw": (_s(lambda s, b, h, q, kv: torch.clamp(s, min=-0.3) + torch.clip(s, max=0.2)), {"minimum", "maximum"}),
    "clamp_int": (_s(lambda s, b, h, q, kv: s + torch.clamp(q - kv, min=-3, max=3) * 0.1), {"minimum", "maximum"}),
    "floor": (_s(lambda s, b, h, q, kv: torch.floor(s * 2.0)), {"floor"}),
    "to_float32": (_s(lambda s, b, h, q, kv: s + (q - kv).to(torch.float32) * 0.01), {"cast"}),
    "to_dtype_kw": (_s(lambda s, b, h, q, kv: s + (q - kv).to(dtype=torch.float16) * 0.01), {"cast"}),
    "float": (_s(lambda s, b, h, q, kv: s + (q >= kv).float()), {"cast"}),
    "long": (_s(lambda s, b, h, q, kv: (s * 4.0).long() * 0.25), {"cast"}),
    "int_bool": (_m(lambda b, h, q, kv: ((q - kv) % 2).bool() | (q == kv)), {"cast"}),
    "bool_times_score": (_s(lambda s, b, h, q, kv: s * (q >= kv)), {"mul"}),
    "python_constants": (_s(lambda s, b, h, q, kv: s * 2 + 1 - True + 0.5), {"const"}),
    "torch_functions": (_s(lambda s, b, h, q, kv: torch.sub(torch.mul(torch.add(s, 1.0), 0.5), torch.div(kv, 50))),
                        {"add", "mul", "sub", "truediv"}),
    "torch_add_alpha": (_s(lambda s, b, h, q, kv: torch.add(s, (q - kv).float(), alpha=0.01)), {"add", "mul"}),
    "remainder_floor_divide": (_m(lambda b, h, q, kv: torch.remainder(q, 3) == torch.floor_divide(kv, 7) % 3),
                               {"mod", "floordiv"}),
    "batch_and_head": (_s(lambda s, b, h, q, kv: s + b * 0.3 - h * 0.2), {"b", "h"}),
    "index_1d_kv": (_s(lambda s, b, h, q, kv: s + BIAS_KV[kv]), {"load"}),
    "index_1d_head": (_s(lambda s, b, h, q, kv: s * SLOPES[h]), {"load"}),
    "index_2d_tiles": (_s(lambda s, b, h, q, kv: s + PAIR[q, kv]), {"load"}),
    "index_2d_scalars": (_s(lambda s, b, h, q, kv: s + PER_BATCH_HEAD[b, h]), {"load"}),
    "index_chained_tiles": (_s(lambda s, b, h, q, kv: s + PAIR[q][kv]), {"load"}),
    "index_2d_head_relative": (_s(lambda s, b, h, q, kv: s + TABLE[h, q - kv + LKV]), {"load"}),
    "index_chained_head": (_s(lambda s, b, h, q, kv: s + TABLE[h][q + kv]), {"load"}),
    "index_2d_constant_and_tile": (_s(lambda s, b, h, q, kv: s + PAIR[3, kv]), {"load"}),
    "index_int_capture": (_m(lambda b, h, q, kv: DOC[q] == DOC[kv]), {"load", "eq"}),
    "index_bool_capture": (_m(lambda b, h, q, kv: ALLOWED[q, kv] | (q == kv)), {"load"}),
    "index_computed": (_s(lambda s, b, h, q, kv: s + BIAS_KV[(q * 7 + kv) % LKV]), {"load", "mod"}),
    "zero_dim_float": (_s(lambda s, b, h, q, kv: s * TEMP), {"load"}),
    "zero_dim_int": (_m(lambda b, h, q, kv: q + INT_SHIFT >= kv), {"load"}),
}
@pytest.mark.parametrize("name", list(OPS))
def test_supported_op_traces_and_matches_reference(name):
    (score_mod, mask_mod), expected_ops = OPS[name]
    v = attncc.Variant(score_mod, mask_mod)
    found = ops_of(v)
    assert expected_ops <= found, f"IR lacks {expected_ops - found}: {v!r}"
    torch.manual_seed(sum(map(ord, name)))
    q, k, v_ = randn_qkv(B, H, H, LQ, LKV, D)
    check(q, k, v_, score_mod, mask_mod, kernel=attncc.compile(v))


def test_op_table_covers_the_ir():
    """Every IR op is exercised by some traced case above."""
    seen = set().union(*(ops_of(attncc.Variant(*mods)) for mods, _ in OPS.values()))
    unary, binary = set(ir.UNARY), set(ir.BINARY)
    missing = (unary | binary | {"where", "cast", "load", "const"} | set(ir.LEAVES)) - seen
    assert not missing, f"no traced case uses {missing}"


def test_captured_tensor_keeps_its_python_name():
    v = variant_of("document")
    assert [c.name for c in v.captures] == ["doc_q", "doc_kv"]
    src = attncc.compile(v).source("fwd", dtype=torch.float16, head_dim=64)
    assert "doc_q" in src and "doc_kv" in src


def test_same_tensor_in_score_and_mask_is_one_capture():
    w = torch.rand(LKV)
    v = attncc.Variant(lambda s, b, h, q, kv: s + w[kv], lambda b, h, q, kv: w[kv] > 0.2)
    assert len(v.captures) == 1
    q, k, vv = randn_qkv(1, 2, 2, 20, LKV, 16)
    check(q, k, vv, v.score_mod, v.mask_mod, kernel=attncc.compile(v))


# ----------------------------------------------------------------------------------------------
# Integer semantics: // and % floor like torch and Python; .long() truncates




def _explicit_mask(fn, Lq, Lkv):
    return torch.tensor([[bool(fn(q, kv)) for kv in range(Lkv)] for q in range(Lq)])


@pytest.mark.parametrize("name,traced,python", [
    ("floordiv_neg", lambda b, h, q, kv: ((q - kv) // 3) % 2 == 0, lambda q, kv: ((q - kv) // 3) % 2 == 0),
    ("mod_neg", lambda b, h, q, kv: (q - kv) % 3 == 0, lambda q, kv: (q - kv) % 3 == 0),
    ("mod_neg_divisor", lambda b, h, q, kv: (q - kv) % -4 > -2, lambda q, kv: (q - kv) % -4 > -2),
    ("floordiv_neg_numerator_only", lambda b, h, q, kv: ((-q // 3) != (-kv // 3)) | (q == kv),
     lambda q, kv: (-q // 3) != (-kv // 3) or q == kv),
    pytest.param("floordiv_kv_minus_q", lambda b, h, q, kv: ((kv - q) // 3) % 2 == 0,
                 lambda q, kv: ((kv - q) // 3) % 2 == 0),
    pytest.param("floordiv_neg_divisor", lambda b, h, q, kv: ((q - kv) // -3) % 2 == 0,
                 lambda q, kv: ((q - kv) // -3) % 2 == 0),
    pytest.param("trunc_long", lambda b, h, q, kv: ((q - kv) / 3).long() == 0, lambda q, kv: int((q - kv) / 3) == 0,),
])
def test_integer_division_semantics(name, traced, python):
    torch.manual_seed(20)
    Lq, Lkv = 40, 50
    q, k, v = randn_qkv(1, 2, 2, Lq, Lkv, 16)
    out, _, _ = check(q, k, v, None, traced)
    allowed = _explicit_mask(python, Lq, Lkv)
    assert allowed.any(dim=1).all()
    assert not allowed.all()
    expect = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    assert torch.allclose(out.double(), expect, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Regression tests for bugs found and fixed during development

_INT_FLOAT_FNS = {
    "exp": lambda x: torch.exp(-x), "exp2": lambda x: torch.exp2(-x),
    "log": lambda x: torch.log(x + 1), "log2": lambda x: torch.log2(x + 1),
    "sqrt": torch.sqrt, "rsqrt": lambda x: torch.rsqrt(x + 1), "sigmoid": torch.sigmoid,
}


@pytest.mark.parametrize("fn", list(_INT_FLOAT_FNS))
def test_float_function_of_int_expression(fn):
    f = _INT_FLOAT_FNS[fn]

    def decay(score, b, h, q_idx, kv_idx):
        return score + f((q_idx - kv_idx).abs().float())
    torch.manual_seed(21)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    check(q, k, v, decay)


_DOC_IDS = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(5))
_INT_TEMPORARIES = {
    "int_capture_load": lambda s, b, h, q, kv: s + torch.sigmoid(_DOC_IDS[kv].float()),
    "common_subexpression": lambda s, b, h, q, kv: s + torch.exp(-(q - kv).abs().float()) + (q - kv).abs() * 0.01,
    "constant_argument": lambda s, b, h, q, kv: s + torch.exp((q - q - 3).float()),
}


@pytest.mark.parametrize("form", list(_INT_TEMPORARIES))
def test_float_function_of_int_temporary(form):
    torch.manual_seed(21)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    check(q, k, v, _INT_TEMPORARIES[form])


def test_tanh_of_int_expression():
    torch.manual_seed(21)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    check(q, k, v, lambda s, b, h, qi, kv: s + torch.tanh((qi - kv).float() * 0.1))


@pytest.mark.parametrize("form", ["score", "int"])
def test_reciprocal_of_sum(form):
    if form == "score":
        def recip(score, b, h, q_idx, kv_idx):
            return 1 / (score.abs() + 1)
    else:
        def recip(score, b, h, q_idx, kv_idx):
            return score + 1 / (kv_idx + 1)
    torch.manual_seed(22)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    check(q, k, v, recip)


@pytest.mark.parametrize("power", ["float_3", "int_5", "int_base_5"])
def test_power_of_negative_base(power):
    mods = {
        "float_3": lambda s, b, h, q, kv: s ** 3.0,
        "int_5": lambda s, b, h, q, kv: s ** 5,
        "int_base_5": lambda s, b, h, q, kv: s + ((q - kv) ** 5).float() * 1e-7,
    }
    torch.manual_seed(23)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    # scores up to ~700: lse is checked relative to its size (fp32 spacing there is 6e-5)
    check(q, k, v, mods[power], lse_tol=1e-6 * 700)


def test_div_rounding_mode_floor():
    def block(b, h, q_idx, kv_idx):
        return torch.div(q_idx, 4, rounding_mode="floor") == torch.div(kv_idx, 4, rounding_mode="floor")
    torch.manual_seed(24)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    check(q, k, v, None, block)


def test_div_rounding_mode_trunc_message():
    with pytest.raises(attncc.AttnccError, match="is not supported in a mod"):
        attncc.Variant(lambda s, b, h, q, kv: torch.div(s, 2, rounding_mode="trunc"))




@pytest.mark.parametrize("form", ["row_condition_constant_branch", "row_invariant_else_branch"])
def test_where_with_row_invariant_branch(form):
    mods = {
        "row_condition_constant_branch": lambda score, b, h, q_idx, kv_idx:
            torch.where(q_idx % 2 == 1, float("-inf"), score),
        "row_invariant_else_branch": lambda score, b, h, q_idx, kv_idx:
            torch.where(q_idx >= kv_idx, score, -1e4 * (q_idx + 1)),
    }
    torch.manual_seed(25)
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    check(q, k, v, mods[form])


def test_load_mixing_scalar_and_tile_index():
    """A capture indexed by a program scalar (h) and a tile index (q_idx): the interpreter used
    to reject the load mask ('mask has unsupported dtype'); a regression test since 9f80927."""
    table = torch.randn(H, LQ)

    def head_row_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx]
    torch.manual_seed(26)
    q, k, v = randn_qkv(1, H, H, LQ, LKV, 16)
    check(q, k, v, head_row_bias)


# ----------------------------------------------------------------------------------------------
# Position arithmetic in float context (printer.float_positions) and biases in log2 units


def test_float_positions_rewrites_only_position_sums_used_as_floats():
    import sympy as sp

    from attncc.passes.symbolic import H, KV, Q, SCORE
    from attncc.printer import KVF, QF, float_positions
    cap = sp.Function("cap0")
    assert float_positions(cap(H) * (KV - Q)) == cap(H) * (KVF - QF)  # ALiBi's distance
    assert float_positions(KV - Q) == KVF - QF  # a derivative used as a float factor
    assert float_positions(sp.Float(0.5) * sp.log(sp.Abs(KV - Q) + 1)) == sp.Float(0.5) * sp.log(sp.Abs(KVF - QF) + 1)
    assert float_positions(sp.Max(0, KV - Q)) == sp.Max(0, KVF - QF)
    # integer context stays integer: a capture's index, floor semantics, products of positions
    for kept in (sp.Float(2.0) * cap(KV - Q), sp.Float(1.5) * sp.Mod(KV - Q, 7), KV * Q, sp.tanh(SCORE / 30)):
        assert float_positions(kept) == kept
    # a Piecewise keeps its integer conditions
    assert float_positions(sp.Piecewise((KV - Q, Q > KV), (0.5, True))) == sp.Piecewise((KVF - QF, Q > KV), (0.5, True))


def test_alibi_bias_runs_in_log2_units_and_a_gathered_table_keeps_score_mod():
    kernel = attncc.compile(variant_of("alibi"))
    for kind in ("bwd", "kv"):  # the backward and decode kernels take the log2 form
        alibi = kernel.source(kind, dtype=torch.float16, head_dim=64)
        assert "+ bias  # score_mod = score + bias, in log2 units" in alibi and "score = qk" not in alibi
        assert "(kv_idx_f - q_idx_f)" in alibi
    fwd = kernel.source("fwd", dtype=torch.float16, head_dim=64)  # keeps the score_mod form (plan.build)
    assert "score_mod = cap0_0*(kv_idx - q_idx) + score" in fwd and "s = score_mod * 1.4426950408889634" in fwd
    assert "+ bias" not in fwd and "q_idx_f" not in fwd and "kv_idx_f" not in fwd
    rel = attncc.compile(variant_of("rel_bias")).source("bwd", dtype=torch.float16, head_dim=64)
    assert "s = score_mod * 1.4426950408889634" in rel and "qk_scale + bias" not in rel
