"""Names in generated code never come from the user.

A captured tensor's Python name used to prefix its loads' temporaries (``t0 = tl.load(...)``
for a table named ``t``), where sympy's cse temporaries (t0, t1, ...) and the templates'
variables (lse, q, kT, ...) share the namespace: silent wrong results. Code now names captures
cap<i>; the user's name appears in comments only, and only as a plain identifier.
"""
import ast
import re
from pathlib import Path

import pytest
import torch
from test_backward import check_grads

import attncc
from attncc import codegen, ir, plan, printer
from attncc.spec import Spec
from conftest import check, randn_qkv


def _template_identifiers() -> set:
    names = set()
    for f in codegen.template_dir().glob("*.jinja"):
        names |= set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", f.read_text()))
    return names


def test_no_template_variable_looks_like_a_mod_temporary():
    clash = sorted(n for n in _template_identifiers() if printer.TEMP_NAMES.fullmatch(n))
    assert not clash, f"templates use names of the form of mod temporaries: {clash}"


def test_capture_named_like_a_cse_temporary():
    """The issue's example: a table named ``t`` (sympy's cse names its temporaries t0, t1, ...)."""
    torch.manual_seed(0)
    t = torch.rand(2, 16) + 0.5

    def mod(s, b, h, qi, ki):
        y = torch.tanh(s * 0.5) + qi * 0.25
        z = t[h, ki]
        return s + y * y + z * y + z * z

    q, k, v = randn_qkv(1, 2, 2, 16, 16, 16)
    check(q, k, v, mod)


def test_capture_named_lse_backward():
    """A table named ``lse`` read at three rows: its temporaries were lse0.. lse2, beside the
    backward's own lse loads."""
    torch.manual_seed(1)
    lse = torch.randn(2, 40)

    def mod(s, b, h, qi, ki):
        return s + lse[h, qi] + 0.5 * lse[h, qi + 1] - 0.25 * lse[h, qi + 2] * s

    check_grads(1, 2, 2, 17, 33, 16, 16, mod, tol=2e-5)


def test_capture_named_q_in_the_inference_kernel():
    """A tensor named ``q`` read at three places in the decode kernel at head dim 24, which loads
    the query in two pieces, q and q2 (it crashed there)."""
    torch.manual_seed(2)
    q = torch.randn(4) * 0.1
    mod = lambda s, b, h, qi, ki: s + q[h] * (ki - qi) + q[(h + 1) % 4] - 0.5 * q[(ki + h) % 4]
    query, key, value = randn_qkv(1, 4, 2, 3, 300, 24)
    with torch.no_grad():
        check(query, key, value, mod, enable_gqa=True)


def _code(source: str) -> str:
    """The source's syntax tree without its docstring: what runs, comments left out."""
    tree = ast.parse(source)
    tree.body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body
    return ast.dump(tree)


def _plan_sources(variant, captures, target="interpreter"):
    a = variant.analysis
    spec = Spec("float32", 16, 16, 1, target)
    bwd = Spec("float32", 16, 16, 1, target, learnable=(0,))
    return [codegen.render(plan.build(kernel, a, s, captures)) for kernel, s in (("fwd", spec), ("bwd", bwd),
                                                                                   ("kv", spec))]


def test_every_template_and_printer_name_as_a_capture_name():
    """The rendered kernels (comments aside) are the same whatever the captured tensors are called,
    for every identifier of the templates and of the printer's output (eight names per render)."""
    tables = [torch.rand(2, 64) for _ in range(8)]

    def mod(s, b, h, qi, ki):
        y = torch.tanh(s * 0.5) + qi * 0.25
        for i, t in enumerate(tables):
            s = s + y * t[h, ki] + t[h, qi + i] * i
        return s

    variant = attncc.Variant(mod, lambda b, h, qi, ki: tables[0][h, qi] > tables[1][h, ki] - 2.0)
    named = lambda names: [ir.Capture(t, n) for t, n in zip(tables, names)]
    base = [_code(s) for s in _plan_sources(variant, named([f"table{i}" for i in range(8)]))]
    emitted = set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", "\n".join(_plan_sources(variant, named([None] * 8)))))
    names = sorted(_template_identifiers() | emitted)
    assert len(names) > 200
    for i in range(0, len(names), 8):
        chunk = (names[i:i + 8] + names[:8])[:8]
        sources = _plan_sources(variant, named(chunk))
        assert [_code(s) for s in sources] == base, f"captures named {chunk} change the generated code"


def test_capture_name_is_inert_in_generated_files(tmp_path):
    """A name set through attncc.ir is any text: it never reaches generated code, not even a
    comment or the docstring (it ran at import before)."""
    marker = tmp_path / "INJ"
    evil = f'"""+str(open({str(marker)!r},"w").write("ran"))+"""\n# \\\n'
    slopes = torch.rand(2)
    score = ir.score + ir.load(ir.Capture(slopes, evil), ir.h) * ir.cast(ir.kv_idx - ir.q_idx, ir.FLOAT)
    kernel = attncc.compile(attncc.Variant(score))
    q, k, v = randn_qkv(1, 2, 2, 5, 7, 16)
    out = kernel(q, k, v)
    assert not marker.exists(), "a capture's name ran as code"
    ref = attncc.reference.attention(q.double(), k.double(), v.double(),
                                     lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi))
    assert torch.allclose(out.double(), ref, atol=1e-5)
    source = kernel.source("fwd", torch.float32, head_dim=16, target="interpreter")
    assert "INJ" not in source and "open(" not in source
    readable = kernel.source("fwd", torch.float32, head_dim=16, target="interpreter")
    assert plan.comment_name(ir.Capture(slopes, "slopes")) == "slopes"
    assert plan.comment_name(ir.Capture(slopes, evil)) is None and "cap0" in readable


@pytest.mark.parametrize("name", ["slopes", "x" * 41, "a b", "é", "1x", None, 3])
def test_comment_name_is_a_plain_identifier_or_none(name):
    got = plan.comment_name(ir.Capture(torch.zeros(1), name))
    assert got is None or (got == name and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", got) and len(got) <= 40)
    assert (got is None) == (name != "slopes")
