"""Train a small language model with its sequence sharded over the ranks of a torchrun job:
context parallelism with attncc.distributed (causal + ALiBi, the mods see global positions).

    torchrun --nproc-per-node 2 examples/cp_train.py              # CPU: gloo, Triton interpreter
    torchrun --nproc-per-node 8 examples/cp_train.py --seq 65536  # GPUs: NCCL

The task: next-token prediction on arithmetic sequences, token i = (a + i * s) mod vocab with a
random start a and step s per sequence, so each token follows from the two before it (the first
tokens of a chunk from the previous chunk's last, which lives on another rank).
Every rank holds the whole (small) model and one zigzag shard of each sequence; its loss covers
its own tokens, and the parameters' gradients are averaged over the ranks (as data parallelism
does; attncc has already summed what flows between the ranks inside attention). At step 0 the
sharded loss is checked against the same model run unsharded on every rank.
"""
import argparse
import math
import os
import time

import torch

GPU = torch.cuda.is_available()
if not GPU:  # CPU tensors run in the Triton interpreter, chosen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import attncc  # noqa: E402
from attncc.distributed import shard  # noqa: E402


class Block(nn.Module):
    def __init__(self, d, heads, kernel):
        super().__init__()
        self.heads, self.kernel = heads, kernel
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, layout):
        B, L, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if layout is None:  # the whole sequence on this rank (the step-0 check)
            a = self.kernel(q, k, v)
        else:  # this rank's shard; group=None: the default process group
            a = self.kernel.context_parallel(q, k, v, group=None, layout=layout)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, d))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab, d, heads, layers, device):
        super().__init__()
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        def causal(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        kernel = attncc.compile(attncc.Variant(alibi, causal))
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(Block(d, heads, kernel) for _ in range(layers))

    def forward(self, tokens, layout=None):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, layout)
        return self.head(x)


def batch(args, step, device):
    """Inputs and next-token targets (whole sequences) of arithmetic sequences mod vocab."""
    g = torch.Generator().manual_seed(1000 + step)
    a, s = (torch.randint(0, args.vocab, (args.batch, 1), generator=g) for _ in range(2))
    seq = (a + s * torch.arange(args.seq + 1)) % args.vocab
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=4096 if GPU else 128)
    p.add_argument("--batch", type=int, default=8 if GPU else 4)
    p.add_argument("--d-model", type=int, default=256 if GPU else 32)
    p.add_argument("--heads", type=int, default=4 if GPU else 2)
    p.add_argument("--layers", type=int, default=2 if GPU else 1)
    p.add_argument("--vocab", type=int, default=64 if GPU else 16)
    p.add_argument("--steps", type=int, default=200 if GPU else 30)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--layout", default="zigzag")
    args = p.parse_args()

    dist.init_process_group("nccl" if GPU else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if GPU else torch.device("cpu")
    if GPU:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Model(args.vocab, args.d_model, args.heads, args.layers, device).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    dtype = torch.bfloat16 if GPU else torch.float32
    start = time.perf_counter()
    for step in range(args.steps):
        inputs, targets = batch(args, step, device)
        x, y = shard(inputs, None, dim=1, layout=args.layout), shard(targets, None, dim=1, layout=args.layout)
        with torch.autocast(device.type, dtype=dtype, enabled=GPU):
            logits = model(x, layout=args.layout)
            loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        count = torch.tensor(float(y.numel()), device=device)
        totals = torch.stack([loss_sum.detach(), count])
        dist.all_reduce(totals)
        loss = loss_sum * world / totals[1]  # so that averaging the gradients over the ranks gives the mean loss's
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad)
            prm.grad /= world
        if step == 0:
            with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=GPU):
                whole = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
            sharded = (totals[0] / totals[1]).item()
            if rank == 0:
                print(f"step 0: loss {sharded:.5f} sharded over {world} ranks, {whole.item():.5f} unsharded")
            assert abs(sharded - whole.item()) < (2e-2 if GPU else 1e-4), "sharded and unsharded losses differ"
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            tokens = (step + 1) * args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {(totals[0] / totals[1]).item():.4f} "
                  f"(chance {math.log(args.vocab):.2f})  {tokens:,.0f} tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
