"""Load generated kernel modules and launch them: compiled on CUDA, interpreted on CPU."""
from __future__ import annotations

import linecache
import os
import sys
import time
import types
from pathlib import Path

import torch

from . import cache, config, launcher
from .errors import AttnccError
from .spec import sm
from .log import logger

_modules: dict = {}


def _triton(for_cpu: bool):
    """Import triton. CPU tensors need its interpreter, which triton only sets up when
    TRITON_INTERPRET=1 before its import; on a machine without CUDA (or with ATTNCC_INTERPRET=1)
    attncc turns it on when it is the first to import triton."""
    if "triton" not in sys.modules and (config.force_interpreter() or (for_cpu and not torch.cuda.is_available())):
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    if not interpreting(triton):
        cache.remember_triton_key(triton)
    return triton


def interpreting(triton) -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs.runtime.interpret) if knobs else os.environ.get("TRITON_INTERPRET") == "1"


_targets: dict = {}  # device -> its target, once known (read on every call: kept cheap)


def target_for(device: torch.device) -> str:
    """'cuda-smXY' for CUDA tensors; 'interpreter' for CPU tensors, and for every tensor when
    the Triton interpreter is on (TRITON_INTERPRET=1 or ATTNCC_INTERPRET=1)."""
    target = _targets.get(device)
    if target is None:
        target = _targets[device] = _find_target(device)
    return target


def _find_target(device: torch.device) -> str:
    if device.type not in ("cpu", "cuda"):
        raise AttnccError(f"attncc runs on CUDA GPUs and on the CPU (through the Triton interpreter), "
                          f"not on {device.type} tensors; move the inputs with .cuda() or .cpu()")
    triton = _triton(for_cpu=device.type == "cpu")
    if interpreting(triton):
        return "interpreter"
    if device.type == "cpu":
        raise AttnccError(
            "CPU tensors run through the Triton interpreter, which must be switched on before triton "
            "is imported: start Python with TRITON_INTERPRET=1 (every attncc kernel then runs "
            "interpreted), or move the tensors to the GPU with .cuda()")
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda-sm{major}{minor}"


TMA_MAX_BLOCK = 256  # a tensor descriptor's box is at most 256 elements along each dim


def descriptor_modes(target: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """(Spec.tma, Spec.ws) of a forward call: config.tma() and config.ws() ("auto" or "on") on a
    GPU with TMA (sm90+), "on" in the interpreter only when forced, for tensors TMA can address
    (unit stride along the head dim, 16-byte aligned start and other strides, head dims within
    one box, no empty dim: K and V for TMA, also Q and the output for the warp-specialised loop);
    else "off"."""
    tma, ws = config.tma(), config.ws()
    if target == "interpreter":
        tma, ws = (m if m == "on" else "off" for m in (tma, ws))
    elif sm(target) < 90:
        return "off", "off"
    if tma == ws == "off":
        return tma, ws
    if not (_addressable(k) and _addressable(v)):
        return "off", "off"
    # the output (allocated in q's layout, attncc.runtime.forward) is a descriptor too: its
    # strides are multiples of the value head dim
    return tma, ws if _addressable(q) and v.shape[-1] * v.element_size() % 16 == 0 else "off"


def _addressable(t: torch.Tensor) -> bool:
    *outer, last = t.stride()
    if last != 1 or t.data_ptr() % 16 or t.shape[-1] > TMA_MAX_BLOCK or t.numel() == 0:
        return False
    size = t.element_size()
    for s in outer:  # a loop, not any(<generator>): this runs on every call (host time)
        if s * size % 16:
            return False
    return True


def load(path: Path, interpret: bool, text: str | None = None):
    """The generated module at ``path`` (once per process); @triton.jit becomes the interpreter
    if asked. ``text`` is the file's content as attncc.cache verified it: exactly that text runs
    (the file is not read again, so it may change or vanish meanwhile), and Triton reads the
    kernels' source from it too (through linecache). Without ``text`` the file is read, for
    callers that vouch for it. Compiled modules launch their HOST_KERNELS through
    attncc.launcher (on the inputs' GPU, with less host time)."""
    key = (str(path), interpret)
    module = _modules.get(key)
    if module is None:
        start = time.perf_counter()
        if text is None:
            text = path.read_text()
        name = f"attncc_generated.{path.stem}{'_interp' if interpret else ''}"
        module = types.ModuleType(name)
        module.__file__ = str(path)
        # inspect.getsourcelines (Triton's @jit) finds the text here even if the file is gone; an
        # entry without mtime is never checked against the file (linecache.checkcache)
        linecache.cache[str(path)] = (len(text), None, text.splitlines(keepends=True), str(path))
        sys.modules[name] = module
        try:
            exec(compile(text, str(path), "exec", dont_inherit=True), module.__dict__)  # not runtime.py's __future__ flags
        except Exception as e:
            sys.modules.pop(name, None)
            raise AttnccError(
                f"the kernel file {path} does not load ({type(e).__name__}: {e}). If it is your edited copy "
                "(ATTNCC_OVERRIDE_DIR), fix or remove it; else this is a bug in attncc, please report it with "
                "the file") from e
        launcher.wrap(module, direct=config.direct_launch(), interpret=interpret)
        _modules[key] = module
        logger.debug("loaded %s in %.1f ms", path.name, 1e3 * (time.perf_counter() - start))
    return module


_launched: set = set()  # names of generated modules whose kernels have run once in this process


def launch(module, *args, **kwargs):
    """``module.launch(...)``. Triton compiles a module's kernels on their first launch, so that
    launch is timed and logged (INFO); later launches of the module are not timed. Triton's
    failure to compile or interpret generated code (never the user's inputs, which attncc checks
    before it generates anything) becomes a RuntimeError naming the file."""
    name = module.__name__.rpartition(".")[2]
    try:
        if name in _launched:
            return module.launch(*args, **kwargs)
        start = time.perf_counter()
        result = module.launch(*args, **kwargs)
    except Exception as e:
        import triton.errors
        if not isinstance(e, triton.errors.TritonError) or type(e).__name__ == "OutOfResources":
            raise  # out of resources: autograd.with_fallback retries with smaller tiles
        try:
            first = (str(e).strip().splitlines() or [""])[-1]
        except Exception:  # an exception whose __str__ fails
            first = repr(e)
        raise RuntimeError(
            f"Triton could not {'run' if name.endswith('_interp') else 'compile'} the generated kernel file "
            f"{getattr(module, '__file__', name)} ({type(e).__name__}: {first}). This is a bug in attncc "
            "(or an edit to that file in the kernel cache); please report it with the file and the mods.") from e
    _launched.add(name)
    seconds = time.perf_counter() - start
    fns = ", ".join(getattr(module, "TILES", {})) or "kernels"
    if name.endswith("_interp"):
        logger.info("first launch of %s (%s) in %.2f s in the Triton interpreter (nothing to compile)",
                    name, fns, seconds)
    else:
        logger.info("compiled %s (%s) in %.2f s (first launch: Triton compile + launch)", name, fns, seconds)
    return result


def _like_query_layout(q: torch.Tensor, dv: int, dtype) -> torch.Tensor:
    """Output (B, H, L, Dv) in the memory order of q: a transposed (B, L, H, D) q gets a
    transposed (B, L, H, Dv) output, so a following .transpose(1, 2) is free."""
    B, H, L, _ = q.shape
    if q.stride(1) < q.stride(2) and H > 1 and L > 1:
        return torch.empty(B, L, H, dv, dtype=dtype, device=q.device).transpose(1, 2)
    return torch.empty(B, H, L, dv, dtype=dtype, device=q.device)


def forward(module, q, k, v, captures, scale, interpret: bool, rng=(), blocks=None):
    """out (B, H, Lq, Dv) in q's dtype and lse (B, H, Lq) float32 from a generated fwd module."""
    B, H, Lq, _ = q.shape
    out = _like_query_layout(q, v.shape[-1], q.dtype)
    lse = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    if interpret and q.dtype == torch.bfloat16:
        # The interpreter computes on bf16's raw bits; run in float32 and round once at the end.
        q, k, v = q.float(), k.float(), v.float()
        tmp = _like_query_layout(q, v.shape[-1], torch.float32)
        launch(module, q, k, v, tmp, lse, interp_captures(captures), scale, *rng, blocks=blocks)
        out.copy_(tmp)
        return out, lse
    launch(module, q, k, v, out, lse, interp_captures(captures) if interpret else captures, scale, *rng,
           blocks=blocks)
    return out, lse


def interp_captures(captures):
    return [c.float() if c.dtype == torch.bfloat16 else c for c in captures]


FIXED_POINT = 2.0 ** 32  # deterministic capture gradients: int64 in steps of 2**-32


def backward(module, q, k, v, out, lse, dout, dlse, captures, learnable, scale, interpret: bool, rng=(),
             deterministic=False, blocks=None):
    """dq, dk, dv and float32 gradients of the learnable captures from a generated bwd module."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if dlse is not None:
        dlse = dlse.contiguous()  # read as (B, H, Lq) rows; lse.sum() hands back an expanded view
    acc = torch.int64 if deterministic else torch.float32
    dcaps = [torch.zeros(captures[i].shape, dtype=acc, device=q.device) for i in learnable]
    if dq.numel() == 0 and dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dcaps
    if interpret:
        captures = interp_captures(captures)
        if q.dtype == torch.bfloat16:
            # The interpreter computes on bf16's raw bits: run in float32, round once at the end.
            f = [t.float() for t in (q, k, v, out, dout)]
            g = [torch.empty_like(t) for t in f[:3]]
            launch(module, *f[:4], lse, f[4], dlse, *g, captures, dcaps, scale, *rng, blocks=blocks)
            return g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype), _float_grads(dcaps)
    launch(module, q, k, v, out, lse, dout, dlse, dq, dk, dv, captures, dcaps, scale, *rng, blocks=blocks)
    return dq, dk, dv, _float_grads(dcaps)


def _float_grads(dcaps):
    return [d if d.is_floating_point() else (d.double() / FIXED_POINT).float() for d in dcaps]


def draw_rng(generator=None) -> tuple[int, int]:
    """(seed, offset) for one dropout call, from torch's default generator or ``generator``:
    torch.manual_seed reproduces them and every call draws new ones."""
    gen = generator if generator is not None else torch.default_generator
    seed, offset = torch.randint(0, 2**31 - 1, (2,), generator=gen, device=gen.device).tolist()
    return seed, offset
