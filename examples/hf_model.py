"""A Hugging Face transformers model from a config running on attncc, then with a custom score_mod.

    pip install 'attncc[hf]' && python examples/hf_model.py

1. A Llama-architecture model (GQA 4:1) built with ``attn_implementation="attncc"``, its logits on
   a left-padded batch against the same weights on ``attn_implementation="eager"``, and greedy
   ``generate()`` (decode steps take attncc's inference kernel over the DynamicCache).
2. ``set_mods`` puts an ALiBi score_mod (a per-head slope tensor, captured) on top of every
   layer's causal and padding mask; the eager model gets the same function as a dense 4-D bias.

On a GPU: 4 layers, hidden 2048, bf16; on the CPU a tiny float32 model (Triton interpreter).
Exits non-zero if an error exceeds the dtype's bound.
"""
import copy

import torch

import attncc.integrations.transformers as attncc_hf  # registers "attncc"; before transformers' model code
from _common import BOUNDS, DEVICE, GPU
from transformers import AutoModelForCausalLM, LlamaConfig

if GPU:
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, pad_token_id=0)
    dtype, B, L, new = torch.bfloat16, 4, 512, 32
else:
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, pad_token_id=0, initializer_range=0.2)
    dtype, B, L, new = torch.float32, 2, 24, 8
BOUND = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]  # logits, relative (bf16: two roundings apart)
assert BOUND >= BOUNDS[dtype]


def build(attn: str):
    torch.manual_seed(0)  # equal weights for both implementations
    return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn, dtype=dtype).to(DEVICE).eval()


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def report(name: str, err: float):
    ok = err <= BOUND
    print(f"  {name}: relative error vs eager {err:.2e} (bound {BOUND:.0e}) {'ok' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(f"{name}: {err:.3e} exceeds {BOUND:.0e}")


print(f"Llama-architecture model, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
      f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} key-value heads, {dtype} on {DEVICE.type}")
ours, eager = build("attncc"), build("eager")
g = torch.Generator().manual_seed(1)
ids = torch.randint(1, cfg.vocab_size, (B, L), generator=g).to(DEVICE)
mask = torch.ones(B, L, dtype=torch.long, device=DEVICE)
mask[1:, : L // 3] = 0  # left padding: rows 1.. start later
real = mask.bool()

# 1. the model as it comes
with torch.no_grad():
    got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits
report("logits, left-padded batch", rel(got[real], want[real]))
kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
tokens_ours, tokens_eager = ours.generate(ids, **kw), eager.generate(ids, **kw)
same = (tokens_ours[:, L:] == tokens_eager[:, L:]).float().mean().item()
print(f"  generate(): {new} greedy tokens per row, {same:.0%} equal to eager's"
      + ("" if GPU else " (float32: all expected)"))
if not GPU and same < 1:
    raise SystemExit("greedy tokens differ from eager's in float32")

# 2. ALiBi on top: a score_mod reading a captured per-head tensor (positions of the layer's keys)
H = cfg.num_attention_heads
slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)], device=DEVICE)


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


attncc_hf.set_mods(ours, score_mod=alibi)
pos = torch.arange(L, device=DEVICE)
allowed = real[:, None, None, :] & (pos[None, None, :, None] >= pos[None, None, None, :])  # causal, padding
bias = slopes[None, :, None, None] * (pos[None, None, None, :] - pos[None, None, :, None]).float()  # (1, H, L, L)
dense = torch.where(allowed, bias, torch.finfo(torch.float32).min).to(dtype)  # what eager needs: (B, H, L, L)
with torch.no_grad():
    got, want = ours(ids, attention_mask=mask).logits, eager(ids, attention_mask=dense).logits
report("logits with an ALiBi score_mod (eager: the same bias as a dense 4-D mask)", rel(got[real], want[real]))
tokens = ours.generate(ids, **kw)
print(f"  generate() with ALiBi: {(tokens[:, L:] != tokens_ours[:, L:]).float().mean():.0%} of the new tokens "
      "differ from the plain model's")
