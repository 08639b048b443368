"""A small GPT trained for a few steps with attncc.nn.Attention (causal + ALiBi) and, from the
same seed and weights, with torch SDPA given the same ALiBi bias as a dense mask. Both should
learn the same: the losses agree step by step and decrease. On a GPU it also trains the attncc
model under torch.compile(fullgraph=True) (one attncc op per layer, no graph break) and under
torch.compile(mode="reduce-overhead") (CUDA graphs replay the steps), and prints the time per
step of each (benchmarks/gpt_step.py compares them with SDPA's in every mode).

    python examples/gpt.py             # CPU: a tiny config through the Triton interpreter
    python examples/gpt.py --compile   # also torch.compile on the CPU (slow: inductor + interpreter)
"""
import math
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import attncc
import attncc.runtime
from _common import DEVICE, GPU


@dataclass(frozen=True)
class Config:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq_len: int
    batch: int
    steps: int = 30
    lr: float = 3e-3


CONFIG = (Config(vocab=512, d_model=256, layers=4, heads=4, seq_len=256, batch=16) if GPU
          else Config(vocab=64, d_model=64, layers=2, heads=2, seq_len=32, batch=2))
DTYPE = torch.bfloat16 if GPU else torch.float32  # autocast dtype of the matmuls and attention


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=DEVICE)


def attncc_core(cfg: Config, slopes: torch.Tensor) -> nn.Module:
    """attncc: ALiBi and the causal mask are the mods; slopes is a (non-learnable) buffer."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return attncc.nn.Attention(attncc.Variant(alibi, causal, name="alibi_causal"), layout="blhd")


class SDPACore(nn.Module):
    """The same attention through SDPA: ALiBi + causal as a dense (H, L, L) float mask."""

    def __init__(self, cfg: Config, slopes: torch.Tensor):
        super().__init__()
        i = torch.arange(cfg.seq_len, device=DEVICE)
        distance = (i[None, :] - i[:, None]).float()  # kv_idx - q_idx
        bias = (slopes[:, None, None] * distance).masked_fill(distance > 0, float("-inf"))
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, q, k, v):  # (B, L, H, D), like attncc.nn.Attention(layout="blhd")
        L = q.shape[1]
        mask = self.bias[:, :L, :L].to(q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask)
        return out.transpose(1, 2)


class Block(nn.Module):
    def __init__(self, cfg: Config, core: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.core = core
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.cfg.heads, -1).unbind(2)  # (B, L, H, D) each
        x = x + self.proj(self.core(q, k, v).reshape(B, L, -1))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token embeddings (no position embeddings: ALiBi gives positions), blocks, tied head."""

    def __init__(self, cfg: Config, make_core):
        super().__init__()
        slopes = alibi_slopes(cfg.heads)
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-2's: a tied head starts near uniform
        self.blocks = nn.ModuleList(Block(cfg, make_core(cfg, slopes)) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.embed.weight.T


def train(name: str, model: nn.Module, data: torch.Tensor, cfg: Config, forward=None, graphs: bool = False):
    """AdamW on next-token prediction over one fixed batch (the model memorises it); returns the
    losses and the median seconds per step. ``graphs``: forward is compiled with
    mode="reduce-overhead", whose CUDA graphs are told where each step begins."""
    forward = model if forward is None else forward
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    inputs, targets = data[:, :-1], data[:, 1:]
    losses, times = [], []
    for step in range(cfg.steps):
        start = time.perf_counter()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(DEVICE.type, dtype=DTYPE, enabled=GPU):
            logits = forward(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - start)
        if step % 5 == 0 or step == cfg.steps - 1:
            print(f"  {name:<16} step {step:3d}  loss {losses[-1]:.4f}")
    return losses, sorted(times[1:])[len(times[1:]) // 2]  # the first step compiles


def main():
    cfg = CONFIG
    print(f"GPT {cfg} on {DEVICE}" + ("" if GPU else " (Triton interpreter)"))
    if not GPU:
        # CPU tensors run through triton's interpreter, which attncc can switch on only if it imports
        # triton first; creating a torch optimizer imports triton (through torch._dynamo).
        attncc.runtime.target_for(DEVICE)
    torch.manual_seed(0)
    data = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq_len + 1), device=DEVICE)
    ours = GPT(cfg, attncc_core).to(DEVICE)
    sdpa = GPT(cfg, SDPACore).to(DEVICE)
    initial = {k: v.clone() for k, v in ours.state_dict().items()}
    sdpa.load_state_dict(initial)  # same weights; the cores hold no parameters

    runs = {"attncc": train("attncc", ours, data, cfg), "sdpa": train("sdpa", sdpa, data, cfg)}
    if GPU or "--compile" in sys.argv:
        compiled = GPT(cfg, attncc_core).to(DEVICE)
        compiled.load_state_dict(initial)
        runs["attncc compiled"] = train("attncc compiled", compiled, data, cfg,
                                        forward=torch.compile(compiled, fullgraph=True, dynamic=False))
    if GPU:
        graphed = GPT(cfg, attncc_core).to(DEVICE)
        graphed.load_state_dict(initial)
        runs["attncc graphs"] = train("attncc graphs", graphed, data, cfg, graphs=True, forward=torch.compile(
            graphed, mode="reduce-overhead", fullgraph=True, dynamic=False))

    failed = []
    tol = 0.05 if GPU else 1e-3  # bf16 autocast on the GPU: rounding differs between the two kernels
    print(f"\n{'run':<16} {'first loss':>10} {'last loss':>10} {'max |diff| vs sdpa':>19}"
          + (f" {'ms/step':>8}" if GPU else ""))
    for name, (losses, seconds) in runs.items():
        diff = max(abs(a - b) for a, b in zip(losses, runs["sdpa"][0]))
        decreased = losses[-1] < 0.5 * losses[0] and all(math.isfinite(x) for x in losses)
        agrees = diff <= tol * max(runs["sdpa"][0])
        if not (decreased and agrees):
            failed.append(name)
        line = f"{name:<16} {losses[0]:10.4f} {losses[-1]:10.4f} {diff:19.2e}"
        print(line + (f" {1e3 * seconds:8.2f}" if GPU else "") + ("" if decreased and agrees else "  FAILED"))
    if failed:
        raise SystemExit(f"gpt: {', '.join(failed)}: the loss did not halve or does not follow SDPA's")


if __name__ == "__main__":
    main()
