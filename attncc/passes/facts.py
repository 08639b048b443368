"""Facts about a variant that codegen and later passes use, derived from the sympy forms."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .symbolic import KV, Q, SCORE


@dataclass(frozen=True)
class Facts:
    score_identity: bool      # score_mod(score, ...) == score: the scale folds into exp2 directly
    score_bias: bool          # score_mod == score + f(b, h, q_idx, kv_idx): an additive bias
    score_affine: bool        # score_mod == a(...) * score + f(...): d/dscore does not read score
    score_reads: tuple        # leaves and captures the score_mod reads
    mask_trivial: bool        # no mask at all (or one that is always True)
    mask_index_only: bool     # mask reads only q_idx and kv_idx: tile bounds can be derived
    mask_reads: tuple         # leaves and captures the mask_mod reads
    captures_in_score: tuple  # capture numbers the score_mod reads
    captures_in_mask: tuple   # capture numbers the mask_mod reads

    def lines(self) -> list[str]:
        yes = lambda v: "yes" if v else "no"
        return [
            f"score_mod is the identity:          {yes(self.score_identity)}",
            f"score_mod is a pure additive bias:  {yes(self.score_bias)}",
            f"score_mod is affine in score:       {yes(self.score_affine)}",
            f"score_mod reads:                    {', '.join(self.score_reads) or 'nothing'}",
            f"mask is trivial (always attend):    {yes(self.mask_trivial)}",
            f"mask depends only on q_idx, kv_idx: {yes(self.mask_index_only)}",
            f"mask_mod reads:                     {', '.join(self.mask_reads) or 'nothing'}",
        ]


def _reads(expr) -> tuple[tuple[str, ...], tuple[int, ...]]:
    leaves = sorted(str(s) for s in expr.free_symbols)
    caps = sorted({int(f.func.__name__[3:]) for f in expr.atoms(sp.core.function.AppliedUndef)})
    return tuple(leaves + [f"cap{i}" for i in caps]), tuple(caps)


def derive(score: sp.Expr, mask: sp.Basic) -> Facts:
    dscore = sp.diff(score, SCORE)
    score_reads, score_caps = _reads(score)
    mask_reads, mask_caps = _reads(mask)
    return Facts(
        score_identity=score == SCORE,
        score_bias=dscore == 1,
        score_affine=SCORE not in dscore.free_symbols,
        score_reads=score_reads,
        mask_trivial=mask == sp.true,
        mask_index_only=mask != sp.true and not mask_caps and mask.free_symbols <= {Q, KV},
        mask_reads=mask_reads,
        captures_in_score=score_caps,
        captures_in_mask=mask_caps,
    )

