"""Property tests: random score_mods and mask_mods built from the supported operations, on random
small shapes, compiled and run (fp32, Triton interpreter) against the float64 reference.

A random mod is first drawn as a typed expression tree of nested tuples whose op names start
with i_ (int), b_ (bool) or f_ (float). The same tree becomes a Python mod (operators and torch
functions on the traced arguments, as a user writes them) and an attncc.ir expression; both go
through one evaluator that folds constant-only subtrees with Python semantics, so they must
give the same IR. Values stay bounded: float subtrees carry a bound and pass through tanh
before they could grow past 8, exp only sees clamped arguments, divisions are by non-zero
constants, and no comparison or floor reads a float (fp32 and fp64 could land on different
sides of a threshold). Captured-tensor indices always contain an index leaf (a constant index
would be Python indexing at trace time), and reads out of range give 0. Rows that a random mask
leaves empty must give out = 0 and lse = -inf.

Some forms are not generated here because they have their own regression tests in
test_trace.py (float functions of int temporaries, 1 / (sum), high powers, .long() of
quotients, // of sums, where() with a branch that does not vary along kv_idx).
"""
from __future__ import annotations

import math
import operator

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attncc
from attncc import ir
from conftest import check

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

MAX_L = 70
HEAD_CAP = 4  # per-head captured tensors; heads beyond read 0
POS_CAP = 80  # per-position captured tensors
FLOAT_BOUND = 8.0


class Captures:
    """The tensors random mods may read, made from one seed."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.bias_kv = torch.randn(POS_CAP, generator=g)
        self.bias_q = torch.randn(POS_CAP, generator=g)
        self.slopes = torch.rand(HEAD_CAP, generator=g)
        self.pair = torch.randn(POS_CAP, POS_CAP, generator=g)
        self.head_row = torch.randn(HEAD_CAP, POS_CAP, generator=g)
        self.doc = torch.sort(torch.randint(0, 4, (POS_CAP,), generator=g)).values
        self.allowed = torch.rand(POS_CAP, POS_CAP, generator=g) > 0.3


# ----------------------------------------------------------------------------------------------
# Strategies for typed trees

INT_LEAVES = ["q_idx", "kv_idx", "h", "b"]
ints = st.integers


def _index_tree(sub):
    """An index: always reads a leaf, so it is traced (never Python indexing)."""
    return st.tuples(st.just("i_add"), st.sampled_from(INT_LEAVES).map(lambda n: ("i_leaf", n)), sub)


def _kv_plus(sub):
    return st.tuples(st.just("i_add"), st.just(("i_leaf", "kv_idx")), sub)


def _score_plus(sub):
    return st.tuples(st.just("f_add"), st.just(("f_score",)), sub)


def int_trees(depth: int):
    base = st.one_of(st.sampled_from(INT_LEAVES).map(lambda n: ("i_leaf", n)), ints(-6, 6).map(lambda k: ("i_const", k)))
    if depth == 0:
        return base
    sub = int_trees(depth - 1)
    const = lambda lo, hi: ints(lo, hi).map(lambda k: ("i_const", k))  # noqa: E731
    return st.one_of(
        base,
        st.tuples(st.sampled_from(["i_add", "i_sub"]), sub, sub),
        st.tuples(st.just("i_mul"), sub, const(-3, 3)),
        st.tuples(st.just("i_floordiv"), st.tuples(st.just("i_add"), st.sampled_from(INT_LEAVES).map(
            lambda n: ("i_leaf", n)), const(0, 5)), const(1, 5)),
        st.tuples(st.just("i_mod"), sub, st.sampled_from([2, 3, 5, -3]).map(lambda k: ("i_const", k))),
        st.tuples(st.just("i_abs"), sub),
        st.tuples(st.sampled_from(["i_minimum", "i_maximum"]), sub, sub),
        # where() whose else-branch does not read kv_idx hits a known bug (test_trace.py::test_where_with_
        # row_invariant_branch): here the condition and the else-branch always read kv_idx
        st.tuples(st.just("i_where"), st.tuples(st.sampled_from(["b_lt", "b_ne", "b_ge"]), _kv_plus(sub), sub),
                  sub, _kv_plus(sub)),
        st.tuples(st.sampled_from(["i_bitand", "i_bitor"]), sub, const(1, 7)),
        st.tuples(st.just("i_load_doc"), _index_tree(sub)),
    )


def bool_trees(depth: int):
    leaf_ints = int_trees(max(depth - 1, 0))
    cmp = st.tuples(st.sampled_from(["b_lt", "b_le", "b_gt", "b_ge", "b_eq", "b_ne"]), leaf_ints, leaf_ints)
    allowed = st.tuples(st.just("b_load_allowed"), _index_tree(int_trees(0)), _index_tree(int_trees(0)))
    if depth == 0:
        return st.one_of(cmp, allowed)
    sub = bool_trees(depth - 1)
    return st.one_of(cmp, allowed, st.tuples(st.sampled_from(["b_and", "b_or", "b_xor"]), sub, sub),
                     st.tuples(st.just("b_not"), sub))


# float functions of int-valued expressions (sympy drops the .float(): the printer must convert)
_INT_FNS_TORCH = {
    "sigmoid": lambda x: torch.sigmoid(x.float()),
    "exp_neg_abs": lambda x: torch.exp(-torch.abs(x).float()),
    "sqrt_abs": lambda x: torch.sqrt(torch.abs(x).float()),
    "log1_abs": lambda x: torch.log(torch.abs(x).float() + 1.0),
}
_INT_FNS_IR = {
    "sigmoid": lambda x: ir.sigmoid(ir.cast(x, ir.FLOAT)),
    "exp_neg_abs": lambda x: ir.exp(-ir.cast(abs(x), ir.FLOAT)),
    "sqrt_abs": lambda x: ir.sqrt(ir.cast(abs(x), ir.FLOAT)),
    "log1_abs": lambda x: ir.log(ir.cast(abs(x), ir.FLOAT) + 1.0),
}
_INT_FNS_FOLD = {
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "exp_neg_abs": lambda x: math.exp(-abs(x)),
    "sqrt_abs": lambda x: math.sqrt(abs(x)), "log1_abs": lambda x: math.log(abs(x) + 1.0),
}


def float_trees(depth: int):
    loads = st.one_of(
        st.tuples(st.just("f_load1"), st.sampled_from(["bias_kv", "bias_q", "slopes"]), _index_tree(int_trees(1))),
        st.tuples(st.just("f_load2"), st.sampled_from(["pair", "head_row"]), _index_tree(int_trees(0)),
                  _index_tree(int_trees(0))),
    )
    base = st.one_of(
        st.just(("f_score",)),
        st.floats(-2, 2, allow_nan=False).map(lambda x: ("f_const", x)),
        st.tuples(st.just("f_scaled_int"), int_trees(1), st.sampled_from([0.5, -0.25, 0.1, 1.0])),
        # on a bare index leaf only: see test_trace.py::test_float_function_of_int_temporary
        st.tuples(st.just("f_int_fn"), st.sampled_from(list(_INT_FNS_TORCH)),
                  st.sampled_from(INT_LEAVES).map(lambda n: ("i_leaf", n))),
        loads,
    )
    if depth == 0:
        return base
    sub = float_trees(depth - 1)
    return st.one_of(
        base,
        st.tuples(st.sampled_from(["f_add", "f_sub", "f_mul"]), sub, sub),
        st.tuples(st.just("f_div_const"), sub, st.sampled_from([2.0, -3.0, 0.7])),
        st.tuples(st.sampled_from(["f_tanh", "f_sigmoid", "f_abs", "f_neg", "f_sqrt1", "f_log1", "f_exp_clamped",
                                   "f_exp2_tanh", "f_square"]), sub),
        st.tuples(st.sampled_from(["f_minimum", "f_maximum"]), sub, sub),
        st.tuples(st.just("f_clamp"), sub, st.floats(-3, 0), st.floats(0, 3)),
        # both branches read the score (see i_where above)
        st.tuples(st.just("f_where"), bool_trees(1), _score_plus(sub), _score_plus(sub)),
    )


def bound(t) -> float:
    """An upper bound of |value| of a float tree (|score| < 6 at these shapes; captures < 6)."""
    op = t[0]
    fixed = {"f_score": 6.0, "f_load1": 6.0, "f_load2": 6.0, "f_tanh": 1.0, "f_sigmoid": 1.0,
             "f_exp2_tanh": 2.0, "f_exp_clamped": math.exp(2), "f_clamp": 3.0}
    if op in fixed:
        return fixed[op]
    if op == "f_const":
        return abs(t[1])
    if op == "f_scaled_int":
        return 1e9  # int trees are not bounded here: always tamed
    if op == "f_int_fn":
        return 1.0 if t[1] in ("sigmoid", "exp_neg_abs") else 1e9
    if op in ("f_add", "f_sub", "f_minimum", "f_maximum"):
        return bound(t[1]) + bound(t[2])
    if op == "f_mul":
        return bound(t[1]) * bound(t[2])
    if op == "f_div_const":
        return bound(t[1]) / abs(t[2])
    if op in ("f_abs", "f_neg"):
        return bound(t[1])
    if op == "f_sqrt1":
        return math.sqrt(bound(t[1]) + 1.0)
    if op == "f_log1":
        return math.log(bound(t[1]) + 1.0)
    if op == "f_square":
        return bound(t[1]) ** 2
    if op == "f_where":
        return max(bound(t[2]), bound(t[3]))
    raise AssertionError(op)


def tame(t):
    """The float tree with tanh inserted wherever the value could leave [-8, 8]."""
    kids = [tame(c) if isinstance(c, tuple) and c and c[0].startswith("f_") else c for c in t[1:]]
    t = (t[0], *kids)
    return ("f_tanh", t) if bound(t) > FLOAT_BOUND else t


# ----------------------------------------------------------------------------------------------
# One evaluator, two backends


def _is_const(x) -> bool:
    return isinstance(x, (bool, int, float))


_FOLD = {  # Python semantics, which torch shares for these ops (// and % floor)
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
    "mod": operator.mod, "abs": abs, "neg": operator.neg, "minimum": min, "maximum": max,
    "bitand": operator.and_, "bitor": operator.or_, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
    "ge": operator.ge, "eq": operator.eq, "ne": operator.ne, "and": operator.and_, "or": operator.or_,
    "xor": operator.xor, "not": operator.not_, "where": lambda c, x, y: x if c else y,
    "tanh": math.tanh, "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)), "sqrt1": lambda x: math.sqrt(abs(x) + 1.0),
    "log1": lambda x: math.log(abs(x) + 1.0), "exp_clamped": lambda x: math.exp(min(max(x, -2.0), 2.0)),
    "exp2_tanh": lambda x: 2.0 ** math.tanh(x), "square": lambda x: x * x,
}

_OPERATORS = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "floordiv": operator.floordiv,
    "mod": operator.mod, "neg": operator.neg, "bitand": operator.and_, "bitor": operator.or_,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor, "not": operator.invert,
    "square": lambda x: x * x,
}

def _min_max(binary, clamp, upper: bool):
    """torch.minimum/maximum take two tensors: with a Python number a mod uses clamp instead."""
    def f(x, y):
        if _is_const(x):
            x, y = y, x
        if _is_const(y):
            return clamp(x, None, y) if upper else clamp(x, y, None)
        return binary(x, y)
    return f


def _symmetric(binary):
    """torch.eq(0, x) is a torch TypeError (input must be a tensor): put the traced value first."""
    return lambda x, y: binary(y, x) if _is_const(x) else binary(x, y)


# the same operations spelled with torch (traced through __torch_function__) and with attncc.ir
_TORCH = {
    "abs": torch.abs, "minimum": _min_max(torch.minimum, lambda x, lo, hi: torch.clamp(x, min=lo, max=hi), True),
    "maximum": _min_max(torch.maximum, lambda x, lo, hi: torch.clamp(x, min=lo, max=hi), False), "where": torch.where,
    "eq": _symmetric(torch.eq), "ne": _symmetric(torch.ne), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "sqrt1": lambda x: torch.sqrt(torch.abs(x) + 1.0), "log1": lambda x: torch.log(torch.abs(x) + 1.0),
    "exp_clamped": lambda x: torch.exp(torch.clamp(x, -2.0, 2.0)), "exp2_tanh": lambda x: torch.exp2(torch.tanh(x)),
    "to_float": lambda x: x.float(), "clamp": lambda x, lo, hi: x.clamp(lo, hi), "int_fn": _INT_FNS_TORCH,
}
_IR = {
    "abs": abs, "minimum": _min_max(ir.minimum, ir.clamp, True), "maximum": _min_max(ir.maximum, ir.clamp, False),
    "where": ir.where, "eq": _symmetric(ir.eq), "ne": _symmetric(ir.ne),
    "tanh": ir.tanh, "sigmoid": ir.sigmoid, "sqrt1": lambda x: ir.sqrt(abs(x) + 1.0),
    "log1": lambda x: ir.log(abs(x) + 1.0), "exp_clamped": lambda x: ir.exp(ir.clamp(x, -2.0, 2.0)),
    "exp2_tanh": lambda x: ir.exp2(ir.tanh(x)), "to_float": lambda x: ir.cast(x, ir.FLOAT),
    "clamp": ir.clamp, "int_fn": _INT_FNS_IR,
}


class Evaluator:
    """Builds a tree's value from ``leaves`` (proxies or IR nodes) with the ``funcs`` backend."""

    def __init__(self, caps: Captures, leaves: dict, funcs: dict, load):
        self.caps, self.leaves, self.funcs, self.load = caps, leaves, funcs, load

    def __call__(self, t):
        op = t[0][2:]
        if op in ("leaf", "score"):
            return self.leaves[t[1] if op == "leaf" else "score"]
        if op == "const":
            return t[1]
        if op == "load_doc":
            return self.load(self.caps.doc, self(t[1]))
        if op == "load_allowed":
            return self.load(self.caps.allowed, self(t[1]), self(t[2]))
        if op == "load1":
            return self.load(getattr(self.caps, t[1]), self(t[2]))
        if op == "load2":
            return self.load(getattr(self.caps, t[1]), self(t[2]), self(t[3]))
        if op == "scaled_int":
            x = self(t[1])
            return (float(x) if _is_const(x) else self.funcs["to_float"](x)) * t[2]
        if op == "int_fn":
            x = self(t[2])
            return _INT_FNS_FOLD[t[1]](x) if _is_const(x) else self.funcs["int_fn"][t[1]](x)
        if op == "div_const":
            x = self(t[1])
            return x / t[2]
        if op == "clamp":
            x = self(t[1])
            return min(max(x, t[2]), t[3]) if _is_const(x) else self.funcs["clamp"](x, t[2], t[3])
        args = [self(c) for c in t[1:]]
        if op == "where" and _is_const(args[0]):
            return args[1] if args[0] else args[2]
        if all(_is_const(a) for a in args):
            return _FOLD[op](*args)
        if op in _OPERATORS:
            return _OPERATORS[op](*args)
        return self.funcs[op](*args)


def python_mods(caps, score_tree, mask_tree):
    """The trees as FlexAttention-style Python mods."""
    def load(tensor, *index):
        return tensor[index]

    def score_mod(score, b, h, q_idx, kv_idx):
        return Evaluator(caps, dict(score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), _TORCH, load)(score_tree)

    def mask_mod(b, h, q_idx, kv_idx):
        return Evaluator(caps, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx), _TORCH, load)(mask_tree)
    return (score_mod if score_tree is not None else None), (mask_mod if mask_tree is not None else None)


def ir_mods(caps, score_tree, mask_tree):
    """The trees as attncc.ir expressions."""
    ev = Evaluator(caps, {n: getattr(ir, n) for n in ir.LEAVES}, _IR, ir.load)
    score = None if score_tree is None else ir.const(ev(score_tree))
    return score, (None if mask_tree is None else ir.const(ev(mask_tree)))


# ----------------------------------------------------------------------------------------------
# Properties

shapes = st.fixed_dictionaries({
    "B": st.integers(1, 2),
    "heads": st.sampled_from([(1, 1), (2, 2), (3, 1), (4, 2)]),
    "Lq": st.integers(1, MAX_L),
    "Lkv": st.integers(1, MAX_L),
    "D": st.sampled_from([16, 32, 48]),
    "seed": st.integers(0, 2**16),
})


def _with_score(kind_and_tree):
    """A score_mod that always reads the score, around a bounded random term e (|e| <= 8)."""
    kind, e = kind_and_tree
    score = ("f_score",)
    if kind == "add":
        return ("f_add", score, e)
    if kind == "scale":
        return ("f_mul", score, ("f_add", ("f_const", 1.0), ("f_tanh", e)))
    return ("f_mul", ("f_const", 5.0), ("f_tanh", ("f_add", ("f_div_const", score, 5.0), e)))  # softcap


score_trees = st.tuples(st.sampled_from(["add", "scale", "softcap"]), float_trees(2).map(tame)).map(_with_score)


def _inputs(shape):
    torch.manual_seed(shape["seed"])
    Hq, Hkv = shape["heads"]
    q = torch.randn(shape["B"], Hq, shape["Lq"], shape["D"])
    k = torch.randn(shape["B"], Hkv, shape["Lkv"], shape["D"])
    v = torch.randn(shape["B"], Hkv, shape["Lkv"], shape["D"])
    return q, k, v, Hq != Hkv


@SETTINGS
@given(score_tree=st.one_of(st.none(), score_trees, float_trees(2).map(tame)),
       mask_tree=st.one_of(st.none(), bool_trees(2)), shape=shapes)
def test_random_mods_match_reference(score_tree, mask_tree, shape):
    caps = Captures(shape["seed"])
    score_mod, mask_mod = python_mods(caps, score_tree, mask_tree)
    q, k, v, gqa = _inputs(shape)
    check(q, k, v, score_mod, mask_mod, enable_gqa=gqa)


@SETTINGS
@given(score_tree=score_trees, mask_tree=bool_trees(2), shape=shapes)
def test_random_ir_mods_equal_traced_mods(score_tree, mask_tree, shape):
    caps = Captures(shape["seed"])
    traced = attncc.Variant(*python_mods(caps, score_tree, mask_tree))
    written = attncc.Variant(*ir_mods(caps, score_tree, mask_tree))
    assert written.analysis.key == traced.analysis.key
    if traced.score_ir.type == ir.FLOAT and written.score_ir.type == ir.FLOAT:
        assert written.ir_key == traced.ir_key
    q, k, v, gqa = _inputs(shape)
    out_written = attncc.compile(written)(q, k, v, enable_gqa=gqa)
    out_traced, _, _ = check(q, k, v, traced.score_mod, traced.mask_mod, kernel=attncc.compile(traced), enable_gqa=gqa)
    assert torch.equal(out_traced, out_written)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tree=float_trees(2).map(tame))
def test_float_trees_stay_bounded(tree):
    """The strategy's own promise: every float tree's bound is at most 8 (checked without running)."""
    assert bound(tree) <= FLOAT_BOUND
