"""Dense eager PyTorch implementation of any attncc variant: the test oracle.

It evaluates the same IR the kernels are generated from, on the materialised (B, H, Lq, Lkv)
score tensor, in float64 for float64 inputs and float32 otherwise. It allocates O(Lq * Lkv)
memory on purpose: it is the plain definition the kernels must match.
"""
from __future__ import annotations

import math

import torch

from . import ir
from .checks import DTYPES, check_qkv
from .variant import Variant

_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "exp2": torch.exp2, "log": torch.log,
    "log2": torch.log2, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "atan": torch.atan,
    "erf": torch.erf, "log1p": torch.log1p, "expm1": torch.expm1, "sign": torch.sign,
    "round": torch.round, "ceil": torch.ceil, "trunc": torch.trunc,
}


def _floordiv(a, b):
    """a // b rounding toward -inf, with a // 0 = 0 on integers (attncc.variant.Variant)."""
    if a.is_floating_point():
        return torch.div(a, b, rounding_mode="floor")
    zero = b == 0
    return torch.where(zero, 0, torch.div(a, torch.where(zero, 1, b), rounding_mode="floor"))


def _mod(a, b):
    """torch.remainder (the sign of the divisor), with a % 0 = a on integers."""
    if a.is_floating_point():
        return torch.remainder(a, b)
    zero = b == 0
    return torch.where(zero, a, torch.remainder(a, torch.where(zero, 1, b)))


def _fmod(a, b):
    """torch.fmod (the sign of the dividend), with a fmod 0 = a on integers."""
    if a.is_floating_point():
        return torch.fmod(a, b)
    zero = b == 0
    return torch.where(zero, a, torch.fmod(a, torch.where(zero, 1, b)))


_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.div,
    "floordiv": _floordiv, "mod": _mod,
    "pow": torch.pow, "minimum": torch.minimum, "maximum": torch.maximum,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "fmod": _fmod, "lshift": torch.bitwise_left_shift, "rshift": torch.bitwise_right_shift,
}
_LOGIC = {"and": (torch.logical_and, torch.bitwise_and), "or": (torch.logical_or, torch.bitwise_or),
          "xor": (torch.logical_xor, torch.bitwise_xor)}


def _load(tensor, index, dtype):
    """tensor[index] with 0 for out-of-range indices, as the kernels read."""
    t = tensor.to(dtype)
    if not index:
        return t
    shape = torch.broadcast_shapes(*[i.shape for i in index])
    ok = torch.ones(shape, dtype=torch.bool, device=t.device)
    clamped = []
    for d, i in enumerate(index):
        ok = ok & (i >= 0) & (i < t.shape[d])
        clamped.append(i.clamp(0, max(t.shape[d] - 1, 0)).expand(shape))
    if t.numel() == 0:
        return torch.zeros(shape, dtype=dtype, device=t.device)
    return torch.where(ok, t[tuple(clamped)], torch.zeros((), dtype=dtype, device=t.device))


def evaluate(root: ir.Node, env: dict, fdtype: torch.dtype, device) -> torch.Tensor:
    """Value of an IR expression; env maps the leaves to broadcastable tensors."""
    dtypes = {ir.FLOAT: fdtype, ir.INT: torch.int64, ir.BOOL: torch.bool}
    vals = {}
    for n in ir.walk(root):
        a = [vals[x] for x in n.args]
        want = dtypes[n.type]
        if n.op in env:
            r = env[n.op]
        elif n.op == "const":
            r = torch.tensor(n.value, dtype=want, device=device)
        elif n.op == "load":
            r = _load(n.value.tensor.to(device), a, dtypes[n.value.kind])
        elif n.op == "where":
            r = torch.where(a[0], a[1].to(want), a[2].to(want))
        elif n.op == "cast":
            r = a[0] != 0 if n.value == ir.BOOL else a[0].to(want)
        elif n.op in _LOGIC:
            logical, bitwise = _LOGIC[n.op]
            r = logical(*a) if n.type == ir.BOOL else bitwise(*[x.to(torch.int64) for x in a])
        elif n.op == "invert":
            r = torch.logical_not(a[0]) if n.type == ir.BOOL else torch.bitwise_not(a[0])
        elif n.op == "floor":
            r = torch.floor(a[0]) if n.type == ir.FLOAT else a[0]
        elif n.op in _UNARY:
            x = a[0].to(want) if n.type == ir.FLOAT else a[0].to(torch.int64)
            r = _UNARY[n.op](x)
        else:
            x, y = a
            if n.type == ir.FLOAT or n.op == "truediv" or ir.FLOAT in (n.args[0].type, n.args[1].type):
                x, y = x.to(fdtype), y.to(fdtype)
            elif n.type != ir.BOOL or (x.dtype != torch.bool or y.dtype != torch.bool):
                x, y = x.to(torch.int64), y.to(torch.int64)
            r = _BINARY[n.op](x, y)
        vals[n] = r.to(want) if r.dtype != want else r
    return vals[root]


def attention_variant(variant: Variant, query, key, value, *, enable_gqa=False, return_lse=False,
                      dropout_mask=None, q_offset=0, b_offset=0):
    """Materialised attention for a Variant; dropout is applied only with an explicit keep-mask
    (attncc.dropout_mask), scaling kept probabilities by 1 / (1 - dropout_p). The mods see
    q_idx = q_offset + i (a KV cache's queries sit after its earlier tokens) and b = b_offset + i
    (one sequence of a varlen batch at a time)."""
    group = check_qkv(query, key, value, enable_gqa, dtypes=DTYPES + (torch.float64,), max_head_dim=1 << 16)
    B, H, Lq, D = query.shape
    Lkv = key.shape[2]
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    dev = query.device
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = variant.scale if variant.scale is not None else 1.0 / math.sqrt(D)
    env = {
        "score": (q @ k.transpose(-1, -2)) * scale,
        "b": (b_offset + torch.arange(B, device=dev)).view(B, 1, 1, 1),
        "h": torch.arange(H, device=dev).view(1, H, 1, 1),
        "q_idx": (q_offset + torch.arange(Lq, device=dev)).view(1, 1, Lq, 1),
        "kv_idx": torch.arange(Lkv, device=dev).view(1, 1, 1, Lkv),
    }
    s = evaluate(variant.score_ir, env, dtype, dev).expand(B, H, Lq, Lkv)
    if variant.mask_ir is not None:
        keep = evaluate(variant.mask_ir, env, dtype, dev).expand(B, H, Lq, Lkv)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # rows with every key masked out (lse = -inf) give 0; a NaN score gives a NaN row, as in SDPA
    masked = torch.isneginf(lse).unsqueeze(-1)
    p = torch.exp(s - torch.where(masked, 0.0, lse.unsqueeze(-1)))
    p = torch.where(masked, 0.0, p)
    if dropout_mask is not None:
        p = torch.where(dropout_mask.to(p.device), p / (1.0 - variant.dropout_p), 0.0)
    out = (p @ v).to(query.dtype)
    return (out, lse.to(torch.float32 if query.dtype != torch.float64 else dtype)) if return_lse else out


def attention(query, key, value, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False,
              return_lse=False, dropout_p=0.0, dropout_mask=None, q_offset=0, b_offset=0):
    """Same signature as attncc.attention; computes the dense definition in PyTorch. With
    dropout_p > 0 pass the keep-mask to apply (attncc.dropout_mask gives the kernels' mask)."""
    if dropout_p and dropout_mask is None:
        raise ValueError("the reference applies dropout only with an explicit dropout_mask= "
                         "(attncc.dropout_mask(...) gives the one the kernels use)")
    variant = Variant(score_mod, mask_mod, scale=scale, dropout_p=dropout_p)
    return attention_variant(variant, query, key, value, enable_gqa=enable_gqa, return_lse=return_lse,
                             dropout_mask=dropout_mask if dropout_p else None, q_offset=q_offset,
                             b_offset=b_offset)
