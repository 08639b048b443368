"""Trace FlexAttention-style mods into attncc IR by calling them with proxy values.

``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` are called once
with ``Proxy`` arguments; Python operators and torch functions on proxies (through
``__torch_function__``) build IR nodes instead of computing. Indexing a captured tensor with
a proxy (``slopes[h]``, ``bias[h, q_idx - kv_idx]``) becomes an IR load of that tensor.
Indexing with fewer indices than the rank gives a small vector (attncc.trace_vectors).
Python control flow on a proxy cannot be traced and raises a ModTraceError that names the
mod, the line and the fix. One-element constants made inside a mod (``torch.ones(())``,
``b.new_ones(())``) are attncc.trace_consts; the error messages and the per-thread tracing state
they read are attncc.trace_errors.
"""
from __future__ import annotations

import torch

from . import ir
from .errors import AttnccError, ModTraceError
from .trace_consts import _DTYPE_OF_KIND, _FACTORY_NAMES, _make
from .trace_errors import (_capture, _check_arity, _control_flow_error, _located, _mod_name, _tracing,
                           _untraceable, _user_line)
from .trace_vectors import Vector, call as _vector_call, scalar_error as _vector_as_scalar

# torch function name (torch.X, Tensor.X or Tensor.__X__, underscores stripped) -> IR builder.
_FUNCS = {
    "add": lambda x, y, alpha=1: ir.binary("add", x, ir.binary("mul", y, alpha) if alpha != 1 else y),
    "sub": lambda x, y, alpha=1: ir.binary("sub", x, ir.binary("mul", y, alpha) if alpha != 1 else y),
    "subtract": lambda x, y: ir.binary("sub", x, y),
    "radd": lambda x, y: ir.binary("add", y, x), "rmul": lambda x, y: ir.binary("mul", y, x),
    "rsub": lambda x, y: ir.binary("sub", y, x),
    "mul": lambda x, y: ir.binary("mul", x, y), "multiply": lambda x, y: ir.binary("mul", x, y),
    "div": lambda x, y, rounding_mode=None: _div(x, y, rounding_mode),
    "divide": lambda x, y, rounding_mode=None: _div(x, y, rounding_mode),
    "truediv": lambda x, y: ir.binary("truediv", x, y), "true_divide": lambda x, y: ir.binary("truediv", x, y),
    "rtruediv": lambda x, y: ir.binary("truediv", y, x), "rdiv": lambda x, y: ir.binary("truediv", y, x),
    "floordiv": lambda x, y: ir.binary("floordiv", x, y), "floor_divide": lambda x, y: ir.binary("floordiv", x, y),
    "rfloordiv": lambda x, y: ir.binary("floordiv", y, x),
    "mod": lambda x, y: ir.binary("mod", x, y), "remainder": lambda x, y: ir.binary("mod", x, y),
    "rmod": lambda x, y: ir.binary("mod", y, x),
    "pow": lambda x, y: ir.binary("pow", x, y), "rpow": lambda x, y: ir.binary("pow", y, x),
    "neg": lambda x: ir.unary("neg", x), "negative": lambda x: ir.unary("neg", x),
    "abs": lambda x: ir.unary("abs", x), "absolute": lambda x: ir.unary("abs", x),
    "exp": ir.exp, "exp2": ir.exp2, "log": ir.log, "log2": ir.log2, "tanh": ir.tanh,
    "sigmoid": ir.sigmoid, "expit": ir.sigmoid, "sqrt": ir.sqrt, "rsqrt": ir.rsqrt, "floor": ir.floor,
    "minimum": ir.minimum, "maximum": ir.maximum, "fmin": ir.minimum, "fmax": ir.maximum,
    "clamp": lambda x, min=None, max=None: ir.clamp(x, min, max),
    "clip": lambda x, min=None, max=None: ir.clamp(x, min, max),
    "where": lambda c, x, y: ir.where(c, x, y),
    "lt": lambda x, y: x < y, "le": lambda x, y: x <= y, "gt": lambda x, y: x > y,
    "ge": lambda x, y: x >= y, "eq": ir.eq, "ne": ir.ne,
    "less": lambda x, y: x < y, "less_equal": lambda x, y: x <= y,
    "greater": lambda x, y: x > y, "greater_equal": lambda x, y: x >= y, "not_equal": ir.ne,
    "and": lambda x, y: ir.binary("and", x, y), "rand": lambda x, y: ir.binary("and", y, x),
    "or": lambda x, y: ir.binary("or", x, y), "ror": lambda x, y: ir.binary("or", y, x),
    "xor": lambda x, y: ir.binary("xor", x, y), "rxor": lambda x, y: ir.binary("xor", y, x),
    "logical_and": lambda x, y: ir.binary("and", ir.cast(x, ir.BOOL), ir.cast(y, ir.BOOL)),
    "logical_or": lambda x, y: ir.binary("or", ir.cast(x, ir.BOOL), ir.cast(y, ir.BOOL)),
    "logical_xor": lambda x, y: ir.binary("xor", ir.cast(x, ir.BOOL), ir.cast(y, ir.BOOL)),
    "logical_not": lambda x: ir.unary("invert", ir.cast(x, ir.BOOL)),
    "bitwise_and": lambda x, y: ir.binary("and", x, y), "bitwise_or": lambda x, y: ir.binary("or", x, y),
    "bitwise_xor": lambda x, y: ir.binary("xor", x, y), "bitwise_not": lambda x: ir.unary("invert", x),
    "invert": lambda x: ir.unary("invert", x),
    "float": lambda x: ir.cast(x, ir.FLOAT), "double": lambda x: ir.cast(x, ir.FLOAT),
    "half": lambda x: ir.cast(x, ir.FLOAT), "bfloat16": lambda x: ir.cast(x, ir.FLOAT),
    "long": lambda x: ir.cast(x, ir.INT), "int": lambda x: ir.cast(x, ir.INT),
    "bool": lambda x: ir.cast(x, ir.BOOL),
    "to": lambda x, *a, **k: _to(x, *a, **k), "type_as": lambda x, other: _to(x, other.dtype),
    # math and rounding functions (ir.UNARY_MATH / BINARY_MATH) under torch's names
    "sin": ir.sin, "cos": ir.cos, "tan": ir.tan, "atan": ir.atan, "arctan": ir.atan,
    "erf": ir.erf, "special_erf": ir.erf, "log1p": ir.log1p, "special_log1p": ir.log1p,
    "expm1": ir.expm1, "special_expm1": ir.expm1, "special_expit": ir.sigmoid,
    "sign": ir.sign, "sgn": ir.sign, "round": lambda x, decimals=0: _round(x, decimals), "ceil": ir.ceil,
    "trunc": ir.trunc, "fix": ir.trunc, "fmod": ir.fmod, "square": lambda x: ir.binary("mul", x, x),
    "reciprocal": lambda x: ir.binary("truediv", 1.0, x),
    "lshift": ir.lshift, "rlshift": lambda x, y: ir.lshift(y, x), "bitwise_left_shift": ir.lshift,
    "rshift": ir.rshift, "rrshift": lambda x, y: ir.rshift(y, x), "bitwise_right_shift": ir.rshift,
    # activations (torch.nn.functional and torch), composed of the ops above (attncc.ir)
    "relu": lambda x, inplace=False: ir.relu(x), "silu": lambda x, inplace=False: ir.silu(x),
    "gelu": lambda x, approximate="none": ir.gelu(x, approximate),
    "softplus": lambda x, beta=1.0, threshold=20.0: ir.softplus(x, _number(beta), _number(threshold)),
    "leaky_relu": lambda x, negative_slope=0.01, inplace=False: ir.leaky_relu(x, _number(negative_slope)),
    "elu": lambda x, alpha=1.0, inplace=False: ir.elu(x, _number(alpha)),
}
SUPPORTED = sorted({"+ - * / // % ** << >> unary- abs < <= > >= == != & | ^ ~"} | set(_FUNCS) | set(_FACTORY_NAMES) - {
    "radd", "rmul", "rsub", "rtruediv", "rdiv", "rfloordiv", "rmod", "rpow", "rand", "ror", "rxor", "and", "or", "xor",
    "truediv", "floordiv", "lshift", "rshift", "rlshift", "rrshift"})


def _number(v):
    """A parameter that must be a Python number (softplus's beta, ...), not a traced value."""
    if isinstance(v, ir.Node):
        if v.op == "const" and not isinstance(v.value, bool):
            return v.value
        raise AttnccError("this parameter must be a Python number, not a traced value")
    return v


def _round(x, decimals):
    if decimals != 0:
        raise AttnccError(f"torch.round(decimals={decimals}) is not supported in a mod; scale first: "
                          f"torch.round(x * 10**{decimals}) / 10**{decimals}")
    return ir.round(x)


def _div(x, y, rounding_mode):
    if rounding_mode is None:
        return ir.binary("truediv", x, y)
    if rounding_mode == "floor":
        return ir.binary("floordiv", x, y)
    raise AttnccError(f"torch.div(rounding_mode={rounding_mode!r}) is not supported in a mod; "
                      "use rounding_mode='floor' or //")


def _to(x, *args, **kwargs):
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
    if dtype is None:
        return x  # .to(device) and friends do nothing to a traced scalar expression
    if dtype == torch.bool:
        return ir.cast(x, ir.BOOL)
    return ir.cast(x, ir.FLOAT if dtype.is_floating_point else ir.INT)


def _factory(name: str, args: tuple, kwargs: dict):
    """A factory call inside a mod, as a Proxy when it makes one element; None when it makes a
    real tensor (torch.arange(4) in a mod is an ordinary captured tensor)."""
    try:
        return _make(name, args, kwargs, Proxy)
    except AttnccError as e:
        if type(e) is not AttnccError:
            raise
        raise _located(e) from None


class _Factories(torch.overrides.TorchFunctionMode):
    """Active while a mod is traced: torch.ones(()), torch.tensor(2.0), torch.full((), x) ... made
    inside a mod become constants (or the traced value they wrap) instead of captured tensors;
    every other torch call goes on to the proxies' __torch_function__ or to torch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("ones", "zeros", "full", "tensor", "scalar_tensor", "as_tensor"):
            made = _factory(name, args, kwargs)
            if made is not None:
                return made
        return func(*args, **kwargs)


def _node(x):
    """IR node for one argument of a traced operation."""
    if isinstance(x, Proxy):
        return x.node
    if isinstance(x, Vector):
        raise _vector_as_scalar(x)
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return ir.load(_capture(x))
        raise AttnccError(
            f"{_mod_name()} uses a captured tensor of shape {tuple(x.shape)} as a whole at {_user_line()}; "
            "mods work on one score at a time: index it, e.g. bias[h, q_idx, kv_idx]")
    if isinstance(x, (bool, int, float)):
        return ir.const(x)
    if hasattr(x, "item") and hasattr(x, "dtype") and getattr(x, "shape", ()) == ():  # numpy scalars
        return ir.const(x.item())
    raise AttnccError(f"{_mod_name()} uses a value of type {type(x).__name__} at {_user_line()}; "
                      "mods may use traced values, Python numbers and captured torch tensors")


def _wrap(x):
    return Proxy(x) if isinstance(x, ir.Node) else x


def _index(tensor: torch.Tensor, index):
    idx = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis or i is None or isinstance(i, slice) for i in idx):
        raise AttnccError(f"{_mod_name()} slices a captured tensor at {_user_line()}; "
                          "index it with one integer expression per dimension")
    if len(idx) > tensor.dim():
        raise AttnccError(f"{_mod_name()} indexes a {tensor.dim()}-d captured tensor with {len(idx)} "
                          f"indices at {_user_line()}")
    if len(idx) < tensor.dim():  # a row: waits for more indices, or is a vector (attncc.trace_vectors)
        return Vector(tensor.shape[len(idx):], tensor, idx)
    nodes = [_node(i) for i in idx]
    try:
        return Proxy(ir.load(_capture(tensor), *nodes))
    except AttnccError as e:
        raise _located(e) from None


class Proxy:
    """A traced scalar value inside a mod. Operations on it record IR nodes."""

    __slots__ = ("node",)
    __hash__ = None

    def __init__(self, node: ir.Node):
        self.node = node

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":
            return _index(args[0], args[1])
        if any(isinstance(a, Vector) for a in (*args, *kwargs.values())):
            return _vector_call(func, args, kwargs)
        key = name.strip("_")
        if key in _FACTORY_NAMES:
            return _factory(key, args, kwargs)
        builder = _FUNCS.get(key)
        if builder is None:
            raise AttnccError(
                f"{_mod_name()} calls torch function `{name}` at {_user_line()}, which attncc cannot "
                f"compile into a kernel. Supported: {', '.join(SUPPORTED)}")
        if key in ("to", "type_as"):
            return _wrap(builder(_node(args[0]), *args[1:], **kwargs))
        conv = lambda v: v if v is None or isinstance(v, str) else _node(v)
        args, kwargs = [conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()}
        try:
            return _wrap(builder(*args, **kwargs))
        except TypeError as e:
            raise AttnccError(f"{_mod_name()}: unsupported arguments to `{name}` at {_user_line()}: {e}") from None
        except AttnccError as e:
            if type(e) is not AttnccError:
                raise
            raise _located(e) from None

    def _op(name):
        def method(self, *args, **kwargs):
            return Proxy.__torch_function__(getattr(torch.Tensor, name), (), (self,) + args, kwargs)
        method.__name__ = name
        return method

    for _n in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
               "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
               "__rpow__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__and__",
               "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__neg__", "__invert__",
               "__abs__", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "floor",
               "abs", "neg", "clamp", "clip", "minimum", "maximum", "to", "type_as", "float",
               "double", "half", "bfloat16", "long", "int", "bool", "logical_and", "logical_or",
               "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not",
               "lt", "le", "gt", "ge", "eq", "ne", "add", "sub", "mul", "div", "pow", "remainder",
               "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "sin", "cos", "tan", "atan", "arctan",
               "erf", "log1p", "expm1", "sign", "sgn", "round", "ceil", "trunc", "fix", "fmod", "square",
               "reciprocal", "relu", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift",
               "new_ones", "new_zeros", "new_full", "new_tensor"):
        locals()[_n] = _op(_n)
    del _n, _op

    def __bool__(self):
        _control_flow_error("`if`, `and`, `or`, `not` or bool()")

    def __index__(self):
        _control_flow_error("a Python index, range() or int()")

    __int__ = __index__

    def __float__(self):
        _control_flow_error("float() or a `math` function", "Python's float() and the math module need a number, "
                            "but a mod's arguments are traced: use the torch functions (torch.exp, torch.log, "
                            "torch.sqrt, torch.tanh, ...) and x.float() for a conversion.")

    def __round__(self, ndigits=None):
        _control_flow_error("round()", "use torch.round(x) to round a traced value (ties to even, as Python's round; "
                            "torch.floor(x + 0.5) rounds ties up).")

    def __floor__(self):
        return _wrap(ir.floor(self.node))

    def __ceil__(self):
        return _wrap(ir.ceil(self.node))

    def __trunc__(self):
        return _wrap(ir.trunc(self.node))

    def __pos__(self):
        return self

    # What a 0-d tensor reports: mods read these to build values of the same kind
    # (torch.finfo(score.dtype).min, b.new_ones((), device=b.device), x.to(score.dtype)).
    @property
    def dtype(self):
        return _DTYPE_OF_KIND[self.node.type]

    @property
    def device(self):
        return None  # any: constants and casts made inside a mod have no device

    def is_floating_point(self):
        return self.node.type == ir.FLOAT

    def item(self):
        _control_flow_error("item() or tolist()", "A mod's arguments are traced, not numbers: keep computing with "
                            "them as tensors (torch.where instead of if, x.float() instead of float(x)).")

    tolist = item

    def __complex__(self):
        _control_flow_error("complex()", "attncc mods compute with real numbers only.")

    def __iter__(self):
        _control_flow_error("iteration")

    def __len__(self):
        _control_flow_error("len()")

    def __getitem__(self, _):
        raise AttnccError(f"{_mod_name()} indexes a traced scalar at {_user_line()}; only captured "
                          "tensors can be indexed")

    def __getattr__(self, name):
        if name.startswith("__array"):
            raise AttnccError(f"{_mod_name()} passes a traced value to NumPy at {_user_line()}; mods are traced "
                              f"through torch: use the torch function instead. Supported: {', '.join(SUPPORTED)}")
        raise AttnccError(
            f"{_mod_name()} reads `.{name}` of a traced value at {_user_line()}; inside a mod each "
            f"argument is a single scalar. Supported: {', '.join(SUPPORTED)}")

    def __repr__(self):
        return f"Proxy({ir.to_text(self.node)})"


def _name_captures(fn):
    """Remember the Python names under which fn sees tensors, for readable kernels."""
    names = {}
    code = getattr(fn, "__code__", None)
    if code is not None:
        for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
            try:
                val = cell.cell_contents
            except ValueError:
                continue
            if isinstance(val, torch.Tensor):
                names[id(val)] = var
        for var in code.co_names:
            val = getattr(fn, "__globals__", {}).get(var)
            if isinstance(val, torch.Tensor):
                names[id(val)] = var
    return names


def trace(fn, kind: str) -> ir.Node:
    """The IR of a score_mod (kind='score_mod') or mask_mod (kind='mask_mod')."""
    if isinstance(fn, (ir.Node, Proxy)):
        node = fn.node if isinstance(fn, Proxy) else fn
        return _checked(node, kind)
    if not callable(fn):
        raise AttnccError(f"{kind} must be a function or an attncc.ir expression, got {type(fn).__name__}")
    leaves = [ir.b, ir.h, ir.q_idx, ir.kv_idx]
    if kind == "score_mod":
        leaves.insert(0, ir.score)
    _check_arity(fn, len(leaves), kind)
    previous = _tracing.mod
    _tracing.mod = fn
    _tracing.names.update(_name_captures(fn))
    try:
        try:
            with _Factories():
                out = fn(*[Proxy(n) for n in leaves])
        except AttnccError:
            raise
        except Exception as e:  # Python or torch refused something the mod did: say where, and what works
            raise ModTraceError(_untraceable(e, kind, SUPPORTED)) from e
        _check_result(out, kind)
        node = _node(out)
    finally:
        _tracing.mod = previous
        _tracing.names.clear()
    return _checked(node, kind)


def _check_result(out, kind: str) -> None:
    """A mod returns one value: a traced expression, a Python number or bool, or a 0-d tensor."""
    what = "a bool expression (e.g. q_idx >= kv_idx)" if kind == "mask_mod" else \
        "the modified score (e.g. score + bias[h])"
    if out is None:
        raise AttnccError(f"{kind} {_mod_name()} returned None; did you forget `return`? It must return {what}")
    if isinstance(out, (Proxy, ir.Node, bool, int, float, Vector)):
        return
    if isinstance(out, torch.Tensor):
        if out.dim() > 0:
            raise AttnccError(f"{kind} {_mod_name()} returned a tensor of shape {tuple(out.shape)}; it must return "
                              f"a scalar expression: {what}; index captured tensors with the mod's arguments")
        return
    if hasattr(out, "dtype") and getattr(out, "shape", None) == ():  # numpy scalar
        return
    shown = repr(out)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    hint = " (return one value, not several)" if isinstance(out, (tuple, list)) else ""
    raise AttnccError(f"{kind} {_mod_name()} returned a {type(out).__name__} ({shown}){hint}; it must return "
                      f"{what}, built from its arguments with operators and torch functions, or a Python number")


def _checked(node: ir.Node, kind: str) -> ir.Node:
    """Type-check a mod's root; a score_mod's value is always float."""
    if kind == "score_mod":
        ir.verify(node, None)
        return ir.cast(node, ir.FLOAT)
    ir.verify(None, node)
    return node
