"""attncc.toolchain: which ptxas a module's kernels are assembled with (ATTNCC_PTXAS).

The toolkits are stand-ins (ptxas versions and a driver version patched in); that a newer
ptxas's cubins run and are faster is for the GPU (benchmarks/gluon/gluon_bwd_probe.py's
ptxas=PATH patch, tests/test_gpu_gluon.py under the choice auto makes)."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from attncc import launcher, runtime, toolchain
from attncc.errors import AttnccError

VERSIONS = {"/triton/ptxas": (12, 8), "/cuda-12.6/ptxas": (12, 6), "/cuda-13.0/ptxas": (13, 0),
            "/cuda-13.2/ptxas": (13, 2)}


@pytest.fixture
def kits(monkeypatch):
    """Triton's ptxas 12.8, toolkits 12.6, 13.0 and 13.2 installed, a driver of CUDA 13.0."""
    runtime._triton(for_cpu=True)
    toolchain.choose.cache_clear()
    tools = {p: toolchain.Ptxas(p, v) for p, v in VERSIONS.items()}
    monkeypatch.setattr(toolchain, "_tool", tools.get)
    monkeypatch.setattr(toolchain, "_triton_own", lambda: tools["/triton/ptxas"])
    monkeypatch.setattr(toolchain, "_candidates", lambda: ["/cuda-12.6/ptxas", "/cuda-13.0/ptxas", "/cuda-13.2/ptxas"])
    driver = SimpleNamespace(version=(13, 0))
    monkeypatch.setattr(toolchain, "driver_version", lambda: driver.version)
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.delenv("ATTNCC_PTXAS", raising=False)
    yield driver
    toolchain.choose.cache_clear()


def test_auto_takes_the_newest_ptxas_the_driver_runs(kits):
    assert toolchain.choose("auto", None).path == "/cuda-13.0/ptxas"  # 13.2's cubins need a newer driver
    toolchain.choose.cache_clear()
    kits.version = (13, 2)
    assert toolchain.choose("auto", None).path == "/cuda-13.2/ptxas"
    toolchain.choose.cache_clear()
    kits.version = (12, 9)  # nothing newer than Triton's that the driver runs
    assert toolchain.choose("auto", None) is None
    toolchain.choose.cache_clear()
    kits.version = None  # no driver (a CPU machine)
    assert toolchain.choose("auto", None) is None


def test_triton_and_the_users_triton_ptxas_path_keep_tritons(kits):
    assert toolchain.choose("triton", None) is None
    assert toolchain.choose("auto", "/my/ptxas") is None


def test_a_path_is_taken_as_given_and_a_wrong_one_is_named(kits):
    assert toolchain.choose("/cuda-12.6/ptxas", None).version == (12, 6)
    with pytest.raises(AttnccError, match="ATTNCC_PTXAS='/nowhere/ptxas' is not a ptxas.*auto.*triton"):
        toolchain.choose("/nowhere/ptxas", None)


@pytest.mark.parametrize("value, want", [("", "auto"), ("AUTO", "auto"), (" triton ", "triton"),
                                         ("/opt/cuda/bin/ptxas", "/opt/cuda/bin/ptxas")])
def test_the_knob(monkeypatch, value, want):
    from attncc import config
    monkeypatch.setenv("ATTNCC_PTXAS", value)
    assert config.ptxas() == want


@pytest.mark.parametrize("before", [None, "/elsewhere"])
def test_compiling_sets_the_ptxas_and_a_cache_of_its_own_and_restores_both(kits, monkeypatch, before):
    from triton import knobs
    if before is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", before)
    cache = knobs.cache.dir
    module = SimpleNamespace(PTXAS="newest")
    tool = toolchain.for_module(module)
    with toolchain.compiling(tool):
        assert os.environ["TRITON_PTXAS_PATH"] == "/cuda-13.0/ptxas"
        assert os.environ["TRITON_CACHE_DIR"] == os.path.join(cache, "ptxas-13.0")
    assert "TRITON_PTXAS_PATH" not in os.environ
    assert os.environ.get("TRITON_CACHE_DIR") == before
    with pytest.raises(ZeroDivisionError), toolchain.compiling(tool):  # restored after an error too
        1 / 0
    assert "TRITON_PTXAS_PATH" not in os.environ
    assert toolchain.for_module(SimpleNamespace()) is None  # modules that do not ask
    assert toolchain.for_module(SimpleNamespace(PTXAS="triton")) is None
    monkeypatch.setenv("ATTNCC_PTXAS", "triton")
    assert toolchain.for_module(module) is None


def test_a_ptxas_that_fails_on_a_kernel_gives_way_to_tritons(kits, monkeypatch, caplog):
    """A PTXASError under the newer ptxas: the launch runs again under Triton's, which every later
    compile of the process keeps; other errors propagate."""
    PTXASError = type("PTXASError", (Exception,), {})
    seen = []

    def run():
        seen.append(os.environ.get("TRITON_PTXAS_PATH"))
        if seen[-1] is not None:
            raise PTXASError("ptxas fatal: exited with status -11")
        return "kernel"

    monkeypatch.setattr(toolchain, "_refused", set())
    module = SimpleNamespace(PTXAS="newest", __file__="bwd_x.py")
    with caplog.at_level("WARNING", logger="attncc"):
        assert toolchain.launch(module, run) == "kernel"
    assert seen == ["/cuda-13.0/ptxas", None]
    assert "failed on bwd_x.py (ptxas fatal: exited with status -11)" in caplog.text
    assert toolchain.launch(module, run) == "kernel" and seen[2:] == [None]  # Triton's from now on
    monkeypatch.setattr(toolchain, "_refused", set())
    with pytest.raises(ZeroDivisionError):
        toolchain.launch(module, lambda: 1 / 0)


def test_launchers_compile_the_module_with_its_ptxas(kits, monkeypatch):
    """Triton's launch (which compiles) runs under the module's ptxas; a direct relaunch needs none."""
    seen = []

    class Kernel:
        function = packed_metadata = None

        def run(self, *a):
            seen.append(("direct", os.environ.get("TRITON_PTXAS_PATH")))

    class JIT:
        params = [SimpleNamespace(name="X", is_constexpr=False, do_not_specialize=False, default=None)]

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                seen.append(("triton", os.environ.get("TRITON_PTXAS_PATH")))
                return Kernel()
            return run

    for asks, want in (("newest", "/cuda-13.0/ptxas"), ("triton", None)):
        seen.clear()
        module = SimpleNamespace(HOST_KERNELS=("k",), k=JIT(), PTXAS=asks)
        launcher.wrap(module)
        monkeypatch.setattr(module.k, "device_and_stream", lambda: (0, None))
        monkeypatch.setattr(module.k, "_knobs", SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
        module.k[(1,)](3)
        module.k[(1,)](3)
        assert seen == [("triton", want), ("direct", None)]


def test_the_gluon_backward_asks_for_the_newest_and_the_forward_does_not():
    root = os.path.join(os.path.dirname(__file__), "..", "templates", "sm90")
    assert 'PTXAS = "newest"' in open(os.path.join(root, "bwd_launch.py.jinja")).read()
    assert "PTXAS" not in open(os.path.join(root, "fwd_launch.py.jinja")).read()


def test_tritons_own_ptxas_is_found():
    """The real lookups (Triton's wheel bundles a ptxas for the CPU machine too)."""
    runtime._triton(for_cpu=True)
    own = toolchain._triton_own()
    assert own is not None and own.path.endswith("ptxas") and own.version >= (12, 0)
    assert toolchain._tool("/nowhere/ptxas") is None
    assert all(p.endswith("ptxas") for p in toolchain._candidates())
