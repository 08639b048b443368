"""Every bad input raises AttnccError (ModTraceError for untraceable Python in a mod,
NotImplementedError where a feature is refused) with a message that names the problem."""
from __future__ import annotations

import zlib

import pytest
import torch

import attncc
from attncc import ir
from conftest import check, randn_qkv


def qkv(B=1, Hq=2, Hkv=2, Lq=8, Lkv=8, D=16, Dv=None, dtype=torch.float32):
    return randn_qkv(B, Hq, Hkv, Lq, Lkv, D, Dv, dtype=dtype)


def test_error_types():
    assert issubclass(attncc.ModTraceError, attncc.AttnccError)
    assert issubclass(attncc.AttnccError, ValueError)


# ----------------------------------------------------------------------------------------------
# Shapes, dtypes, devices


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_wrong_rank(which):
    args = dict(zip(("query", "key", "value"), qkv()))
    args[which] = args[which][0]
    with pytest.raises(attncc.AttnccError, match=rf"{which} must be 4-D .*got shape \(2, 8, 16\).*transpose\(1, 2\)"):
        attncc.attention(args["query"], args["key"], args["value"])


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(attncc.AttnccError, match="key must be a torch.Tensor, got list"):
        attncc.attention(q, [1.0], v)


def test_mismatched_batch():
    q, _, _ = qkv(B=2)
    _, k, v = qkv(B=3)
    with pytest.raises(attncc.AttnccError, match="batch sizes differ: query 2, key 3, value 3"):
        attncc.attention(q, k, v)


def test_mismatched_query_key_head_dims():
    q, _, _ = qkv(D=16)
    _, k, v = qkv(D=32)
    with pytest.raises(attncc.AttnccError, match=r"query and key head dims differ \(16 vs 32\)"):
        attncc.attention(q, k, v)


def test_key_value_heads_and_lengths_must_match():
    q, k, v = qkv()
    with pytest.raises(attncc.AttnccError, match="same number of heads, got 2 and 1"):
        attncc.attention(q, k, v[:, :1])
    with pytest.raises(attncc.AttnccError, match="same sequence length, got 8 and 5"):
        attncc.attention(q, k, v[:, :, :5])


def test_kv_heads_must_divide_query_heads():
    q, k, v = qkv(Hq=6, Hkv=4)
    with pytest.raises(attncc.AttnccError, match=r"query heads \(6\) must be a multiple of key/value heads \(4\)"):
        attncc.attention(q, k, v, enable_gqa=True)


def test_gqa_needs_enable_gqa():
    q, k, v = qkv(Hq=4, Hkv=2)
    with pytest.raises(attncc.AttnccError, match=r"query has 4 heads but key/value have 2; pass enable_gqa=True"):
        attncc.attention(q, k, v)
    kernel = attncc.compile(attncc.Variant())
    with pytest.raises(attncc.AttnccError, match="enable_gqa"):
        kernel(q, k, v)


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(attncc.AttnccError, match="must share one dtype, got torch.float16, torch.float32"):
        attncc.attention(q.half(), k, v)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64])
def test_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    with pytest.raises(attncc.AttnccError, match=rf"query has dtype {dtype}; attncc kernels support float16, bfloat16 and float32"):
        attncc.attention(q, k, v)


def test_source_with_unsupported_dtype_or_kernel():
    kernel = attncc.compile(attncc.Variant())
    with pytest.raises(attncc.AttnccError, match="unsupported dtype torch.float64"):
        kernel.source("fwd", dtype=torch.float64)
    with pytest.raises(attncc.AttnccError, match="unknown kernel 'nope'"):
        kernel.source("nope")


@pytest.mark.parametrize("which,D,Dv", [("query/key", 264, 64), ("value", 64, 300)])
def test_head_dim_above_256(which, D, Dv):
    q, k, v = qkv(Lq=4, Lkv=4, D=D, Dv=Dv)
    with pytest.raises(attncc.AttnccError, match=rf"{which} head dim \d+ is outside the supported range 1..256"):
        attncc.attention(q, k, v)


def test_captured_tensor_on_another_device():
    try:
        slopes = torch.ones(2, device="meta")
    except Exception as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"cannot make a meta tensor: {e}")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    q, k, v = qkv()
    with pytest.raises(attncc.AttnccError, match=r"captured tensor slopes\[2 float32\] is on meta but the inputs are on cpu"):
        attncc.attention(q, k, v, alibi)


def test_inputs_on_unsupported_device():
    q, k, v = (t.to("meta") for t in qkv())
    with pytest.raises(attncc.AttnccError, match="not on meta tensors"):
        attncc.attention(q, k, v)


def test_compile_takes_a_variant():
    with pytest.raises(attncc.AttnccError, match="attncc.compile takes an attncc.Variant, got function"):
        attncc.compile(lambda score, b, h, q_idx, kv_idx: score)


# ----------------------------------------------------------------------------------------------
# Untraceable Python in mods


def test_python_if_on_traced_value():
    def branchy_score(score, b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return score
        return score * 0.5
    with pytest.raises(attncc.ModTraceError) as info:
        attncc.Variant(branchy_score)
    msg = str(info.value)
    assert "branchy_score" in msg
    assert "if q_idx > kv_idx:" in msg and "test_errors.py:" in msg
    assert "torch.where" in msg


def test_python_ternary_on_traced_value():
    with pytest.raises(attncc.ModTraceError, match=r"(?s)uses `if`.*torch\.where"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score if q_idx > kv_idx else 0.0)


@pytest.mark.parametrize("op", ["and", "or", "not"])
def test_and_or_not_on_traced_values(op):
    mods = {
        "and": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx and kv_idx > 2,
        "or": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx or kv_idx > 2,
        "not": lambda b, h, q_idx, kv_idx: not (q_idx >= kv_idx),
    }
    with pytest.raises(attncc.ModTraceError) as info:
        attncc.Variant(mask_mod=mods[op])
    msg = str(info.value)
    assert f" {op} " in msg or f"`{op}`" in msg
    assert "`&` and `|` instead of `and`/`or`" in msg and "`~` instead of `not`" in msg


def test_loop_over_range_of_traced_value():
    def window_sum(b, h, q_idx, kv_idx):
        hits = 0
        for i in range(q_idx):
            hits = hits + (kv_idx == i)
        return hits > 0
    with pytest.raises(attncc.ModTraceError, match=r"window_sum uses a Python index, range\(\) or int\(\).*for i in range\(q_idx\)"):
        attncc.Variant(mask_mod=window_sum)


def test_iteration_over_traced_value():
    with pytest.raises(attncc.ModTraceError, match="uses iteration on a traced value"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: any(x for x in q_idx))


@pytest.mark.parametrize("conv", [int, float, len])
def test_python_conversions_of_traced_value(conv):
    with pytest.raises(attncc.ModTraceError, match="on a traced value"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + conv(q_idx))


def test_score_mod_with_wrong_arity():
    with pytest.raises(attncc.AttnccError, match=r"score_mod three_args must take 5 positional arguments "
                                                 r"\(score, b, h, q_idx, kv_idx\).*\(score, b, h\)"):
        def three_args(score, b, h):
            return score
        attncc.Variant(three_args)


def test_mask_mod_with_wrong_arity():
    def five_args(score, b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    with pytest.raises(attncc.AttnccError, match=r"mask_mod five_args must take 4 positional arguments \(b, h, q_idx, kv_idx\)"):
        attncc.Variant(mask_mod=five_args)


def test_score_mod_returning_a_bool():
    with pytest.raises(attncc.AttnccError, match="score_mod returned a bool; did you mean to pass it as mask_mod"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: q_idx >= kv_idx)
    with pytest.raises(attncc.AttnccError, match="score_mod must return a number"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score > 0)


@pytest.mark.parametrize("result", ["float", "int"])
def test_mask_mod_returning_a_number(result):
    mods = {"float": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) * 1.0,
            "int": lambda b, h, q_idx, kv_idx: q_idx - kv_idx}
    with pytest.raises(attncc.AttnccError, match=rf"mask_mod must return a bool \(True = attend\), got {result}"):
        attncc.Variant(mask_mod=mods[result])




@pytest.mark.parametrize("kind", ["score_mod", "mask_mod"])
def test_mod_returning_none(kind):
    def forgot_return(*args):
        args[-1] >= args[-2]
    with pytest.raises(attncc.AttnccError, match=rf"{kind} \S*forgot_return returned None; did you forget `return`"):
        attncc.Variant(**{kind: forgot_return})


def test_mod_returning_a_tensor():
    with pytest.raises(attncc.AttnccError, match=r"returned a tensor of shape \(3,\); it must return a scalar"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: torch.ones(3))


def test_mod_that_is_not_callable():
    with pytest.raises(attncc.AttnccError, match="score_mod must be a function or an attncc.ir expression, got str"):
        attncc.Variant("score * 2")


def test_unsupported_torch_function():
    def wavy(score, b, h, q_idx, kv_idx):
        return torch.lgamma(score)
    with pytest.raises(attncc.AttnccError) as info:
        attncc.Variant(wavy)
    msg = str(info.value)
    assert "wavy calls torch function `lgamma`" in msg and "torch.lgamma(score)" in msg
    assert "Supported:" in msg and "exp" in msg and "tanh" in msg and "where" in msg


def test_unsupported_tensor_attribute():
    with pytest.raises(attncc.AttnccError, match=r"reads `\.shape` of a traced value.*Supported:"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score * score.shape[0])


@pytest.mark.parametrize("order", ["tensor_right", "tensor_left"])
def test_whole_captured_tensor_without_indexing(order):
    bias = torch.randn(8)
    mods = {"tensor_right": lambda score, b, h, q_idx, kv_idx: score + bias,
            "tensor_left": lambda score, b, h, q_idx, kv_idx: bias * score}
    with pytest.raises(attncc.AttnccError, match=r"uses a captured tensor of shape \(8,\) as a whole.*index it"):
        attncc.Variant(mods[order])


@pytest.mark.parametrize("index", ["slice", "ellipsis", "none"])
def test_slicing_a_captured_tensor(index):
    table = torch.randn(4, 8)
    mods = {"slice": lambda score, b, h, q_idx, kv_idx: score + table[:, kv_idx],
            "ellipsis": lambda score, b, h, q_idx, kv_idx: score + table[h, ...],
            "none": lambda score, b, h, q_idx, kv_idx: score + table[h, None]}
    with pytest.raises(attncc.AttnccError, match="slices a captured tensor.*one integer expression per dimension"):
        attncc.Variant(mods[index])


def test_too_many_or_too_few_indices():
    table = torch.randn(4, 8)
    with pytest.raises(attncc.AttnccError, match="indexes a 2-d captured tensor with 3 indices"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx, kv_idx])
    with pytest.raises(attncc.AttnccError, match=r"shape \(4, 8\) used with only 1 of its 2 dimensions indexed"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + table[h])


@pytest.mark.parametrize("index", ["true_division", "score"])
def test_indexing_with_a_float_expression(index):
    bias = torch.randn(64)
    mods = {"true_division": lambda score, b, h, q_idx, kv_idx: score + bias[q_idx / 2],
            "score": lambda score, b, h, q_idx, kv_idx: score + bias[score]}
    with pytest.raises(attncc.AttnccError, match="a captured tensor index must be an integer expression, got float.*// "):
        attncc.Variant(mods[index])


def test_indexing_a_traced_scalar():
    with pytest.raises(attncc.AttnccError, match="indexes a traced scalar"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score[0])


def test_constants_the_kernels_cannot_hold():
    with pytest.raises(attncc.AttnccError, match="NaN constant"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + float("nan"))
    with pytest.raises(attncc.AttnccError, match="does not fit in int32"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx < 2 ** 40)
    with pytest.raises(attncc.AttnccError, match="cannot use a value of type str|uses a value of type str"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + "1")


def test_bool_arithmetic_that_has_no_meaning():
    with pytest.raises(attncc.AttnccError, match="'neg' is not defined on bool values"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: -(q_idx >= kv_idx))
    with pytest.raises(attncc.AttnccError, match=r"needs bool or int operands, got float"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score & 1)


def test_where_needs_a_bool_condition():
    with pytest.raises(attncc.AttnccError, match="condition of where\\(\\) must be bool, got int"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: torch.where(q_idx - kv_idx, score, 0.0))


# ----------------------------------------------------------------------------------------------
# IR written directly goes through the same verifier



def test_ir_mask_mod_returning_int_is_rejected():
    with pytest.raises(attncc.AttnccError, match="mask_mod must return a bool"):
        attncc.Variant(mask_mod=ir.q_idx - ir.kv_idx)


def test_ir_score_mod_returning_bool_is_rejected():
    with pytest.raises(attncc.AttnccError, match="score_mod returned a bool"):
        attncc.Variant(score_mod=ir.q_idx >= ir.kv_idx)


def test_ir_mask_mod_reading_the_score_is_rejected():
    with pytest.raises(attncc.AttnccError, match="mask_mod cannot read the score"):
        attncc.Variant(mask_mod=ir.score > 0)


def test_ir_int_score_mod_has_the_traced_key():
    written = attncc.Variant(ir.q_idx - ir.kv_idx)
    traced = attncc.Variant(lambda score, b, h, q_idx, kv_idx: q_idx - kv_idx)
    assert written.ir_key == traced.ir_key


def test_ir_constructors_check_types():
    with pytest.raises(attncc.AttnccError, match="index must be an integer expression, got float"):
        ir.load(torch.randn(4), ir.score)
    with pytest.raises(attncc.AttnccError, match=r"indexed with 1 indices; index every dimension"):
        ir.load(torch.randn(4, 4), ir.h)
    with pytest.raises(attncc.AttnccError, match="condition of where\\(\\) must be bool"):
        ir.where(ir.score, 1.0, 0.0)


# ----------------------------------------------------------------------------------------------
# Arguments


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_scale(scale):
    with pytest.raises(attncc.AttnccError, match=r"scale must be a finite Python number \(or None for 1/sqrt\(head_dim\)\)"):
        attncc.Variant(scale=scale)
    q, k, v = qkv()
    with pytest.raises(attncc.AttnccError, match="scale must be a finite Python number"):
        attncc.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [torch.tensor(0.5), True, "0.5"])
def test_scale_of_wrong_type(scale):
    with pytest.raises(attncc.AttnccError, match="scale must be a finite Python number"):
        attncc.Variant(scale=scale)


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, float("nan"), "0.1"])
def test_dropout_outside_unit_interval(p):
    with pytest.raises(attncc.AttnccError, match=r"dropout_p must be a number in \[0, 1\)"):
        attncc.Variant(dropout_p=p)
    q, k, v = qkv()
    with pytest.raises(attncc.AttnccError, match=r"dropout_p must be a number in \[0, 1\)"):
        attncc.attention(q, k, v, dropout_p=p)


def test_reference_dropout_needs_the_mask():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_mask"):
        attncc.reference.attention(q, k, v, dropout_p=0.1)


# ----------------------------------------------------------------------------------------------
# What a mod returns, and Python a mod cannot use


@pytest.mark.parametrize("result,shown", [("abc", r"a str \('abc'\)"), ((1.0, 2.0), r"a tuple \(\(1.0, 2.0\)\) \(return one value"),
                                          ([1.0], r"a list \(\[1.0\]\) \(return one value"),
                                          (1j, r"a complex \(1j\)")])
def test_mod_returning_a_value_of_the_wrong_type(result, shown):
    def wrong_type(score, b, h, q_idx, kv_idx):
        return result
    with pytest.raises(attncc.AttnccError, match=rf"score_mod \S*wrong_type returned {shown}.*it must return the modified "
                                                 r"score \(e\.g\. score \+ bias\[h\]\)"):
        attncc.Variant(wrong_type)


def test_mod_returning_a_numpy_array():
    np = pytest.importorskip("numpy")
    with pytest.raises(attncc.AttnccError, match=r"mask_mod \S+ returned a ndarray .*a bool expression \(e\.g\. q_idx >= kv_idx\)"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: np.ones(3, dtype=bool))


def test_mod_returning_a_constant_is_fine():
    assert attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: True).mask_ir == ir.const(True)
    assert attncc.Variant(lambda score, b, h, q_idx, kv_idx: 2).score_ir == ir.cast(2, ir.FLOAT)


def test_mask_mod_returning_an_int_says_how_to_convert():
    with pytest.raises(attncc.AttnccError, match=r"got int; compare it \(`x != 0`\) or convert it with \.bool\(\)"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx).int())


def test_mask_mod_returning_a_float_points_to_score_mod():
    with pytest.raises(attncc.AttnccError, match=r"got float; a mod that computes scores is a score_mod \(pass it as score_mod=\)"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, 0.0, float("-inf")))


def test_math_functions_on_traced_values():
    import math

    def with_math(score, b, h, q_idx, kv_idx):
        return score * math.exp(-q_idx)
    with pytest.raises(attncc.ModTraceError, match=r"(?s)with_math uses float\(\) or a `math` function on a traced value at "
                                                   r".*math\.exp\(-q_idx\).*use the torch functions \(torch\.exp"):
        attncc.Variant(with_math)


def test_round_and_python_max_on_traced_values():
    with pytest.raises(attncc.ModTraceError, match=r"(?s)uses round\(\).*torch\.floor\(x \+ 0\.5\)"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + round(score))
    with pytest.raises(attncc.ModTraceError, match=r"(?s)max\(score, 0\.0\).*torch\.maximum / torch\.minimum instead of max\(\) / min\(\)"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: max(score, 0.0))


def test_numpy_functions_on_traced_values():
    np = pytest.importorskip("numpy")
    with pytest.raises(attncc.AttnccError, match=r"passes a traced value to NumPy at .*np\.exp\(score\).*use the torch function"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: np.exp(score))


def test_ir_errors_inside_a_mod_name_the_mod_and_line():
    bias = torch.randn(16)

    def half_index(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx / 2]
    with pytest.raises(attncc.AttnccError) as info:
        attncc.Variant(half_index)
    msg = str(info.value)
    assert msg.startswith("a captured tensor index must be an integer expression, got float")
    assert "in test_ir_errors_inside_a_mod_name_the_mod_and_line.<locals>.half_index at " in msg
    assert "return score + bias[q_idx / 2]" in msg


@pytest.mark.parametrize("mod,text", [
    (lambda score, b, h, q_idx, kv_idx: score / 0, r"score / 0 divides by zero"),
    (lambda score, b, h, q_idx, kv_idx: score + q_idx // 0, r"q_idx // 0 divides by zero"),
    (lambda score, b, h, q_idx, kv_idx: score + q_idx % 0, r"q_idx % 0 divides by zero"),
    (lambda score, b, h, q_idx, kv_idx: score + 1 / (q_idx - q_idx), r"score_mod divides by an expression that is always 0"),
    (lambda score, b, h, q_idx, kv_idx: score + q_idx // (kv_idx - kv_idx), r"divides by an expression that is always 0"),
])
def test_division_by_zero(mod, text):
    """Caught before codegen: sympy would turn it into zoo, which no kernel can hold."""
    with pytest.raises(attncc.AttnccError, match=text):
        attncc.Variant(mod).analysis


# ----------------------------------------------------------------------------------------------
# Captured tensors: dtypes, layouts


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2])
def test_capture_dtypes_the_kernels_cannot_read(dtype):
    table = torch.zeros(8).to(dtype)
    with pytest.raises(attncc.AttnccError, match=rf"captured tensor of shape \(8,\) has dtype {dtype}, which the kernels "
                                                 r"cannot read; supported: bool, int8/16/32/64, uint8/16, float16, "
                                                 r"bfloat16, float32, float64\. Convert it first"):
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + table[kv_idx].float())


def test_captures_of_other_dtypes_than_the_inputs_are_read_and_converted():
    """A float64 bias for float16 inputs, an int16 table and a uint8 mask: read and converted in
    the kernel (float32 / int32 / bool), equal to the reference."""
    torch.manual_seed(3)
    bias = torch.randn(12, dtype=torch.float64)
    shift = torch.randint(0, 3, (2,), dtype=torch.int16)
    allowed = (torch.rand(12, 12) > 0.2).to(torch.uint8)
    allowed.fill_diagonal_(1)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx] * (shift[h] + 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[q_idx, kv_idx] != 0
    q, k, v = randn_qkv(1, 2, 2, 12, 12, 16, dtype=torch.float16)
    check(q, k, v, score_mod, mask_mod)


def test_sparse_capture():
    from attncc import checks
    table = torch.eye(4).to_sparse()
    variant = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + table[q_idx, kv_idx])
    with pytest.raises(attncc.AttnccError, match=r"has layout torch.sparse_coo; .*capture t\.to_dense\(\) instead"):
        checks.check_captures(variant.captures, torch.device("cpu"))
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(attncc.AttnccError, match=r"has layout torch.sparse_coo"):  # and on the call path
        attncc.compile(variant)(q, q, q)


def test_triton_failures_on_generated_code_name_the_file():
    """Triton rejecting generated code is attncc's bug: a RuntimeError names the kernel file (the
    Triton error is chained, for the report); out-of-resources errors pass through unchanged."""
    import types

    from attncc import runtime
    runtime.target_for(torch.device("cpu"))  # attncc imports triton first: CPU tensors need its interpreter
    from triton.runtime.errors import InterpreterError, OutOfResources

    def module(err):
        m = types.ModuleType("attncc_generated.fwd_broken_interp")
        m.__file__ = "/cache/fwd_broken.py"

        def launch(*args, **kwargs):
            raise err
        m.launch = launch
        return m
    with pytest.raises(RuntimeError, match=r"Triton could not run the generated kernel file /cache/fwd_broken\.py "
                                           r"\(InterpreterError: .*name 'zoo' is not defined.*\)\. This is a bug in attncc") as info:
        runtime.launch(module(InterpreterError(repr(NameError("name 'zoo' is not defined")))))
    assert isinstance(info.value.__cause__, InterpreterError)
    with pytest.raises(OutOfResources):
        runtime.launch(module(OutOfResources(232448, 101376, "shared memory")))


def test_out_of_resources_shrinks_tiles_even_where_they_fitted_before(monkeypatch):
    """attncc.autograd.with_fallback: tiles too large for the GPU's shared memory are regenerated
    smaller, up to four levels. Variants of one structure share a kernel source whose Triton
    compile depends on the captured tensors' dtypes: float32 rows where bfloat16 ones fitted ran
    out of shared memory on an H100 and reached the user, since the level that had fitted was
    launched without the fallback."""
    import types

    from attncc import autograd
    from attncc.spec import Spec

    class OutOfResources(Exception):  # matched by name, as Triton's (imported lazily)
        pass
    compiled = types.SimpleNamespace(variant=types.SimpleNamespace(ir_key="rows"), module=lambda kernel, spec: spec)
    monkeypatch.setattr(autograd, "_fitted", {})
    spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90")
    need = {"level": 0}

    def run(module):
        if module.shrink < need["level"]:
            raise OutOfResources("out of resource: shared memory, Required: 328704, Hardware limit: 232448")
        return module.shrink
    assert autograd.with_fallback(compiled, "fwd", spec, run, None, None) == 0
    need["level"] = 2  # the wider captures
    assert autograd.with_fallback(compiled, "fwd", spec, run, None, None) == 2
    assert autograd.with_fallback(compiled, "fwd", spec, run, None, None) == 2  # remembered
    need["level"] = 5
    with pytest.raises(OutOfResources):
        autograd.with_fallback(compiled, "fwd", spec, run, None, None)


# ----------------------------------------------------------------------------------------------
# Captured tensors too small for their indices (attncc.checks.check_capture_indices)


def check_indices(mod, B=2, Hq=8, Lq=16, Lkv=20, mask=False):
    from attncc import checks
    variant = attncc.Variant(**{"mask_mod" if mask else "score_mod": mod})
    q, k, _ = randn_qkv(B, Hq, Hq, Lq, Lkv, 16)
    checks.check_capture_indices(variant, q, k)
    return variant


@pytest.mark.parametrize("leaf,size,runs", [("b", 1, "0..1"), ("h", 4, "0..7"), ("q_idx", 10, "0..15"),
                                            ("kv_idx", 16, "0..19")])
def test_capture_too_small_for_a_plain_index(leaf, size, runs):
    table = torch.randn(size)
    mods = {"b": lambda score, b, h, q_idx, kv_idx: score + table[b],
            "h": lambda score, b, h, q_idx, kv_idx: score + table[h],
            "q_idx": lambda score, b, h, q_idx, kv_idx: score + table[q_idx],
            "kv_idx": lambda score, b, h, q_idx, kv_idx: score + table[kv_idx]}
    hi = int(runs.split("..")[1])
    with pytest.raises(attncc.AttnccError, match=(
            rf"captured tensor `table` of shape \({size},\) is too small for its index `{leaf}` in dimension 0: "
            rf"{leaf} runs over {runs} in this call \(B=2, Hq=8, Lq=16, Lkv=20\), but the dimension has {size} "
            rf"entries\. Give it {hi + 1} entries, one per {leaf}, or bound the index \(e\.g\. "
            rf"torch\.clamp\({leaf}, max={size - 1}\)\)")):
        check_indices(mods[leaf])
    table = torch.randn(hi + 1)
    check_indices(mods[leaf])  # large enough


def test_capture_too_small_in_a_later_dimension_of_a_mask():
    doc_pairs = torch.ones(16, 12, dtype=torch.bool)
    with pytest.raises(attncc.AttnccError, match=r"`doc_pairs` of shape \(16, 12\) is too small for its index `kv_idx` "
                                                 r"in dimension 1: kv_idx runs over 0..19"):
        check_indices(lambda b, h, q_idx, kv_idx: doc_pairs[q_idx, kv_idx], mask=True)


def test_capture_too_small_for_a_clamped_index():
    """Relative-position buckets: the mod bounds the index to [0, 2W], so the table needs 2W + 1 columns."""
    W = 4
    table = torch.randn(8, 2 * W)

    def clamped(score, b, h, q_idx, kv_idx):
        return score + table[h, torch.clamp(kv_idx - q_idx, -W, W) + W]
    with pytest.raises(attncc.AttnccError, match=r"`table` of shape \(8, 8\) is too small for its index `.*` in dimension 1: "
                                                 r"the index reaches 8 in this call .*has 8 entries \(0..7\)\. Give it at least 9"):
        check_indices(clamped)
    table = torch.randn(8, 2 * W + 1)
    check_indices(clamped)
    table = torch.randn(8, W + 1)
    check_indices(clamped, Lq=1, Lkv=1)  # the range at this call's lengths counts: only index W is read


def test_negative_clamped_index():
    W = 3
    table = torch.randn(2 * W + 1)
    with pytest.raises(attncc.AttnccError, match=r"the index goes down to -3 in this call .* attncc reads 0 at negative "
                                                 r"indices, where PyTorch indexing would wrap around to the end: add 3"):
        check_indices(lambda score, b, h, q_idx, kv_idx: score + table[torch.clamp(kv_idx - q_idx, -W, W)])


@pytest.mark.parametrize("index", ["mod", "and"])
def test_capture_too_small_for_a_modulo_index(index):
    period = torch.randn(10)
    mods = {"mod": lambda score, b, h, q_idx, kv_idx: score + period[kv_idx % 12],
            "and": lambda score, b, h, q_idx, kv_idx: score + period[kv_idx & 11]}
    with pytest.raises(attncc.AttnccError, match=r"the index reaches 11 in this call .*has 10 entries"):
        check_indices(mods[index])


def test_shifted_indices_read_zero_unless_asked(monkeypatch):
    """kv_idx - 5 reads 0 outside the tensor by design (padding); ATTNCC_INDEX_CHECK=all checks
    the upper end of such indices, never their lower end (often negative under a causal mask)."""
    bias = torch.randn(12)

    def shifted(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx - 5]
    check_indices(shifted)
    monkeypatch.setenv("ATTNCC_INDEX_CHECK", "all")
    with pytest.raises(attncc.AttnccError, match=r"the index reaches 14 in this call .*has 12 entries.*"
                                                 r"\(Shifted indices are checked because ATTNCC_INDEX_CHECK=all\.\)"):
        check_indices(shifted)
    bias = torch.randn(15)
    check_indices(shifted)  # reaches 14; the negative lower end is not an error


def test_index_check_off_and_unknown_modes(monkeypatch):
    slopes = torch.randn(2)
    alibi = lambda score, b, h, q_idx, kv_idx: score + slopes[h]  # noqa: E731
    monkeypatch.setenv("ATTNCC_INDEX_CHECK", "off")
    check_indices(alibi)
    monkeypatch.setenv("ATTNCC_INDEX_CHECK", "strict")
    with pytest.raises(attncc.AttnccError, match="ATTNCC_INDEX_CHECK='strict' is not one of plain, all, off"):
        check_indices(alibi)


def test_indices_not_checked():
    """Data-dependent indices (the values of a captured tensor), loads a torch.where branch may
    guard, and calls with an empty axis (nothing is read) are not checked."""
    doc_ids = torch.zeros(16, dtype=torch.long)
    per_doc = torch.randn(1)
    slopes = torch.randn(4)
    check_indices(lambda score, b, h, q_idx, kv_idx: score + per_doc[doc_ids[q_idx]])  # doc_ids[q_idx] itself fits
    check_indices(lambda score, b, h, q_idx, kv_idx: torch.where(h < 4, score * slopes[h], score))
    check_indices(lambda score, b, h, q_idx, kv_idx: score + slopes[h], Lq=0)


def test_index_check_is_cached_per_shape(monkeypatch):
    from attncc import checks
    slopes = torch.randn(8)
    variant = check_indices(lambda score, b, h, q_idx, kv_idx: score + slopes[h])
    assert [s.kind for s in variant.index_sites] == ["axis"]
    calls = []
    monkeypatch.setattr(checks, "interval", lambda *a: calls.append(a) or (0, 0))
    q, k, _ = randn_qkv(2, 8, 8, 16, 20, 16)
    checks.check_capture_indices(variant, q, k)
    assert calls == []  # these lengths and capture shapes passed before
    q, k, _ = randn_qkv(2, 8, 8, 17, 20, 16)
    checks.check_capture_indices(variant, q, k)
    assert len(calls) == 1


def test_index_check_with_ir_written_variant():
    slopes = torch.randn(4)
    from attncc import checks
    variant = attncc.Variant(ir.score + ir.load(slopes, ir.h))
    q, k, _ = randn_qkv(1, 6, 6, 4, 4, 16)
    with pytest.raises(attncc.AttnccError, match=r"captured tensor cap0 of shape \(4,\) is too small for its index `h`"):
        checks.check_capture_indices(variant, q, k)


def test_index_check_for_offset_positions():
    """check_index_ranges takes the positions directly (a KV cache's queries sit after its earlier tokens)."""
    from attncc import checks
    bias = torch.randn(64)
    variant = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + bias[q_idx])
    checks.check_index_ranges(variant, {"b": (0, 0), "h": (0, 3), "q_idx": (60, 63), "kv_idx": (0, 63)})
    with pytest.raises(attncc.AttnccError, match=r"q_idx runs over 60..64 in this call \(b in 0..0, h in 0..3, q_idx in 60..64"):
        checks.check_index_ranges(variant, {"b": (0, 0), "h": (0, 3), "q_idx": (60, 64), "kv_idx": (0, 64)})


def test_capture_too_small_through_attention():
    slopes = torch.randn(2)
    q, k, v = qkv(Hq=4, Hkv=4)
    with pytest.raises(attncc.AttnccError, match=r"`slopes` of shape \(2,\) is too small for its index `h`"):
        attncc.attention(q, k, v, lambda score, b, h, q_idx, kv_idx: score + slopes[h])


def test_division_by_zero_in_a_mask_mod():
    with pytest.raises(attncc.AttnccError, match=r"mask_mod divides by an expression that is always 0"):
        attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx % (kv_idx - kv_idx) == 0).analysis


def test_knobs_follow_the_environment(monkeypatch):
    """attncc.config reads per-call knobs from os.environ's bytes mapping: setenv, delenv and a
    bad value behave as with os.environ.get."""
    from attncc import config
    monkeypatch.delenv("ATTNCC_TMA", raising=False)
    assert config.tma() == "auto"
    monkeypatch.setenv("ATTNCC_TMA", "OFF")
    assert config.tma() == "off"
    monkeypatch.setenv("ATTNCC_AUTOTUNE", "1")
    assert config.autotune() is True
    monkeypatch.delenv("ATTNCC_AUTOTUNE")
    assert config.autotune() is False
    monkeypatch.setenv("ATTNCC_TMA", "sometimes")
    with pytest.raises(attncc.AttnccError, match="ATTNCC_TMA='sometimes' is not one of auto, on, off"):
        config.tma()


# ----------------------------------------------------------------------------------------------
# Hardening: sparse inputs, ATTNCC_TILES, undefined values, integer division by zero, NaN rows


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_sparse_inputs(which, layout):
    args = dict(zip(("query", "key", "value"), qkv()))
    args[which] = args[which].to_sparse() if layout == "sparse_coo" else args[which].to_sparse_csr()
    for fn in (attncc.attention, attncc.reference.attention):
        match = rf"{which} has layout torch.{layout}; .*pass {which}\.to_dense\(\)"
        with pytest.raises(attncc.AttnccError, match=match):
            fn(args["query"], args["key"], args["value"])


@pytest.mark.parametrize("value,shown", [
    ("{", r"is not valid JSON"),
    ("[128, 64, 8, 3]", r"is not a JSON object"),
    ('{"attn_fw": [128, 64, 8, 3]}', r"names 'attn_fw', which is not a kernel function; use attn_fwd, "),
    ('{"attn_fwd": [128, 64]}', r"attn_fwd has \[128, 64\]; give \[block_m, block_n, num_warps, num_stages\]"),
    ('{"attn_fwd": [48, 64, 4, 3]}', r"attn_fwd has \[48, 64, 4, 3\]; .*powers of two from 16"),
    ('{"attn_fwd": [128, 64, 8, 0]}', r"attn_fwd has \[128, 64, 8, 0\]"),
    ('{"attn_fwd": [128, 64, 8.0, 3]}', r"attn_fwd has \[128, 64, 8.0, 3\]"),
    ('{"attn_fwd": null}', r"attn_fwd has null"),
])
def test_malformed_tiles_knob(monkeypatch, value, shown):
    """ATTNCC_TILES is checked as the other knobs are: a bad value raises AttnccError naming the
    variable, the value and the expected form, on every call that generates a kernel (not a raw
    JSONDecodeError). The mask is this case's own, so no kernel of it is loaded yet."""
    q, k, v = qkv()
    monkeypatch.setenv("ATTNCC_TILES", value)
    shift = 1000 + zlib.crc32(value.encode()) % 1000
    for _ in range(2):
        with pytest.raises(attncc.AttnccError, match=r"ATTNCC_TILES=.*" + shown) as info:
            attncc.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx + shift >= kv_idx)
        assert repr(value) in str(info.value) and "[128, 64, 8, 3]" in str(info.value)


def test_tiles_knob_parses_valid_values(monkeypatch):
    from attncc import config
    monkeypatch.setenv("ATTNCC_TILES", '{"attn_fwd": [128, 64, 8, 3], "attn_bwd_dq": [64, 32, 4, 2]}')
    assert config.tile_overrides() == {"attn_fwd": (128, 64, 8, 3), "attn_bwd_dq": (64, 32, 4, 2)}
    monkeypatch.setenv("ATTNCC_TILES", "")
    assert config.tile_overrides() == {}


def test_infinity_times_zero_is_not_called_a_division():
    """inf * 0 is NaN for every score (in torch too): the message names the product and the fix."""
    inf = float("inf")
    with pytest.raises(attncc.AttnccError) as info:
        attncc.Variant(lambda score, b, h, q_idx, kv_idx: score - inf * (q_idx < 0).float()).analysis
    msg = str(info.value)
    assert msg.startswith("score_mod multiplies infinity by an expression that is always 0: "
                          "(inf * float((q_idx < 0)))")
    assert "inf * 0 is NaN" in msg and "torch.where(condition, float('-inf'), score)" in msg
    assert "divides" not in msg


def _int_div_mods():
    """% and // whose divisor kv_idx - q_idx is 0 on the diagonal."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.25 * (q_idx % (kv_idx - q_idx)).float() - 0.5 * (q_idx // (kv_idx - q_idx)).float()

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // (q_idx - kv_idx) <= 0) | (q_idx % (q_idx - kv_idx) == 0)
    return score_mod, mask_mod


def test_integer_division_by_zero_is_defined():
    """On integers x // 0 == 0 and x % 0 == x (Variant's docstring): the reference evaluates
    that (torch itself raises on CPU), and the kernels agree, forward and backward."""
    from attncc.reference import evaluate
    L = 12
    qi, ki = torch.arange(L).view(L, 1), torch.arange(L).view(1, L)
    env = {"q_idx": qi, "kv_idx": ki}
    mod = evaluate(ir.q_idx % (ir.kv_idx - ir.q_idx), env, torch.float64, "cpu")
    div = evaluate(ir.q_idx // (ir.kv_idx - ir.q_idx), env, torch.float64, "cpu")
    for i in range(L):
        for j in range(L):
            assert mod[i, j] == (i % (j - i) if j != i else i)
            assert div[i, j] == (i // (j - i) if j != i else 0)

    score_mod, mask_mod = _int_div_mods()
    torch.manual_seed(0)
    q, k, v = (t.requires_grad_() for t in randn_qkv(1, 2, 2, 40, 40, 16))
    out, _, _ = check(q, k, v, score_mod, mask_mod)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attncc.reference.attention(q64, k64, v64, score_mod, mask_mod)
    for got, want in zip((q.grad, k.grad, v.grad), torch.autograd.grad(ref, (q64, k64, v64), dout.double())):
        assert (got.double() - want).norm() / want.norm() < 1e-5

    # GPU kernels guard only divisors that may be 0 (a GPU's integer division by 0 is undefined)
    src = attncc.compile(attncc.Variant(score_mod, mask_mod)).source("fwd", dtype=torch.bfloat16, head_dim=64)
    assert "_floor_mod_or_a(q_idx, " in src and "_floor_div_or_0(q_idx, " in src
    src = attncc.compile(attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + (q_idx // 5 + kv_idx % 7))).source(
        "fwd", dtype=torch.bfloat16, head_dim=64)
    assert "_floor_div(q_idx, 5)" in src and "_floor_mod(kv_idx, 7)" in src
    assert "_floor_div_or_0(q_idx" not in src and "_floor_mod_or_a(kv_idx" not in src


def test_reference_keeps_nan_rows():
    """A NaN score gives a NaN row in the reference, as in the kernels and SDPA; a row with every
    key masked out still gives 0 and lse -inf (attncc's convention)."""
    torch.manual_seed(1)
    q, k, v = randn_qkv(1, 2, 2, 10, 10, 16)
    q[0, 1, 3, 5] = float("nan")
    mask = lambda b, h, q_idx, kv_idx: q_idx != 6  # noqa: E731
    ref, ref_lse = attncc.reference.attention(q.double(), k.double(), v.double(), None, mask, return_lse=True)
    assert torch.isnan(ref[0, 1, 3]).all() and torch.isnan(ref_lse[0, 1, 3])
    assert (ref[:, :, 6] == 0).all() and torch.isneginf(ref_lse[:, :, 6]).all()
    rest = torch.ones(10, dtype=torch.bool)
    rest[6] = False
    assert torch.isfinite(ref[0, 0, rest]).all() and torch.isfinite(ref[0, 1, rest & (torch.arange(10) != 3)]).all()

    out, lse = attncc.attention(q, k, v, mask_mod=mask, return_lse=True)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    finite = ~torch.isnan(ref)
    assert torch.allclose(out.double()[finite], ref[finite], atol=1e-5)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert torch.isnan(sdpa[0, 1, 3]).all()


@pytest.mark.parametrize("freed", ["table", "query", "value"])
def test_tensor_with_freed_storage_is_refused(freed):
    """A tensor whose storage was freed in place (as FSDP frees parameters between uses) keeps
    its shape and would be read at address 0: refused, naming the tensor; once its storage is
    back the same kernel runs and is right."""
    torch.manual_seed(2)
    table = torch.rand(2, 16)
    q, k, v = randn_qkv(1, 2, 2, 16, 16, 16)
    kernel = attncc.compile(attncc.Variant(lambda s, b, h, qi, ki: s + table[h, ki]))
    kernel(q, k, v)  # generated and run once with every storage in place
    tensor = {"table": table, "query": q, "value": v}[freed]
    saved = tensor.clone()
    tensor.untyped_storage().resize_(0)
    with pytest.raises(attncc.AttnccError, match=f"{'captured tensor `?table' if freed == 'table' else freed}.*no storage"):
        kernel(q, k, v)
    tensor.untyped_storage().resize_(saved.numel() * saved.element_size())
    tensor.copy_(saved)
    check(q, k, v, lambda s, b, h, qi, ki: s + table[h, ki], kernel=kernel)


def test_freed_storage_is_refused_by_the_inference_paths():
    """The decode kernel (few queries over many keys, no gradient) and with_kvcache check too;
    with_kvcache before it appends (the cache keeps its length)."""
    torch.manual_seed(3)
    table = torch.rand(2)
    kernel = attncc.compile(attncc.Variant(lambda s, b, h, qi, ki: s + table[h] * (ki - qi)))
    q, k, v = randn_qkv(1, 2, 2, 2, 300, 16)
    with torch.no_grad():
        kernel(q, k, v)
        table.untyped_storage().resize_(0)
        with pytest.raises(attncc.AttnccError, match="no storage"):
            kernel(q, k, v)
        table.untyped_storage().resize_(8)
        table.copy_(torch.rand(2))
        cache = attncc.KVCache(1, 64, 2, 16, dtype=torch.float32, device="cpu")
        new_k, new_v = torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
        new_v.untyped_storage().resize_(0)
        with pytest.raises(attncc.AttnccError, match="value.*no storage"):
            kernel.with_kvcache(torch.randn(1, 3, 2, 16), cache, new_k, new_v)
        assert cache.lengths() == [0]
