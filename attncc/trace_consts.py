"""One-element constants made inside a mod: torch.ones(()), b.new_ones(()), torch.tensor(2.0), ...

FlexAttention's helpers (and_masks, noop_mask) start from ``b.new_ones((), dtype=torch.bool)``,
and mods write ``torch.tensor(0.5)`` or ``torch.full((), x)``. While a mod is traced such a call
makes no tensor: ``_make`` turns it into an IR constant (or the traced value it wraps, cast to the
dtype asked for) of the kind torch would give the tensor. A factory of more than one element is
an ordinary captured tensor (``torch.arange(4)``), or an error where a traced value asks for it
(``b.new_ones(4)``). attncc.trace passes its Proxy class in as ``proxy``.
"""
from __future__ import annotations

import torch

from . import ir
from .errors import AttnccError
from .trace_errors import _capture

# functions that make a value rather than compute one: FlexAttention's helpers (and_masks,
# noop_mask) start from b.new_ones((), dtype=torch.bool); a one-element result is a constant
_FACTORY_NAMES = ("new_ones", "new_zeros", "new_full", "new_tensor", "ones_like", "zeros_like", "full_like",
                  "ones", "zeros", "full", "tensor", "scalar_tensor", "as_tensor")

_KIND_OF_DTYPE = {torch.bool: ir.BOOL}
# the dtypes a traced value reports: FlexAttention passes b, h, q_idx, kv_idx as int32 tensors
_DTYPE_OF_KIND = {ir.FLOAT: torch.float32, ir.INT: torch.int32, ir.BOOL: torch.bool}


def _kind(dtype, default: str) -> str:
    if dtype is None:
        return default
    if not isinstance(dtype, torch.dtype):
        raise AttnccError(f"dtype must be a torch.dtype, got {dtype!r}")
    return _KIND_OF_DTYPE.get(dtype) or (ir.FLOAT if dtype.is_floating_point else ir.INT)


def _kind_of(value, proxy) -> str:
    """The kind torch gives a tensor made from ``value`` (torch.tensor(3) is int64, ...)."""
    if isinstance(value, proxy):
        return value.node.type
    if isinstance(value, bool):
        return ir.BOOL
    if isinstance(value, int):
        return ir.INT
    if isinstance(value, torch.Tensor):
        return _kind(value.dtype, ir.FLOAT)
    return ir.FLOAT


def _scalar_size(size) -> bool:
    """Whether a factory's size makes one element: (), [], 1, (1,), (1, 1), ..."""
    dims = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    return all(isinstance(d, int) and not isinstance(d, bool) and d == 1 for d in dims)


def _value(value, kind: str, what: str, proxy):
    """A factory's fill value as an IR node of ``kind`` (a constant, or a traced value cast)."""
    if isinstance(value, proxy):
        return ir.cast(value.node, kind)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        if value.dim():
            value = value.reshape(())
        return ir.cast(ir.load(_capture(value)), kind)  # a captured tensor stays a runtime argument
    if not isinstance(value, (bool, int, float)):
        raise AttnccError(f"{what} of a {type(value).__name__} in a mod: use a Python number or a traced value")
    try:
        cast = {ir.BOOL: bool, ir.INT: int, ir.FLOAT: float}[kind](value)
    except (OverflowError, ValueError):
        raise AttnccError(f"{what}: {value!r} does not fit the integer dtype asked for; use a float dtype") from None
    return ir.const(cast)


def _make(name: str, args: tuple, kwargs: dict, proxy):
    dtype = kwargs.get("dtype")
    if name in ("new_ones", "new_zeros", "new_full", "new_tensor", "ones_like", "zeros_like", "full_like"):
        self, rest = args[0], args[1:]
        default = _kind_of(self, proxy)
        if name == "new_tensor" or name.endswith("_like"):
            fill = {"ones_like": 1, "zeros_like": 0}.get(name)
            if fill is None:
                fill = rest[0] if rest else kwargs.get("data", kwargs.get("fill_value"))
            if name == "new_tensor" and dtype is None:
                default = _kind_of(fill, proxy)
            return proxy(_value(fill, _kind(dtype, default), f"{name}()", proxy))
        size = rest[:1] if name == "new_full" else rest
        size = size or (kwargs.get("size", ()),)
        if not _scalar_size(size):
            raise AttnccError(f"{name} makes a tensor of size {size}; a mod computes one score at a time: make "
                              "a one-element value (size=())")
        fill = {"new_ones": 1, "new_zeros": 0}.get(name)
        if fill is None:
            fill = rest[1] if len(rest) > 1 else kwargs.get("fill_value")
        return proxy(_value(fill, _kind(dtype, default), f"{name}()", proxy))
    # torch.ones / zeros / full / tensor / scalar_tensor / as_tensor
    if name in ("tensor", "scalar_tensor", "as_tensor"):
        data = args[0] if args else kwargs.get("data", kwargs.get("s"))
        if not isinstance(data, (proxy, bool, int, float)):
            return None
        return proxy(_value(data, _kind(dtype, _kind_of(data, proxy)), f"torch.{name}()", proxy))
    size = args[:1] if name == "full" else args
    size = size or (kwargs.get("size", ()),)
    if not _scalar_size(size):
        return None
    if name == "full":
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        default = _kind_of(fill, proxy)
    else:
        fill, default = (1 if name == "ones" else 0), ir.FLOAT
    return proxy(_value(fill, _kind(dtype, default), f"torch.{name}()", proxy))
