"""KernelPlan: the one frozen object a template sees, built from a variant's analysis and a Spec."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from . import __version__, printer
from .passes.symbolic import KV, SCORE
from .variant import Analysis


@dataclass(frozen=True)
class Spec:
    """What a kernel is specialised on: everything else (B, lengths, strides, scale) is runtime."""
    dtype: str        # "float16" | "bfloat16" | "float32"
    head_dim: int
    head_dim_v: int
    group: int        # query heads per K/V head (1: MHA)
    target: str       # "interpreter" or "cuda-sm90" etc.


@dataclass(frozen=True)
class CaptureArg:
    """Kernel arguments of one captured tensor: pointer, then (size, stride) per dimension."""
    index: int
    ndim: int
    kind: str
    describe: str

    @property
    def name(self):
        return f"cap{self.index}"

    @property
    def args(self):
        dims = [f"cap{self.index}_size{d}, cap{self.index}_stride{d}" for d in range(self.ndim)]
        return [f"cap{self.index}_ptr"] + dims

    @property
    def host_args(self):
        c = self.name
        return [c] + [f"{c}.shape[{d}], {c}.stride({d})" for d in range(self.ndim)]

    @property
    def size_args(self):
        return [f"cap{self.index}_size{d}" for d in range(self.ndim)]


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class KernelPlan:
    kernel: str
    name: str
    attncc_version: str
    target: str
    dtype: str
    head_dim: int
    head_dim_v: int
    block_d: int
    block_dv: int
    group: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dot_precision: str
    score_text: str
    mask_text: str
    score_identity: bool
    score_value: str
    mods: printer.ModCode
    captures: tuple

    @property
    def runtime_ints(self):
        """Integer arguments Triton must not specialise on, so new lengths never recompile."""
        return ["N_CTX_Q", "N_CTX_KV"] + [s for c in self.captures for s in c.size_args]


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def choose_tiles(kernel: str, spec: Spec) -> Tiles:
    """Tile shape, warps and pipeline depth for a kernel on a target."""
    if spec.target == "interpreter":
        return Tiles(32, 32, 1, 1)  # small tiles keep several tiles and ragged edges in tests
    d = max(_pow2(spec.head_dim), _pow2(spec.head_dim_v))
    fp32 = spec.dtype == "float32"
    if d <= 64:
        return Tiles(128, 64, 4, 3) if not fp32 else Tiles(64, 32, 4, 2)
    if d <= 128:
        return Tiles(128, 64, 8, 3) if not fp32 else Tiles(64, 32, 4, 2)
    return Tiles(64, 32, 4, 2) if not fp32 else Tiles(32, 32, 4, 1)


def _score_value(score: sp.Expr) -> str:
    """The score_mod result as a float [BLOCK_M, BLOCK_N] tile."""
    if SCORE not in score.free_symbols:
        return "(score_mod + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))"
    if score.is_integer:
        return "score_mod.to(tl.float32)"
    return "score_mod"


def _label(cap, i) -> str:
    """A readable Python name for a capture's loads in generated code."""
    name = getattr(cap, "name", None)
    return name if name and name.isidentifier() and not name.startswith("cap") and len(name) < 24 else f"cap{i}_"


def _describe(i, ndim, kind, cap, facts) -> str:
    users = [n for n, caps in (("score_mod", facts.captures_in_score), ("mask_mod", facts.captures_in_mask))
             if i in caps]
    label = f"`{cap.name}` " if cap is not None and cap.name else ""
    return f"{label}{kind} tensor, {ndim}-d, read by {' and '.join(users) or 'nothing'}"


def build(kernel: str, analysis: Analysis, spec: Spec, name: str, captures=()) -> KernelPlan:
    """The plan for one kernel ('fwd') of a variant under a specialisation."""
    f = analysis.facts
    score = None if f.score_identity else analysis.score
    keep = None if f.mask_trivial else analysis.mask
    labels = [_label(captures[i] if i < len(captures) else None, i) for i in range(len(analysis.captures))]
    mods = printer.emit(score, keep, tuple((nd, kind, lab) for (nd, kind), lab in zip(analysis.captures, labels)),
                        loop_symbols={KV})
    tiles = choose_tiles(kernel, spec)
    caps = tuple(
        CaptureArg(i, nd, kind, _describe(i, nd, kind, captures[i] if i < len(captures) else None, f))
        for i, (nd, kind) in enumerate(analysis.captures))
    return KernelPlan(
        kernel=kernel, name=name, attncc_version=__version__, target=spec.target, dtype=spec.dtype,
        head_dim=spec.head_dim, head_dim_v=spec.head_dim_v,
        block_d=_pow2(spec.head_dim), block_dv=_pow2(spec.head_dim_v), group=spec.group,
        block_m=tiles.block_m, block_n=tiles.block_n, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        dot_precision="ieee" if spec.dtype == "float32" else "tf32",
        score_text=str(analysis.score), mask_text=str(analysis.mask),
        score_identity=f.score_identity, score_value=_score_value(analysis.score),
        mods=mods, captures=caps)
