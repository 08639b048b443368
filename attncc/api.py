"""The public entry points: attncc.compile(variant) and attncc.attention(q, k, v, ...)."""
from __future__ import annotations

import dataclasses
import sys
import threading

import torch

from . import autograd, cache, codegen, config, inference, ir, runtime, tiers, toolchain
from .checks import MAX_HEAD_DIM
from .errors import AttnccError
from .log import logger
from .spec import Spec, sm
from .variant import Variant, check_dropout

KERNELS = tuple(codegen.TEMPLATES)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# (variant IR key, kernel, spec) -> (source path, loaded module): shared by every CompiledAttention
_loaded: dict = {}
_generating = threading.RLock()  # held while a kernel is found or generated and loaded


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype) or getattr(torch, dtype, None)
    if dtype not in _DTYPE_NAMES:
        raise AttnccError(f"unsupported dtype {dtype}; attncc supports float16, bfloat16 and float32")
    return _DTYPE_NAMES[dtype]


class CompiledAttention:
    """A variant ready to run: specialises lazily per dtype, head dims, GQA group and device.

    Call it like attncc.attention without the mods: ``kernel(q, k, v, enable_gqa=False,
    return_lse=False)``. ``source(...)`` returns generated Triton code, ``explain()`` the
    IR, simplified expressions and derived facts.
    """

    def __init__(self, variant: Variant):
        if not isinstance(variant, Variant):
            raise AttnccError(f"attncc.compile takes an attncc.Variant, got {type(variant).__name__}; "
                              "build one with attncc.Variant(score_mod, mask_mod)")
        self.variant = variant
        self._bwd_specs: dict = {}  # (forward Spec, learnable, deterministic, atomic dQ, tier, long) -> backward Spec
        # call signature -> autograd.Decision: what the checks and decisions of such a call
        # concluded (the Specs of the kernels that launched); a cache, left out of copies
        self._calls: dict = {}
        autograd.register(self)  # the attention op finds it by the variant's key

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_calls"] = {}  # a cache of this process: a copy decides afresh
        return state

    def __repr__(self):
        return f"CompiledAttention({self.variant!r})"

    def module(self, kernel: str, spec: Spec):
        """The loaded generated module of one kernel ('fwd' or 'bwd') under a Spec."""
        return self._path_and_module(kernel, spec)[1]

    def classifier(self, spec: Spec):
        """The module whose block_classes kernel sorts a data-dependent mask's tiles into the lists
        that drive the kernels of either tier (attncc.blocks): the Triton tier's forward."""
        return self.module("fwd", dataclasses.replace(spec, tier="triton", offsets=False))

    def bwd_spec(self, fwd_spec: Spec, learnable: tuple, deterministic: bool = False, kv_len: int | None = None
                 ) -> Spec:
        """The backward's Spec: the forward's plus which captures need gradients (and the tier,
        which may depend on whether ``kv_len`` keys are long enough for the Gluon backward)."""
        sparse = bool(self.variant.analysis.facts.captures_in_mask)
        long = tiers.long_enough(fwd_spec.head_dim, fwd_spec.group, kv_len, sparse)
        key = (fwd_spec, tuple(learnable), deterministic, config.atomic_dq(), config.tier(), long)
        spec = self._bwd_specs.get(key)
        if spec is None:
            spec = self._bwd_specs[key] = self._new_bwd_spec(fwd_spec, learnable, deterministic, kv_len)
        return spec

    def _new_bwd_spec(self, fwd_spec: Spec, learnable: tuple, deterministic: bool, kv_len: int | None) -> Spec:
        for i in learnable:
            if self.variant.captures[i].kind != ir.FLOAT:
                raise AttnccError(f"captured tensor cap{i} ({self.variant.captures[i]!r}) requires grad but is "
                                  "not a float tensor; integer and bool captures are never differentiated")
        atomic = config.atomic_dq() and not deterministic
        tier, why = tiers.choose_backward(self.variant, fwd_spec, tuple(learnable), deterministic, kv_len)
        logger.debug("backward tier of %s: %s (%s)", self.variant, tier, why)
        return dataclasses.replace(fwd_spec, learnable=tuple(learnable), atomic_dq=atomic,
                                   deterministic=bool(deterministic and learnable), tma="off", ws="off",
                                   positive_scale=True, tiles=(), tier=tier)  # only the forward folds the scale

    def _path_and_module(self, kernel: str, spec: Spec):
        """(kernel file, loaded module) of one kernel under a Spec: found in this process, else
        loaded from the cache or generated (one thread at a time: each file is imported once)."""
        k = (self.variant.ir_key, kernel, spec)
        hit = _loaded.get(k)
        if hit is None:
            with _generating:
                hit = _loaded.get(k)
                if hit is None:
                    path, text = self._source(kernel, spec)  # verified text: what runs, whatever the file does next
                    hit = _loaded[k] = (path, runtime.load(path, spec.target == "interpreter", text))
        return hit

    def _source(self, kernel: str, spec: Spec) -> tuple:
        """(kernel file, its verified text) from the cache, generated first if missing."""
        v = self.variant
        found = cache.lookup_alias(kernel, v.ir_key, spec)  # a warm process skips the sympy passes
        if found is None:
            canonical = cache.source_path(kernel, v.analysis.key, spec)
            from . import plan  # sympy and the passes: only when a kernel is generated
            found = cache.kernel_source(canonical, lambda: codegen.render(
                plan.build(kernel, v.analysis, spec, v.captures)))
            cache.write_alias(kernel, v.ir_key, spec, canonical)
        return found

    def __call__(self, query, key, value, enable_gqa: bool = False, return_lse: bool = False, *,
                 training: bool = True, generator=None):
        """Attention of the variant; ``training=False`` turns dropout off (evaluation).

        Under torch.compile a call is one ``attncc::attention`` op (no graph break; see autograd.py).
        Without gradients, a few queries (<= 16) over many keys (>= 256) take the split-KV
        decode kernel instead (outside torch.compile)."""
        captures = [c.tensor for c in self.variant.captures]
        if inference.use_decode(query, key, value, training and self.variant.dropout_p > 0, captures):
            return inference.decode(self, query, key, value, enable_gqa, return_lse)
        out, lse = autograd.attend(self, query, key, value, captures,
                                   enable_gqa=enable_gqa, training=training, generator=generator)
        return (out, lse) if return_lse else out

    def context_parallel(self, query, key, value, *, group=None, layout="zigzag", method="auto",
                         enable_gqa=False, return_lse=False, training=True, generator=None):
        """Context parallelism: query, key, value are this rank's shards of a sequence split over
        ``group``'s ranks (attncc.distributed.shard with the same ``layout``); returns this rank's
        rows of attention over the whole sequence, differentiable. method: "ring", "allgather" or
        "auto" (a cost model, logged). Every rank of the group must call it. See attncc.distributed.
        Under torch.compile it runs eagerly (collectives and host-side schedules: a graph break)."""
        from .distributed.attention import context_parallel
        return _outside_dynamo(context_parallel, self, query, key, value, group=group, layout=layout, method=method,
                               enable_gqa=enable_gqa, return_lse=return_lse, training=training, generator=generator)

    def with_kvcache(self, query, cache, key=None, value=None, *, cu_seqlens_q=None, max_seqlen_q=None,
                     return_lse=False):
        """Inference against a KV cache (attncc.KVCache or attncc.PagedKVCache): append ``key`` and
        ``value`` (the queries' own tokens, when given), then attend. query (B, Lq, Hq, D), or
        packed (total, Hq, D) with cu_seqlens_q; the mods see query i of a sequence of length L
        at q_idx = L - Lq + i. Split-KV decoding when Lq is small. Forward only."""
        return inference.with_kvcache(self, query, cache, key, value, cu_seqlens_q=cu_seqlens_q,
                                      max_seqlen_q=max_seqlen_q, return_lse=return_lse)

    def varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, *,
               return_lse=False):
        """Ragged batches without padding (FlashAttention's varlen convention): query (total_q, Hq, D),
        key/value (total_kv, Hkv, D), sequence b at rows cu_seqlens[b]:cu_seqlens[b+1]. The mods see
        per-sequence positions (queries are the last Lq_b of Lkv_b tokens). Forward only."""
        return inference.varlen(self, query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
                                return_lse=return_lse)

    def source(self, kernel: str = "fwd", dtype=torch.bfloat16, head_dim: int = 128,
               head_dim_v: int | None = None, gqa: int = 1, target: str | None = None) -> str:
        """Generated Triton source of one kernel ('fwd') under a specialisation."""
        if kernel not in KERNELS:
            raise AttnccError(f"unknown kernel {kernel!r}; attncc generates {', '.join(KERNELS)}")
        dv = head_dim_v or head_dim
        limits = (inference.MAX_HEAD_DIM, inference.MAX_HEAD_DIM_V) if kernel == "kv" else (MAX_HEAD_DIM,) * 2
        if not (1 <= head_dim <= limits[0] and 1 <= dv <= limits[1]):
            raise AttnccError(f"head dims {head_dim} / {dv} are outside what the {kernel} kernel takes "
                              f"(query/key 1..{limits[0]}, value 1..{limits[1]})")
        if target is None:
            target = runtime.target_for(torch.device("cuda")) if torch.cuda.is_available() else "cuda-sm90"
        # what a call with TMA-addressable tensors runs there (runtime.descriptor_modes)
        modes = ("off", "off") if sm(target) < 90 else (
            config.tma(), config.ws())
        spec, _ = self._shown(kernel, _dtype_name(dtype), head_dim, dv, gqa, target, modes)
        return self._source(kernel, spec)[1]

    def tier(self, kernel: str = "fwd", dtype=torch.bfloat16, head_dim: int = 128, head_dim_v: int | None = None,
             gqa: int = 1, target: str | None = None) -> tuple[str, str]:
        """(tier, why) of the kernel ``source`` shows for the same arguments (attncc.tiers)."""
        if target is None:
            target = runtime.target_for(torch.device("cuda")) if torch.cuda.is_available() else "cuda-sm90"
        return self._shown(kernel, _dtype_name(dtype), head_dim, head_dim_v or head_dim, gqa, target, ("off", "off"))[1]

    def _shown(self, kernel, name, head_dim, dv, gqa, target, modes) -> tuple:
        """(Spec, (tier, why)) of what a call of unknown length runs there: the backward's without
        learnable captures; the inference kernels are the Triton tier's."""
        why = tiers.choose(self.variant, target, name, head_dim, dv, False) if kernel == "fwd" else (
            "triton", "the inference kernels are the Triton tier's")
        spec = Spec(name, head_dim, dv, gqa, target, tma=modes[0], ws=modes[1], tier=why[0])
        if kernel == "bwd":
            why = tiers.choose_backward(self.variant, spec, (), False)
            spec = dataclasses.replace(spec, tier=why[0])
        return spec, why

    def explain(self) -> str:
        """The IR, the simplified expressions and the derived facts, as text."""
        import sympy

        from .passes import bounds as bounds_pass
        from .passes import derive as derive_pass
        from .passes import symbolic
        v, a = self.variant, self.variant.analysis
        names = v.capture_names()
        lines = [f"attncc variant {v.name!r}", "", "IR (as traced):",
                 f"  score_mod = {ir.to_text(v.score_ir, names)}",
                 f"  mask_mod  = {'None' if v.mask_ir is None else ir.to_text(v.mask_ir, names)}",
                 "", "Simplified (sympy):", f"  score_mod = {a.score}", f"  mask_mod  = {a.mask}"]
        if v.captures:
            lines += ["", "Captured tensors (kernel arguments, read in place):"]
            lines += [f"  cap{i} = {c!r}" for i, c in enumerate(v.captures)]
        lines += ["", "Derived facts:"] + ["  " + s for s in a.facts.lines()]
        learnable = tuple(i for i, c in enumerate(v.captures) if c.kind == ir.FLOAT)
        grads = derive_pass.derive(a.score, learnable)
        lines += ["", "Backward (dS' = P * (dP - Delta), Delta = rowsum(dO * O) - dlse):",
                  f"  dS = dS' * ({grads.dscore})"]
        lines += [f"  d loss / d {g.load} += sum over (q_idx, kv_idx) of dS' * ({g.derivative})" for g in grads.loads]
        lines += ["", "Tile skipping:"]
        if a.facts.mask_trivial:
            lines += ["  no mask: every tile is computed, without mask code except at ragged edges"]
        elif a.facts.captures_in_mask:
            lines += ["  data-dependent mask: a generated block_classes kernel sorts tiles into empty, partial",
                      "  and full once per mask input; kernels visit partial and full tiles only"]
        else:
            lo, hi = sympy.symbols("q_lo q_hi", integer=True)
            tb = bounds_pass.derive(a.mask, symbolic.Q, symbolic.KV, lo, hi)
            lines += [f"  a Q tile [q_lo, q_hi] reaches keys [{tb.reach.first}, {tb.reach.last}]",
                      f"  and attends every key in [{tb.full.first}, {tb.full.last}] (those tiles run without mask code)"]
            row = bounds_pass.row_interval(a.mask, symbolic.Q, symbolic.KV)
            lines += [f"  query q_idx keeps exactly the keys [{row.first}, {row.last}]: the other tiles compare each key"
                      " with its row's ends" if row is not None else
                      "  the other tiles evaluate mask_mod per score (its keys per query are not one interval)"]
        lines += ["", f"scale = {v.scale if v.scale is not None else '1/sqrt(head_dim)'}, dropout_p = {v.dropout_p}"]
        lines += ["", "Kernel tier (attncc.tiers; ATTNCC_TIER=auto|triton|gluon):"]
        for d in (128, 64):
            tier, why = tiers.choose(v, "cuda-sm90", "bfloat16", d, d, v.dropout_p > 0)
            line = f"  forward, sm90, bfloat16, head dim {d}: {tier} ({why})"
            if tier == "triton" and tiers.gluon_pays(v, d) and config.tier() == "auto":
                longer = tiers.gluon_pays(v, d)
                tier, why = tiers.choose(v, "cuda-sm90", "bfloat16", d, d, v.dropout_p > 0, length=longer)
                line += f"; from {longer} queries and keys: {tier}" + (f" ({why})" if tier == "gluon" else "")
            lines.append(line)
            spec = Spec("bfloat16", d, d, 1, "cuda-sm90", v.dropout_p > 0, tier=tier)
            tier, why = tiers.choose_backward(v, spec, (), False)
            line = f"  backward, sm90, bfloat16, head dim {d}: {tier} ({why})"
            sparse = bool(v.analysis.facts.captures_in_mask)
            if tier == "triton" and tiers.gluon_bwd_pays(d, 1, sparse) and config.tier() == "auto":
                longer = tiers.gluon_bwd_pays(d, 1, sparse)
                tier, why = tiers.choose_backward(v, spec, (), False, longer)
                line += f"; from {longer} keys: {tier}" + (f" ({why})" if tier == "gluon" else "")
            lines.append(line)
        lines.append("  other GPUs, float32 and the interpreter: triton; inference kernels: triton")
        lines.append(f"  the Gluon backward's ptxas (attncc.toolchain; ATTNCC_PTXAS=auto|triton|PATH): {toolchain.describe()}")
        paths = [str(p) for (key, _, _), (p, _) in _loaded.items() if key == v.ir_key]
        lines += ["", "Generated kernels in this process:"] + (["  " + p for p in paths] or ["  (none yet)"])
        lines += [f"Kernel cache folder: {cache.folder()}"]
        return "\n".join(lines)




def compile(variant: Variant) -> CompiledAttention:
    """Prepare a variant for execution; kernels are generated on first use per specialisation."""
    return CompiledAttention(variant)


def attention(query, key, value, score_mod=None, mask_mod=None, *, scale=None, enable_gqa=False,
              return_lse=False, dropout_p=0.0, generator=None, deterministic=False):
    """FlashAttention with FlexAttention-style mods.

    query (B, Hq, Lq, D), key (B, Hkv, Lkv, D), value (B, Hkv, Lkv, Dv) -> (B, Hq, Lq, Dv);
    with return_lse=True also the float32 log-sum-exp (B, Hq, Lq), -inf for fully masked rows.
    dropout_p applies whenever it is > 0, as in SDPA: pass 0.0 in evaluation. Its mask comes from
    ``generator`` (default: torch's), so torch.manual_seed reproduces it.

    Each call traces the mods, which torch.compile cannot follow: in compiled code call a kernel
    built outside it (attncc.compile(variant) or attncc.nn.Attention).
    """
    if torch.compiler.is_compiling():
        raise AttnccError(
            "attncc.attention(q, k, v, score_mod, mask_mod) traces its mods on every call, which torch.compile "
            "cannot follow: build the kernel once outside the compiled code, kernel = "
            "attncc.compile(attncc.Variant(score_mod, mask_mod, ...)) or an attncc.nn.Attention module, and "
            "call kernel(q, k, v) inside it")
    variant = _outside_dynamo(Variant, score_mod, mask_mod, scale=scale, dropout_p=dropout_p,
                              deterministic=deterministic)
    return CompiledAttention(variant)(query, key, value, enable_gqa=enable_gqa, return_lse=return_lse,
                                      generator=generator)


def _outside_dynamo(fn, *args, **kwargs):
    """fn(...) with torch.compile's frame evaluation off: after a graph break at attncc.attention,
    dynamo would otherwise try to compile the mods that the tracer calls with its proxies; met
    while tracing (context_parallel), a graph break, fn running eagerly. torch._dynamo is not
    imported here: it imports triton, which on a CPU-only machine must come after
    TRITON_INTERPRET (runtime._triton)."""
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing is being compiled
    return fn(*args, **kwargs) if dynamo is None else dynamo.disable(fn)(*args, **kwargs)


def dropout_mask(batch: int, heads: int, q_len: int, kv_len: int, dropout_p: float, *, seed=None, offset=None,
                 generator=None, device="cpu") -> torch.Tensor:
    """The bool keep-mask (batch, heads, q_len, kv_len) the kernels use for dropout.

    With seed/offset omitted they are drawn from ``generator`` exactly as attncc.attention draws
    them, so after the same torch.manual_seed this is the mask of that call."""
    if seed is None or offset is None:
        seed, offset = runtime.draw_rng(generator)
    device = torch.device(device)
    target = runtime.target_for(device)
    compiled = CompiledAttention(Variant())
    module = compiled.module("fwd", Spec("float32", 16, 16, 1, target, True))
    keep = torch.empty(batch, heads, q_len, kv_len, dtype=torch.int8, device=device)
    if keep.numel():
        module.dropout_mask(keep, seed, offset, check_dropout(dropout_p))
    return keep.bool()


def attention_with_kvcache(query, cache, key=None, value=None, score_mod=None, mask_mod=None, *, scale=None,
                           cu_seqlens_q=None, max_seqlen_q=None, return_lse=False):
    """Decode or prefill against a KV cache with FlexAttention-style mods (see
    CompiledAttention.with_kvcache); returns (B, Lq, Hq, Dv) or packed (total, Hq, Dv)."""
    return CompiledAttention(Variant(score_mod, mask_mod, scale=scale)).with_kvcache(
        query, cache, key, value, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, return_lse=return_lse)


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None,
                     score_mod=None, mask_mod=None, *, scale=None, return_lse=False):
    """Attention over packed ragged sequences (see CompiledAttention.varlen); returns (total_q, Hq, Dv)."""
    return CompiledAttention(Variant(score_mod, mask_mod, scale=scale)).varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, return_lse=return_lse)
