"""The tile bounds derived from mask predicates (passes/bounds.py) against brute force."""
import random

import pytest
import sympy as sp
import torch

import attncc
from attncc.passes import bounds
from attncc.passes.symbolic import KV, Q

LO, HI = sp.symbols("lo hi", integer=True)
H = sp.Symbol("h", integer=True, nonnegative=True)

MASKS = {
    "causal": lambda b, h, q, k: q >= k,
    "sliding": lambda b, h, q, k: (q >= k) & (q - k < 7),
    "prefix_lm": lambda b, h, q, k: (k < 5) | (q >= k),
    "not_greater": lambda b, h, q, k: ~(k > q),
    "bottom_right": lambda b, h, q, k: q + 9 >= k,
    "dilated_causal": lambda b, h, q, k: ((q - k) % 2 == 0) & (q >= k),
    "band_scaled": lambda b, h, q, k: (2 * q >= k) & (k + 3 > q),
    "diagonal": lambda b, h, q, k: q == k,
    "not_diagonal": lambda b, h, q, k: q != k,
    "query_rows_only": lambda b, h, q, k: q >= 10,
    "xor_of_halves": lambda b, h, q, k: (q >= k) ^ (k < 3),
    "per_head_window": lambda b, h, q, k: (q >= k) & (q - k <= 2 * h + 1),
    "or_of_windows": lambda b, h, q, k: ((q >= k) & (q - k < 3)) | ((k >= q) & (k - q < 2)),
}


def _value(expr, env):
    v = expr.subs(env)
    return float(v) if v.is_number else None


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("outer", ["q", "kv"])
def test_bounds_are_conservative(name, outer):
    fn = MASKS[name]
    mask = attncc.Variant(mask_mod=fn).analysis.mask
    o, i = (Q, KV) if outer == "q" else (KV, Q)
    tb = bounds.derive(mask, o, i, LO, HI)
    rng = random.Random(0)
    for _ in range(25):
        h = rng.randint(0, 3)
        lo = rng.randint(0, 30)
        hi = lo + rng.randint(0, 7)
        env = {LO: lo, HI: hi, H: h}
        r0, r1, f0, f1 = (_value(e, env) for e in (tb.reach.first, tb.reach.last, tb.full.first, tb.full.last))
        for inner in range(-3, 50):
            pairs = [(x, inner) if outer == "q" else (inner, x) for x in range(lo, hi + 1)]
            attends = [bool(fn(0, h, torch.tensor(qq), torch.tensor(kk))) for qq, kk in pairs]
            if any(attends):
                assert r0 <= inner <= r1, (name, outer, lo, hi, h, inner, tb.reach)
            if f0 <= inner <= f1:
                assert all(attends), (name, outer, lo, hi, h, inner, tb.full)


def test_bounds_are_tight_for_causal_and_window():
    m = attncc.Variant(mask_mod=MASKS["sliding"]).analysis.mask
    tb = bounds.derive(m, Q, KV, LO, HI)
    assert (tb.reach.first, tb.reach.last) == (LO - 6, HI)
    assert (tb.full.first, tb.full.last) == (HI - 6, LO)
