"""Where a traced mod went wrong: the per-thread tracing state and the messages built from it.

``trace`` (attncc.trace) records in ``_tracing`` which mod this thread is tracing and the Python
names under which it sees tensors (``_capture`` reads those). The error builders here read it:
``_mod_name`` names the mod, ``_user_line`` finds the user's line (past attncc's and torch's
frames, naming torch's FlexAttention helper on the way), ``_ControlFlowError`` reports Python
control flow on a traced value, ``_located`` adds mod and line to an IR constructor's error,
``_check_arity`` checks a mod's signature, and ``_untraceable`` turns any other exception a mod
raised into a message with the failing line and what to write instead.
"""
from __future__ import annotations

import inspect
import linecache
import os
import threading

import torch

from . import ir
from .errors import AttnccError, ModTraceError

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_TORCH_HELPERS = os.path.join(_TORCH_DIR, "nn", "attention")  # FlexAttention's and_masks, noop_mask, ...


class _Tracing(threading.local):
    """What this thread's trace is doing: which mod (for error messages) and the Python names
    under which it sees tensors (for explain and comments). Per thread: threads trace at once."""

    def __init__(self):
        self.mod = None
        self.names: dict[int, str] = {}


_tracing = _Tracing()


def _capture(t: torch.Tensor) -> ir.Capture:
    return ir.Capture(t, _tracing.names.get(id(t)))


def _user_line(frame=None) -> str:
    """'file:line: code' of the innermost frame outside attncc and torch (from ``frame`` out); when
    a FlexAttention helper of torch's (and_masks, or_masks, ...) lies on the way, it is named too."""
    frame = frame or inspect.currentframe()
    helper = None
    while frame is not None:
        fname = os.path.abspath(frame.f_code.co_filename)
        if helper is None and fname.startswith(_TORCH_HELPERS):
            name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # Python >= 3.11 has the qualname
            helper = f"torch's {name} at {fname}:{frame.f_lineno}"
        if not fname.startswith(_HERE) and not fname.startswith(_TORCH_DIR):
            info = inspect.getframeinfo(frame)
            code = (info.code_context or [""])[0].strip()
            where = f"{fname}:{info.lineno}: {code}"
            return where if helper is None else f"{where} (through {helper})"
        frame = frame.f_back
    return "<unknown line>"


def _mod_name() -> str:
    fn = _tracing.mod
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class _ControlFlowError(ModTraceError):
    """Python control flow on a traced value. The message (which reads source lines) is built
    only when shown: torch probes proxies with len() while indexing and discards the error."""

    def __init__(self, what: str, fix: str | None = None):
        super().__init__(what)
        self.what, self.fix, self.mod, self.frame = what, fix, _mod_name(), inspect.currentframe().f_back

    def __str__(self):
        return (f"{self.mod} uses {self.what} on a traced value at {_user_line(self.frame)}\n"
                + (self.fix or
                   "Mods are traced once and run elementwise inside the kernel, so Python control flow "
                   "cannot depend on score, b, h, q_idx or kv_idx. Use torch.where(cond, a, b) instead of "
                   "if/else, `&` and `|` instead of `and`/`or`, `~` instead of `not`, torch.maximum / "
                   "torch.minimum instead of max() / min(), and unroll loops over Python constants."))


def _control_flow_error(what: str, fix: str | None = None):
    raise _ControlFlowError(what, fix)


def _located(e: AttnccError) -> AttnccError:
    """``e`` with the mod's name and the user's line in front (for errors of the IR constructors,
    which know neither)."""
    return AttnccError(f"{e}\n  in {_mod_name()} at {_user_line()}")


def _check_arity(fn, n, kind):
    try:
        inspect.signature(fn).bind(*range(n))
    except TypeError:
        sig = "(score, b, h, q_idx, kv_idx)" if kind == "score_mod" else "(b, h, q_idx, kv_idx)"
        raise AttnccError(f"{kind} {getattr(fn, '__name__', fn)!s} must take {n} positional arguments "
                          f"{sig}, as in FlexAttention; its signature is {inspect.signature(fn)}") from None
    except ValueError:
        pass  # builtins without a signature: let the call tell


def _frames(tb):
    """(file, line, function, code) of each frame of a traceback, outermost first."""
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        fname = os.path.abspath(code.co_filename)
        line = tb.tb_lineno
        text = (linecache.getline(fname, line) or "").strip()
        out.append((fname, line, code.co_name, text))
        tb = tb.tb_next
    return out


_HINTS = (
    (TypeError, "unsupported operand", "this operator has no meaning on a traced scalar (no @, divmod or "
                "sequence operations); write it with + - * / // % ** << >> & | ^ ~ and torch functions"),
    (TypeError, "unhashable", "traced values cannot be dict keys or set members; look values up in a captured "
                "tensor (table[q_idx]) or select with torch.where"),
    (TypeError, "", "call torch functions with the mod's arguments and Python numbers"),
    (AttributeError, "", "inside a mod each argument is a 0-d tensor: use operators and torch functions on it"),
    ((IndexError, KeyError), "", "index captured tensors with one integer expression per dimension "
                                 "(bias[h, q_idx - kv_idx]); Python sequences cannot be indexed by traced values"),
    (Exception, "", "write the mod with operators, torch.where and the supported torch functions"),
)


def _untraceable(e: Exception, kind: str, supported) -> str:
    """The message for an exception a mod raised while being traced: the mod, the failing line
    (when it failed inside one of torch's FlexAttention helpers, that frame and the user's line
    that led there), and what to write instead."""
    frames = _frames(e.__traceback__)
    user = [f for f in frames if not f[0].startswith(_HERE) and not f[0].startswith(_TORCH_DIR)]
    fn = _tracing.mod
    code = getattr(fn, "__code__", None)
    defined = f" (defined at {os.path.abspath(code.co_filename)}:{code.co_firstlineno})" if code is not None else ""
    head = f"{kind} {_mod_name()}{defined} cannot be traced: {type(e).__name__}: {e}"
    last = frames[-1] if frames else None
    if last is not None and last in user:
        at = f"\n  at {last[0]}:{last[1]}: {last[3]}"
    else:
        helper = next((f for f in reversed(frames) if f[0].startswith(_TORCH_HELPERS)), last)
        owner = "attncc's" if helper and helper[0].startswith(_HERE) else "torch's"
        inside = f"\n  inside {owner} {helper[2]} at {helper[0]}:{helper[1]}: {helper[3]}" if helper else ""
        caller = f"{user[-1][0]}:{user[-1][1]}: {user[-1][3]}" if user else _user_line()
        at = f"{inside}\n  called from {caller}"
    hint = next(h for types, needle, h in _HINTS if isinstance(e, types) and needle in str(e))
    return f"{head}{at}\nMods are traced once with proxy values: {hint}. Supported: {', '.join(supported)}"
