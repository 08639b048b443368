"""attncc.launcher: a repeated launch reuses a compiled kernel only when Triton would have.

Triton itself is replaced by a recording stand-in (a compiled launch needs a GPU; the GPU tests
run every kernel through the real thing): each test says which calls must go through Triton's
own launch (which specialises and compiles) and which may relaunch the kernel directly, and
checks the argument list a direct launch hands to the compiled kernel."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from attncc import launcher, runtime


def param(name, constexpr=False, free=False, default=None):
    return SimpleNamespace(name=name, is_constexpr=constexpr, do_not_specialize=free, default=default)


class FakeKernel:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("direct", a))


class FakeJIT:
    """fn[grid](*args, **kwargs) as Triton's JITFunction: logs the call, returns 'the compiled kernel'."""
    params = [param("X"), param("n"), param("seed", free=True), param("scale"), param("mode"),
              param("CONST_F", constexpr=True), param("BLOCK", constexpr=True), param("EVEN", constexpr=True, default=True)]

    def __init__(self):
        self.log = []
        self.kernel = FakeKernel(self.log)

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return self.kernel
        return run


@pytest.fixture
def fake(monkeypatch):
    runtime._triton(for_cpu=True)  # a Launcher imports triton: let attncc choose the interpreter first
    fn = FakeJIT()
    lau = launcher.Launcher(fn)
    monkeypatch.setattr(lau, "device_and_stream", lambda: (0, "stream"))
    monkeypatch.setattr(lau, "_knobs", SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    return fn, lau


def kinds(fn):
    return [entry[0] for entry in fn.log]


def test_a_repeated_launch_goes_straight_to_the_compiled_kernel_with_every_argument_in_order(fake):
    fn, lau = fake
    x = torch.zeros(8)
    lau[(3, 2)](x, 64, 7, 0.5, None, 1.5, BLOCK=32, num_warps=4)
    lau[(3, 2)](x, 64, 9, 0.25, None, 1.5, BLOCK=32, num_warps=4)
    assert kinds(fn) == ["triton", "direct"]
    grid_and_handles = (3, 2, 1, "stream", "function", "metadata", None, None, None)
    # the positional arguments, then BLOCK from the keywords and EVEN's default, as Triton binds them
    assert fn.log[1][1] == grid_and_handles + (x, 64, 9, 0.25, None, 1.5, 32, True)


@pytest.mark.parametrize("change", [
    "misaligned tensor", "other dtype", "specialised int", "free int past 32 bits", "constexpr value",
    "keyword constexpr", "launch option", "None for an int"])
def test_a_launch_triton_would_specialise_differently_goes_through_triton(fake, change):
    fn, lau = fake
    x = torch.zeros(8)
    args, kwargs = [x, 64, 7, 0.5, None, 1.5], dict(BLOCK=32, num_warps=4)
    lau[(1,)](*args, **kwargs)
    if change == "misaligned tensor":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "other dtype":
        args[0] = x.half()
    elif change == "specialised int":
        args[1] = 1
    elif change == "free int past 32 bits":
        args[2] = 1 << 40
    elif change == "constexpr value":
        args[5] = 2.5
    elif change == "keyword constexpr":
        kwargs["BLOCK"] = 64
    elif change == "launch option":
        kwargs["num_warps"] = 8
    else:
        args[4] = 3
    lau[(1,)](*args, **kwargs)
    assert kinds(fn) == ["triton", "triton"]
    lau[(1,)](*args, **kwargs)  # ... and is then cached under its own key
    assert kinds(fn) == ["triton", "triton", "direct"]


def _signature_example(X, n, seed, scale, mode, CONST_F: "tl.constexpr", BLOCK: "tl.constexpr",
                       EVEN: "tl.constexpr" = True):
    """The parameters of FakeJIT, for Triton's own binder."""


def triton_specialisation():
    """Triton's own binder for FakeJIT's parameters (as a CUDA kernel for sm90): what Triton
    compiles a launch for is the specialisation and options it returns."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature
    fn = JITFunction(_signature_example, do_not_specialize=["seed"])
    assert [p.is_constexpr for p in fn.params] == [p.is_constexpr for p in FakeJIT.params]
    bind = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return lambda args, kwargs: str(bind(*args, **kwargs)[1:])


def test_two_calls_share_a_key_only_when_triton_specialises_them_alike(fake):
    """Launcher.key (one generated function per tuple of argument types) against Triton's own
    binder: calls with one key always get one compiled kernel from Triton; calls whose values
    change only what Triton passes at launch (a free int, a float, a tensor's address) share a
    key, however they are ordered; calls of other argument types get keys of their own."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    _, lau = fake
    specialise = triton_specialisation()
    x = torch.zeros(8)
    base = (x, 64, 7, 0.5, None, 1.5)
    variants = [base, (x[1:],) + base[1:], (x.half(),) + base[1:], (torch.zeros(4),) + base[1:],
                (torch.nn.Parameter(torch.zeros(8)),) + base[1:],  # same dtype and alignment as x
                base[:1] + (1,) + base[2:], base[:1] + (True,) + base[2:], base[:2] + (1 << 40,) + base[3:],
                base[:2] + (-5,) + base[3:], base[:3] + (0.25,) + base[4:], base[:4] + (3,) + base[5:],
                base[:5] + (2.5,), base[:5] + (True,), base[:5] + (1,)]
    descriptors = [TensorDescriptor.from_tensor(t, [n]) for t, n in (
        (torch.zeros(64), 16), (torch.zeros(128), 16), (torch.zeros(64), 32), (torch.zeros(64).half(), 16))]
    variants += [(d,) + base[1:] for d in descriptors]  # host TMA descriptors (14 to 17)
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    swizzled = gl.NVMMASharedLayout.get_default_for([16, 32], gl.float32)
    plain = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    variants += [(GluonDescriptor.from_tensor(t, [16, 32], layout),) + base[1:] for t, layout in (
        (torch.zeros(64, 32), swizzled), (torch.zeros(128, 32), swizzled), (torch.zeros(64, 32), plain))]  # 18-20
    kwargs = ({"BLOCK": 32}, {"BLOCK": 64}, {"BLOCK": 32, "num_warps": 8})
    alike = [{0, 3, 8, 9},  # base, another aligned float32 tensor, another 32-bit seed, another scale
             {14, 15},  # descriptors of one dtype and block shape over tensors of other sizes
             {18, 19}]  # Gluon's: the same, and of one shared-memory layout
    calls = [(v, kw) for v in range(len(variants)) for kw in kwargs]
    keys = [lau.key(0, variants[v], kw) for v, kw in calls]
    assert None not in keys
    for i, (v, kw) in enumerate(calls):
        for j, (w, kw_w) in enumerate(calls):
            if keys[i] == keys[j]:
                assert specialise(variants[v], kw) == specialise(variants[w], kw_w), (variants[v], variants[w])
            expected = kw == kw_w and (v == w or any({v, w} <= group for group in alike))
            assert (keys[i] == keys[j]) == expected, (variants[v], variants[w])
    assert lau.key(0, (x, 64, 9, 0.25, None, 1.5), {"BLOCK": 32}) == keys[0]  # a free int, a float
    assert lau.key(0, (x, 64, 7, 0.5, object(), 1.5), {}) is None  # a type the key does not model
    assert lau.key(0, base + (1, 2, 3), {}) is None  # more arguments than parameters


def test_an_unknown_argument_type_or_a_launch_hook_always_goes_through_triton(fake, monkeypatch):
    fn, lau = fake
    for _ in range(2):
        lau[(1,)](torch.zeros(8), 64, 7, 0.5, object(), 1.5, BLOCK=32)
    assert kinds(fn) == ["triton", "triton"]
    args = (torch.zeros(8), 64, 7, 0.5, None, 1.5)
    lau[(1,)](*args, BLOCK=32)
    monkeypatch.setattr(lau, "_knobs", SimpleNamespace(launch_enter_hook=print, launch_exit_hook=None))
    lau[(1,)](*args, BLOCK=32)
    monkeypatch.setattr(lau, "_knobs", SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]),
                                                         launch_exit_hook=None))  # an empty HookChain
    lau[(1,)](*args, BLOCK=32)
    assert kinds(fn) == ["triton", "triton", "triton", "triton", "direct"]


@pytest.mark.parametrize("knob", [None, "0"])
def test_a_compiled_module_launches_its_host_kernels_through_launchers_direct_unless_switched_off(
        knob, tmp_path, monkeypatch):
    runtime._triton(for_cpu=True)
    if knob is not None:
        monkeypatch.setenv("ATTNCC_DIRECT_LAUNCH", knob)
    path = tmp_path / f"host_kernels_{knob}.py"
    path.write_text("from types import SimpleNamespace as N\n"
                    "kernel = N(params=[N(name='X', is_constexpr=False, do_not_specialize=False, default=None)])\n"
                    "helper = object()\n"
                    "HOST_KERNELS = ('kernel',)\n")
    module = runtime.load(path, interpret=False)
    assert isinstance(module.kernel, launcher.Launcher)  # always: it also picks the GPU
    assert module.kernel._direct == (knob is None)
    assert not isinstance(module.helper, launcher.Launcher)
    assert not isinstance(runtime.load(tmp_path.joinpath(path.name), interpret=True).kernel, launcher.Launcher)


def test_the_key_table_starts_over_when_full(fake, monkeypatch):
    fn, lau = fake
    monkeypatch.setattr(launcher, "MAX_KEYS", 3)
    x = torch.zeros(8)
    for n in (16, 32, 48, 64, 16):  # the fourth key clears the table: 16 is new again
        lau[(1,)](x, n, 7, 0.5, None, 1.5, BLOCK=32)
    assert kinds(fn) == ["triton"] * 5
    lau[(1,)](x, 16, 7, 0.5, None, 1.5, BLOCK=32)
    assert kinds(fn) == ["triton"] * 5 + ["direct"]


def test_a_launcher_whose_direct_launch_is_refused_falls_back_to_triton_for_good(fake, caplog):
    fn, lau = fake

    def refuse(*a):  # as a compiled kernel of a Triton whose launcher takes other arguments
        fn.log.append(("refused", a))
        raise TypeError("function takes exactly 12 arguments")
    fn.kernel.run = refuse
    args = (torch.zeros(8), 64, 7, 0.5, None, 1.5)
    for _ in range(3):
        lau[(1,)](*args, BLOCK=32)
    assert kinds(fn) == ["triton", "refused", "triton", "triton"]
    assert "direct launch" in caplog.text


class OnGPU(torch.Tensor):
    """A CPU tensor that reports living on GPU ``index`` (as get_device() does for CUDA tensors)."""
    index = 1

    def get_device(self):
        return self.index


@pytest.mark.parametrize("index", [1, 0])
def test_a_launch_runs_on_the_gpu_of_its_first_argument(fake, monkeypatch, index):
    fn, lau = fake
    entered = []

    @contextlib.contextmanager
    def device(i):
        entered.append(i)
        fn.log.append(("on", i))
        yield
    monkeypatch.setattr(launcher.torch.cuda, "device", device)
    monkeypatch.setattr(OnGPU, "index", index)
    x = torch.zeros(8).as_subclass(OnGPU)
    for _ in range(2):
        lau[(1,)](x, 64, 7, 0.5, None, 1.5, BLOCK=32)
    # the current device is 0 (the fixture): a tensor on GPU 1 switches there for each launch
    assert kinds(fn) == (["on", "triton", "on", "direct"] if index == 1 else ["triton", "direct"])
    assert entered == [index] * 2 * (index == 1)
