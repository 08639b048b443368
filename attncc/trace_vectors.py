"""Vector reads inside a mod: a captured tensor indexed with fewer indices than its rank.

``rope[q_idx]`` of a (L, 16) ``rope`` is a ``Vector``: a small fixed-length row whose length is
known when the mod is traced. It first waits for more indices (``bias[h][q_idx]`` reaches full
rank and is one ordinary load); used in arithmetic it becomes its elements, each the full-index
load ``rope[q_idx, j]`` (at most ``MAX_ELEMENTS`` of them), so codegen, derivatives, gradients
into learnable captures, bounds checks and the reference see nothing new: the reads are
unrolled. Elementwise operators and torch functions apply per element (through the scalar
Proxy's rules in attncc.trace); ``sum``, ``mean``, ``amax``/``amin``, ``torch.dot``, ``@`` and
``norm`` reduce a vector to one traced scalar. A mod must return a scalar.

Cost: a row of n elements adds n loads (and the reduction n - 1 operations) per score.
"""
from __future__ import annotations

import itertools
import math

import torch

from . import ir
from .errors import AttnccError
from .trace_errors import _capture, _control_flow_error, _located, _mod_name, _user_line

MAX_ELEMENTS = 128  # longest row a mod may read as a vector: every element is one unrolled load per score
REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "dot", "matmul", "norm", "linalg_vector_norm")
_SUPPORTED = ("elementwise + - * / ** comparisons and the scalar torch functions (torch.exp, abs, ...) on vectors "
              "of one shape or a vector and a scalar; reductions .sum(), .mean(), .amax(), .amin(), .max(), "
              ".min() (over the whole vector or dim=-1), torch.dot(a, b), a @ b, torch.norm(a), a.norm(), "
              "torch.linalg.vector_norm(a); v[j] with a Python int")


class Vector:
    """A small row of traced values: either a captured tensor partly indexed (``tensor``,
    ``index``; its elements are made when first used) or the result of elementwise math
    (``nodes``). ``shape`` is the shape of the row; ``what`` says where it came from."""

    __hash__ = None

    def __init__(self, shape, tensor=None, index=(), nodes=None, what=None):
        self.shape, self.tensor, self.index, self._nodes = tuple(shape), tensor, tuple(index), nodes
        self.what = what or (f"captured tensor of shape {tuple(tensor.shape)} used with only {len(index)} of its "
                             f"{tensor.dim()} dimensions indexed (a vector of {math.prod(self.shape)} values)")

    @property
    def nodes(self) -> list:
        """The elements, flattened row-major: loads ``tensor[index..., j...]`` for a partial index."""
        if self._nodes is None:
            n = math.prod(self.shape)
            if n > MAX_ELEMENTS:
                raise AttnccError(
                    f"{_mod_name()} reads a row of {n} elements (shape {self.shape}) of a captured tensor of shape "
                    f"{tuple(self.tensor.shape)} as a vector at {_user_line()}; at most {MAX_ELEMENTS} elements are "
                    "supported (each is one load per score): index it fully, e.g. bias[h, q_idx, kv_idx]")
            from .trace import _node
            head = [_node(i) for i in self.index]
            try:
                self._nodes = [ir.load(_capture(self.tensor), *head, *j)
                               for j in itertools.product(*map(range, self.shape))]
            except AttnccError as e:
                raise _located(e) from None
        return self._nodes

    def __getitem__(self, more):
        if self.tensor is not None:
            from .trace import _index
            more = more if isinstance(more, tuple) else (more,)
            return _index(self.tensor, self.index + more)
        more = more if isinstance(more, tuple) else (more,)
        if len(more) != len(self.shape) or not all(isinstance(i, int) and -s <= i < s
                                                   for i, s in zip(more, self.shape)):
            raise _error(f"indexes a computed vector of shape {self.shape} with {more!r}")
        flat = 0
        for i, s in zip(more, self.shape):
            flat = flat * s + i % s
        from .trace import Proxy
        return Proxy(self.nodes[flat])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return call(func, args, kwargs or {})

    def _op(name):
        def method(self, *args, **kwargs):
            return call(getattr(torch.Tensor, name), (self,) + args, kwargs)
        method.__name__ = name
        return method

    for _n in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
               "__rtruediv__", "__pow__", "__rpow__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
               "__and__", "__rand__", "__or__", "__ror__", "__neg__", "__invert__", "__abs__", "__matmul__",
               "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "abs", "neg", "clamp", "clip", "minimum", "maximum",
               "float", "to", "add", "sub", "mul", "div", "pow", "square", "relu", "sin", "cos",
               "sum", "mean", "amax", "amin", "max", "min", "dot", "matmul", "norm"):
        locals()[_n] = _op(_n)
    del _n, _op

    def __bool__(self):
        _control_flow_error("`if`, `and`, `or`, `not` or bool()")

    def __iter__(self):
        raise _error("iterates over a vector (or calls len(), sum(), max() of Python on it)")

    __len__ = __iter__

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)  # protocol probes (copy, pickle, NumPy) see an ordinary object
        raise _error(f"reads `.{name}` of a vector")

    def __repr__(self):
        return f"Vector({self.what})"


def _error(what: str) -> AttnccError:
    return AttnccError(f"{_mod_name()} {what} at {_user_line()}; supported on a vector (a partly indexed "
                       f"captured tensor): {_SUPPORTED}")


def scalar_error(v: Vector) -> AttnccError:
    """Using a vector where one value is needed (as a load index, as the mod's result)."""
    return AttnccError(f"{_mod_name()}: {v.what} at {_user_line()}, where one value is needed; reduce it "
                       "(.sum(), .mean(), .amax(), torch.dot(a, b), a @ b, torch.norm(a)) or index every "
                       "dimension (bias[h, q_idx])")


def call(func, args: tuple, kwargs: dict):
    """A torch function or operator with a Vector among ``args``: a reduction, or elementwise."""
    from .trace import Proxy
    name = getattr(func, "__name__", str(func))
    key = name.strip("_")
    if key in ("max", "min") and len(args) == 2 and not isinstance(args[1], int):  # torch.max(a, b): elementwise
        func, key = (torch.maximum, "maximum") if key == "max" else (torch.minimum, "minimum")
    if key in REDUCTIONS:
        return Proxy(_reduce(key, args, kwargs))
    from .trace import _FACTORY_NAMES, _FUNCS
    if key not in _FUNCS and key not in _FACTORY_NAMES and key != "getitem":
        raise _error(f"calls `{name}` on a vector")
    vectors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, Vector)]
    shape = vectors[0].shape
    if any(v.shape != shape for v in vectors):
        raise _error(f"combines vectors of shapes {' and '.join(str(v.shape) for v in vectors)} in `{name}`")
    pick = lambda a, j: Proxy(a.nodes[j]) if isinstance(a, Vector) else a
    out = []
    for j in range(math.prod(shape)):
        r = Proxy.__torch_function__(func, (), tuple(pick(a, j) for a in args),
                                     {k: pick(v, j) for k, v in kwargs.items()})
        if not isinstance(r, Proxy):
            raise _error(f"calls `{name}`, which gives no scalar per element,")
        out.append(r.node)
    return Vector(shape, nodes=out, what=vectors[0].what)


def _dims(v: Vector, dim, keepdim, name: str):
    if keepdim:
        raise _error(f"calls `{name}(keepdim=True)`")
    if dim is None or (len(v.shape) == 1 and dim in (0, -1, (0,), (-1,), [0], [-1])):
        return
    raise _error(f"calls `{name}` over dim={dim!r} of a vector of shape {v.shape}")


def _reduce(key: str, args: tuple, kwargs: dict) -> ir.Node:
    v = args[0]
    if key in ("dot", "matmul"):
        if len(args) != 2 or kwargs or not all(isinstance(a, Vector) and len(a.shape) == 1 for a in args) \
                or args[0].shape != args[1].shape:
            raise _error(f"calls `{key}` on {', '.join(type(a).__name__ for a in args)}; it takes two 1-d vectors "
                         "of one length")
        return _fold("add", [ir.binary("mul", x, y) for x, y in zip(args[0].nodes, args[1].nodes)])
    if not isinstance(v, Vector) or any(isinstance(a, Vector) for a in args[1:]):
        raise _error(f"calls `{key}` with a vector as an argument")
    params = dict(zip(("p", "dim", "keepdim") if key == "norm" else
                      ("ord", "dim", "keepdim") if key == "linalg_vector_norm" else ("dim", "keepdim"), args[1:]))
    params.update(kwargs)
    p = params.pop("p", params.pop("ord", 2))
    dim, keepdim = params.pop("dim", None), params.pop("keepdim", False)
    params = {k: x for k, x in params.items() if not (k in ("dtype", "out") and x is None)}
    if params:
        raise _error(f"calls `{key}` with {', '.join(params)}")
    if key in ("max", "min") and dim is not None:
        raise _error(f"calls `{key}(dim)`, which returns values and indices; use .a{key}(-1) for the values")
    _dims(v, dim, keepdim, key)
    nodes = v.nodes
    if key == "sum":
        return _fold("add", nodes)
    if key == "mean":
        return ir.binary("truediv", _fold("add", nodes), len(nodes))
    if key in ("amax", "max"):
        return _fold("maximum", nodes)
    if key in ("amin", "min"):
        return _fold("minimum", nodes)
    if p in (2, 2.0, "fro", None):
        return ir.sqrt(_fold("add", [ir.binary("mul", x, x) for x in nodes]))
    if p in (1, 1.0):
        return _fold("add", [ir.unary("abs", x) for x in nodes])
    if p in (math.inf, float("inf")):
        return _fold("maximum", [ir.unary("abs", x) for x in nodes])
    raise _error(f"calls `{key}` with p={p!r}; norms of order 1, 2 and inf are supported")


def _fold(op: str, nodes: list) -> ir.Node:
    """A balanced tree of ``op`` over ``nodes`` (depth log2 n, so derivatives stay shallow)."""
    while len(nodes) > 1:
        paired = [_binary(op, nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
        nodes = paired + ([nodes[-1]] if len(nodes) % 2 else [])
    return nodes[0]


def _binary(op, x, y):
    return getattr(ir, op)(x, y) if op in ("maximum", "minimum") else ir.binary(op, x, y)
