"""Mod keys: what the trace of a score_mod or mask_mod depends on besides its arguments.

A mod is a Python function; its trace (attncc.trace) depends on its code and on what it reads
from outside: closure cells, defaults, keyword defaults, the globals its code names, and through
them other functions (FlexAttention's and_masks keeps its mask_mods in a closure tuple). ``leaves``
walks those, recording how each value is reached (a path of attribute and item reads), so that

    mod_key(fn)    keys a trace: tensors and other objects by identity, numbers and strings by value;
                   equal keys trace to the same IR (``traced`` keeps one trace per key)
    resolve(fn, p) reads a value again by its path: torch.compile traces these reads into guarded
                   graph inputs (attncc.flex passes the tensors a mod reads into the graph this way)
"""
from __future__ import annotations

import functools
import inspect
import threading
import types
from collections import OrderedDict

import torch

from . import ir

lock = threading.RLock()


def leaves(fn, path=(), depth=0, seen=None):
    """(path, value) for everything a mod's trace depends on besides its arguments: its code,
    the contents of its closure cells, defaults and keyword defaults, and the globals its code
    names, recursing into functions, functools.partial, tuples and lists. ``path`` says how to
    reach the value from the mod (``resolve``)."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth > 6:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        yield from _values(fn.func, path + (("partial_func", None),), depth, seen)
        for i, a in enumerate(fn.args):
            yield from _values(a, path + (("partial_arg", i),), depth, seen)
        for k in sorted(fn.keywords):
            yield from _values(fn.keywords[k], path + (("partial_kw", k),), depth, seen)
        return
    if isinstance(fn, types.MethodType):  # a bound method: its object (by identity) and its function
        yield path + (("attr", "__self__"),), fn.__self__
        yield from leaves(fn.__func__, path + (("attr", "__func__"),), depth + 1, seen)
        return
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):  # a callable object: itself, by identity
        yield path, fn
        return
    yield path + (("attr", "__code__"),), code
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield from _values(value, path + (("closure", i),), depth, seen)
    for i, value in enumerate(fn.__defaults__ or ()):
        yield from _values(value, path + (("default", i),), depth, seen)
    for k in sorted(fn.__kwdefaults__ or {}):
        yield from _values(fn.__kwdefaults__[k], path + (("kwdefault", k),), depth, seen)
    names = set(code.co_names)
    for const in code.co_consts:  # lambdas and comprehensions inside the mod
        if isinstance(const, types.CodeType):
            names.update(const.co_names)
    glb = getattr(fn, "__globals__", {})
    for name in sorted(names):
        if name in glb and not isinstance(glb[name], types.ModuleType):
            yield from _values(glb[name], path + (("global", name),), depth, seen)


def _values(value, path, depth, seen):
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        yield path + (("type", None),), type(value)
        for i, v in enumerate(value):
            yield from _values(v, path + (("item", i),), depth + 1, seen)
    elif inspect.isfunction(value) or isinstance(value, functools.partial):
        yield from leaves(value, path, depth + 1, seen)
    else:
        yield path, value


SCALARS = (bool, int, float, str, bytes, complex, type(None), torch.dtype, torch.device, type)


def _key_of(value):
    """How a leaf enters a mod key: numbers and strings by value, code and everything else by
    identity (the cache entry keeps the object alive, so its id is not reused meanwhile)."""
    if isinstance(value, float):
        return ("f", value.hex())  # NaN equal to itself
    if isinstance(value, SCALARS):
        return ("v", type(value).__name__, value)
    return ("id", id(value))


def mod_key(fn) -> tuple:
    """(key, objects to keep alive) of a mod: equal keys trace to the same IR."""
    found = list(leaves(fn))
    return tuple((p, _key_of(v)) for p, v in found), [v for _, v in found if not isinstance(v, SCALARS)]


def resolve(root, path):
    """The value at ``path`` from a mod (the steps ``leaves`` records); plain attribute and item
    reads, which torch.compile traces into guarded graph inputs."""
    v = root
    for step, arg in path:
        if step == "closure":
            v = v.__closure__[arg].cell_contents
        elif step == "default":
            v = v.__defaults__[arg]
        elif step == "kwdefault":
            v = v.__kwdefaults__[arg]
        elif step == "global":
            v = v.__globals__[arg]
        elif step == "item":
            v = v[arg]
        elif step == "attr":
            v = getattr(v, arg)
        elif step == "partial_func":
            v = v.func
        elif step == "partial_arg":
            v = v.args[arg]
        elif step == "partial_kw":
            v = v.keywords[arg]
        elif step == "type":
            v = type(v)
    return v


class LRU(OrderedDict):
    def __init__(self, size):
        super().__init__()
        self.size = size

    def get(self, key, default=None):
        hit = super().get(key, default)
        if hit is not default:
            self.move_to_end(key)
        return hit

    def put(self, key, value):
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value


_traces = LRU(256)    # (kind, mod key) -> (IR node, kept objects)


def traced(fn, kind: str) -> ir.Node:
    """The IR of a mod, traced once per mod key (``mod_key``)."""
    key, keep = mod_key(fn)
    with lock:
        hit = _traces.get((kind, key))
        if hit is None:
            from .trace import trace
            hit = _traces.put((kind, key), (trace(fn, kind), keep))
    return hit[0]


