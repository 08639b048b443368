"""Context parallelism: any attncc variant over a sequence sharded across ranks, forward and
backward, through torch.distributed (NCCL, gloo) or an in-process ThreadGroup.

    q, k, v = (shard(t, group, layout="zigzag") for t in (q_all, k_all, v_all))
    out = kernel.context_parallel(q, k, v, group=group, layout="zigzag")   # this rank's rows
    out_all = unshard(out, group, layout="zigzag")

The mods see global positions (q_idx, kv_idx and the indices into captured tensors); each rank's
result equals its rows of single-device attncc over the whole sequence, gradients included
(learnable captured tensors get their gradient summed over the ranks). method="ring" rotates
K/V shards around the ranks while the one at hand computes and skips the chunk pairs the mask
empties; "allgather" gathers K/V once; "auto" picks by a cost model (logged at INFO). Dropout
draws the mask single-process attncc draws for the same seed (rank 0's draw is used).
"""
from .attention import METHODS, choose_method, context_parallel as _context_parallel
from .comm import ThreadGroup
from .layout import Layout, balanced_layout, make_layout, shard, unshard


def context_parallel(query, key, value, score_mod=None, mask_mod=None, *, group=None, layout="zigzag",
                     method="auto", scale=None, enable_gqa=False, return_lse=False, dropout_p=0.0,
                     generator=None, deterministic=False):
    """Functional form: attncc.attention's arguments plus group, layout and method; query, key
    and value are this rank's shards. Traces the mods on each call: build the kernel once with
    attncc.compile and call kernel.context_parallel in a loop."""
    from ..api import CompiledAttention, _outside_dynamo
    from ..variant import Variant

    def run():
        kernel = CompiledAttention(Variant(score_mod, mask_mod, scale=scale, dropout_p=dropout_p,
                                           deterministic=deterministic))
        return _context_parallel(kernel, query, key, value, group=group, layout=layout, method=method,
                                 enable_gqa=enable_gqa, return_lse=return_lse, generator=generator)
    return _outside_dynamo(run)


__all__ = ["context_parallel", "shard", "unshard", "Layout", "balanced_layout", "make_layout", "ThreadGroup",
           "METHODS", "choose_method"]
