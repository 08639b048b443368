"""Launch a compiled Triton kernel again without Triton's per-launch bookkeeping.

``kernel[grid](*args, **kwargs)`` on a @triton.jit function binds every argument, specialises
each one (type, 16-byte alignment, value 1), hashes the result, reads Triton's knobs, checks
the kernel's globals and only then launches. For attncc's kernels (19 to 80 arguments) that
took 26-47 us of host time per launch against 9-26 us for the compiled kernel's own launch
(H200 machine, triton 3.6), and short kernels (decode, 1k-token training steps) wait for it.
A ``Launcher`` keys each call on what Triton specialises on, computed in Python from the
arguments, and launches a key's compiled kernel directly; a new key, a launch hook (profilers
such as proton) or an argument it does not know goes through Triton's own launch, which also
compiles. Triton knobs that enter its compile options (debug, instrumentation) are read when
a key is first launched, not again. ``ATTNCC_DIRECT_LAUNCH=0`` makes every launch Triton's
(attncc.runtime.load). Either way a Launcher launches on the GPU of its first argument.
"""
from __future__ import annotations

import functools
import threading

import torch

from .log import logger

_I32 = (-(1 << 31), 1 << 31)  # a free int in this range is passed as int32, from 2**63 on as uint64
SPECIALISED, FREE, CONST = range(3)
MAX_KEYS = 4096  # keys one Launcher keeps before it starts over


class Launcher:
    """Wraps one @triton.jit or @gluon.jit kernel of a generated module: ``Launcher(fn)[grid](*args,
    **kwargs)`` launches exactly what ``fn[grid](*args, **kwargs)`` would, on the GPU that holds the
    first argument, or the tensor of a first TMA descriptor (Triton launches on the current
    device; a tensor on another GPU faults there).
    ``direct=False``: always through Triton's launch. ``compile_launch(run)`` makes Triton's launches,
    which may compile (attncc.toolchain.launch: under the ptxas the module asks for)."""

    def __init__(self, fn, direct: bool = True, compile_launch=lambda run: run()):
        self.fn = fn
        self._compile = compile_launch
        params = fn.params
        # per argument: FREE (Triton never specialises on its value: only an int's width counts),
        # CONST (a tl.constexpr: its value is compiled in) or SPECIALISED
        self._modes = tuple(CONST if p.is_constexpr else FREE if p.do_not_specialize else SPECIALISED
                            for p in params)
        self._names = tuple(p.name for p in params)
        self._defaults = {p.name: p.default for p in params}
        self._kernels: dict = {}  # key -> (compiled kernel, the arguments after the positional ones)
        self._key_functions: dict = {}  # tuple of argument types -> its key function
        self._direct = direct  # False: Triton's launch only (switched off, or a direct launch failed)
        from triton import knobs
        from triton.runtime import driver
        self._knobs, self._driver = knobs.runtime, driver  # launch hooks; device and stream

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        device, stream = self.device_and_stream()
        first = args[0] if args else None
        if not isinstance(first, torch.Tensor):
            first = getattr(first, "base", None)  # a host TMA descriptor: the tensor it describes
        at = first.get_device() if isinstance(first, torch.Tensor) else -1
        if at >= 0 and at != device:  # the inputs live on another GPU than the current one
            with torch.cuda.device(at):
                return self._launch(grid, args, kwargs, *self.device_and_stream())
        return self._launch(grid, args, kwargs, device, stream)

    def _launch(self, grid, args, kwargs, device, stream):
        knobs = self._knobs
        key = self.key(device, args, kwargs) if self._direct else None
        hit = self._kernels.get(key) if key is not None and not (
            _hooked(knobs.launch_enter_hook) or _hooked(knobs.launch_exit_hook)) else None
        if hit is None:
            kernel = self._compile(lambda: self.fn[grid](*args, **kwargs))
            if key is not None and kernel is not None:
                if len(self._kernels) >= MAX_KEYS:  # exact int values: many lengths, many keys
                    self._kernels.clear()
                    self._key_functions.clear()
                tail = tuple(kwargs.get(n, self._defaults[n]) for n in self._names[len(args):])
                self._kernels[key] = (kernel, tail)
            return kernel
        kernel, tail = hit
        x, y, z = (*grid, 1, 1)[:3]
        try:
            kernel.run(x, y, z, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
        except TypeError as e:  # a Triton whose launcher takes other arguments (checked before launching)
            logger.warning("attncc.launcher: direct launch of %s failed (%s); using Triton's launch from now on",
                           self.fn, e)
            self._kernels, self._direct = {}, False
            return self._compile(lambda: self.fn[grid](*args, **kwargs))
        return kernel

    def device_and_stream(self):
        """The current CUDA device and stream, as Triton's launch takes them."""
        driver = self._driver.active
        device = driver.get_current_device()
        return device, driver.get_current_stream(device)

    def key(self, device, args, kwargs):
        """What Triton's specialisation sees in the arguments, or None for an argument of a type
        this does not model. Finer than Triton's where that is cheaper (an int's exact value
        rather than 'is 1' / 'divisible by 16'); a finer key only costs a recompile-free miss.
        One generated function per tuple of argument types computes it (see key_function)."""
        types = tuple(map(type, args))
        fn = self._key_functions.get(types)
        if fn is None:
            fn = self._key_functions[types] = key_function(self._modes, args, tag=len(self._key_functions))
        return fn(device, args, kwargs)


def key_function(modes: tuple, example: tuple, tag: int):
    """The key of calls whose positional arguments have the types of ``example`` as one generated
    expression (a loop over 60 arguments took 34 us on the CPU-only box, this 9 us). ``tag``
    starts every key, so calls with other argument types never share one."""
    if len(example) > len(modes):
        return lambda device, args, kwargs: None
    names, parts = [], []
    for i, (a, mode) in enumerate(zip(example, modes)):
        t, x = type(a), f"a{i}"
        names.append(x)
        if mode == CONST or t in (bool, str) or (t is int and mode == SPECIALISED):
            parts.append(x)  # the value itself
        elif isinstance(a, torch.Tensor):  # torch.Tensor or a subclass (nn.Parameter)
            parts += [f"{x}.dtype", f"{x}.data_ptr() % 16 == 0"]
        elif t is int:  # FREE: only the width Triton passes it with
            parts += [f"{_I32[0]} <= {x} < {_I32[1]}", f"{x} >= {1 << 63}"]
        elif t.__name__ == "TensorDescriptor":  # a host TMA descriptor (triton.tools; Gluon's has a layout)
            parts += [f"{x}.base.dtype", f"tuple({x}.block_shape)", f"getattr({x}, 'padding', None)",
                      f"getattr({x}, 'round_f32_to_tf32', None)", f"getattr({x}, 'layout', None)"]
        elif t is not float and a is not None:  # a type Triton's key is not modelled for
            return lambda device, args, kwargs: None
    unpack = f"    {''.join(n + ', ' for n in names)}= args\n" if names else ""
    source = (f"def key(device, args, kwargs):\n{unpack}"
              f"    return ({tag}, device, tuple(kwargs.items()), {''.join(p + ', ' for p in parts)})\n")
    env: dict = {}
    exec(compile(source, "<attncc.launcher key>", "exec"), env)
    return env["key"]


def _hooked(hook) -> bool:
    """A launch hook is set: None or an empty HookChain (triton >= 3.7) mean none."""
    return hook is not None and bool(getattr(hook, "calls", True))


# Triton's interpreter keeps a launch's grid and program ids in process-wide state: two threads
# interpreting at once read each other's (wrong results, `y >= grid_dim[1]`). Interpreted
# launches take turns.
INTERPRETER_LOCK = threading.RLock()


class Serialised:
    """Wraps one @triton.jit kernel of an interpreted module: ``Serialised(fn)[grid](*args)``
    runs ``fn[grid](*args)`` holding INTERPRETER_LOCK."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            with INTERPRETER_LOCK:
                return self.fn[grid](*args, **kwargs)
        return run


def wrap(module, direct: bool = True, interpret: bool = False) -> None:
    """Launch the kernels a generated module names in HOST_KERNELS through Launchers (compiled;
    compiled with the ptxas the module asks for) or one at a time (interpreted)."""
    from . import toolchain
    compile_launch = functools.partial(toolchain.launch, module)
    for name in getattr(module, "HOST_KERNELS", ()):
        fn = getattr(module, name)
        setattr(module, name, Serialised(fn) if interpret else Launcher(fn, direct, compile_launch))
