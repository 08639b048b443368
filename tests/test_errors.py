"""Every bad input raises AttnccError (ModTraceError for untraceable Python in a mod,
NotImplementedError where a feature is refused) with a message that names the problem."""
from __future__ import annotations

import pytest
import torch

import attncc
from attncc import ir
from conftest import randn_qkv


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
        return torch.sin(score)
    with pytest.raises(attncc.AttnccError) as info:
        attncc.Variant(wavy)
    msg = str(info.value)
    assert "wavy calls torch function `sin`" in msg and "torch.sin(score)" in msg
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
