"""attncc as a Hugging Face transformers attention backend (attn_implementation="attncc") on one GPU:
bf16 correctness at realistic shapes, then tokens/s of prefill, decode and a training step against
"sdpa" and "flex_attention".

    python benchmarks/hf_bench.py                              # checks, then throughput (~10 min)
    python benchmarks/hf_bench.py --skip-checks --impls attncc,sdpa
    python benchmarks/hf_bench.py --models llama3_8b,gemma2_9b --skip-throughput
    python benchmarks/hf_bench.py --tiny                       # CPU smoke test of this script

Checks: each model family at its real per-layer shape, cut to 2 layers, random weights (seed 0),
bf16; the reference is the same weights on attn_implementation="eager" in float32. For attncc and
the baseline (sdpa, or eager bf16 where the model has no sdpa path: Gemma-2's softcap, gpt-oss's
sinks) it prints the relative error of the logits of a left-padded batch (real tokens only) and of
packed sequences (position_ids, no cache), of all gradients of a training step, and the share of
greedy generate() tokens equal to the reference's. attncc passes where its error is at most twice
the baseline's (or below 1e-3); bf16 tokens may part from float32's after a near-tie.

Throughput: a Llama-3-8B-shaped model cut to 2 layers (hidden 4096, 32 query / 8 key-value heads,
head dim 128, vocabulary 128256), bf16, eager model calls (as transformers runs them):
  prefill   model(ids) with a DynamicCache, B x L tokens, no gradient
  decode    greedy steps of B sequences after a prefill of L tokens, one token each per step
  train     forward + backward of B x L tokens with labels (no optimizer step)
Each time is the median of --reps runs after one warm-up (flex_attention compiles on its first
calls). Writes results/<gpu>-hf.json next to the other results.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

import attncc
import attncc.integrations.transformers  # noqa: F401  (registers "attncc"; before transformers' model code)
import transformers
from transformers import AutoModelForCausalLM

IMPLS = ("attncc", "sdpa", "flex_attention")


def model_configs(tiny: bool) -> dict:
    """Per-layer shapes of the real models, 2 layers. Sliding windows shorter than the real ones
    (Mistral 4096, Gemma-2 4096) so that they bite at the lengths checked."""
    if tiny:
        base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, pad_token_id=0, initializer_range=0.2)
        return {"llama3_8b": transformers.LlamaConfig(**base),
                "mistral_7b": transformers.MistralConfig(**base, sliding_window=8),
                "gemma2_9b": transformers.Gemma2Config(**base, sliding_window=8, attn_logit_softcapping=2.0,
                                                       query_pre_attn_scalar=16)}
    out = {
        "llama3_8b": transformers.LlamaConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, rope_theta=500000.0, pad_token_id=0, max_position_embeddings=8192),
        "mistral_7b": transformers.MistralConfig(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, sliding_window=512, pad_token_id=0),
        "gemma2_9b": transformers.Gemma2Config(
            vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=256, sliding_window=512, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, query_pre_attn_scalar=256, pad_token_id=0),
        "qwen2_7b": transformers.Qwen2Config(
            vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=2, num_attention_heads=28,
            num_key_value_heads=4, pad_token_id=0),
    }
    if hasattr(transformers, "GptOssConfig"):
        out["gpt_oss_20b"] = transformers.GptOssConfig(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, sliding_window=128, num_local_experts=8, num_experts_per_tok=4,
            pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    return out


def build(cfg, impl: str, dtype, device):
    """``cfg`` on ``impl`` with the weights of seed 0 (equal for every implementation and dtype:
    drawn in float32, then cast: with transformers 5.17 a model built in bfloat16 from seed 0 had
    other weights than the float32 one, and every implementation, sdpa too, differed by 1.4)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)
    return model.to(device=device, dtype=dtype).eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# Checks


def batches(vocab: int, B: int, L: int, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1:, : L // 4] = 0
    ids[mask == 0] = 0
    cuts = [0, L * 3 // 10, L * 8 // 10, L]  # three packed documents per row
    pos = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).expand(B, L)
    return ids.to(device), mask.to(device), pos.to(device)


def train_grads(model, ids, mask):
    model.train()
    model.zero_grad(set_to_none=True)
    labels = ids.clone()
    pad = mask == 0
    labels[pad | torch.cat([pad[:, :1], pad[:, :-1]], dim=1)] = -100  # rows of padding differ per implementation
    model(ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
    model.eval()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads


def measure(model, ids, mask, pos, new: int):
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits.float()
        packed = model(ids, position_ids=pos, use_cache=False).logits.float()
    prompt, prompt_mask, _ = batches(model.config.vocab_size, ids.shape[0], 8 * new, ids.device)  # left-padded
    tokens = model.generate(prompt, attention_mask=prompt_mask, max_new_tokens=new, do_sample=False,
                            pad_token_id=0)[:, prompt.shape[1]:]
    return padded, packed, train_grads(model, ids, mask), tokens


def check(name, cfg, device, dtype, B, L, new) -> list:
    ids, mask, pos = batches(cfg.vocab_size, B, L, device)
    real = mask.bool()
    ref = measure(build(cfg, "eager", torch.float32, device), ids, mask, pos, new)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rows = []
    for impl in ("attncc", "sdpa"):
        try:
            model = build(cfg, impl, dtype, device)
        except (ValueError, NotImplementedError):  # the model has no sdpa path: eager in the same dtype
            impl = "eager"
            model = build(cfg, impl, dtype, device)
        padded, packed, grads, tokens = measure(model, ids, mask, pos, new)
        del model
        rows.append(dict(model=name, impl=impl, padded=rel(padded[real], ref[0][real]), packed=rel(packed, ref[1]),
                         grads=rel(grads, ref[2]), tokens=(tokens == ref[3]).float().mean().item()))
    ours, base = rows
    ours["pass"] = all(ours[k] <= max(2 * base[k], 1e-3) for k in ("padded", "packed", "grads"))
    return rows


# ---------------------------------------------------------------------------------------------
# Throughput


def timed(fn, device, reps: int) -> float:
    """Median seconds of fn() over reps runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(cfg, impl, device, dtype, B, L, decode_batch, steps, reps) -> dict:
    model = build(cfg, impl, dtype, device)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, cfg.vocab_size, (B, L), generator=g).to(device)
    out = {}

    def prefill():
        with torch.no_grad():
            model(ids, **{cache_arg: transformers.DynamicCache(config=model.config)})
    out["prefill"] = B * L / timed(prefill, device, reps)

    prompt = ids[:1].expand(decode_batch, L).contiguous()

    def decode():  # timed: the steps only, after an untimed prefill
        with torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            nxt = model(prompt, **{cache_arg: cache}).logits[:, -1:].argmax(-1)
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                nxt = model(nxt, **{cache_arg: cache}).logits[:, -1:].argmax(-1)
            sync(device)
            return time.perf_counter() - start
    decode()
    out["decode"] = decode_batch * steps / statistics.median(decode() for _ in range(reps))

    model.train()

    def train():
        model(ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    out["train"] = B * L / timed(train, device, reps)
    del model
    return out


# ---------------------------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default=",".join(IMPLS), help="throughput: among attncc,sdpa,flex_attention")
    ap.add_argument("--models", default=None, help="checks: model families (default: all)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--batch", type=int, default=4, help="prefill and training batch")
    ap.add_argument("--len", type=int, default=2048, help="prefill / training length, decode prompt length")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="tiny float32 models (a CPU smoke test of the script)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("hf_bench.py needs a CUDA GPU (or --tiny for a CPU smoke test)")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    configs = model_configs(args.tiny)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{gpu}, torch {torch.__version__}, transformers {transformers.__version__}, attncc {attncc.__version__}")
    result = dict(gpu=gpu, torch=torch.__version__, transformers=transformers.__version__, checks=[], throughput={})

    if not args.skip_checks:
        B, L, new = (2, 24, 4) if args.tiny else (2, 1024, 32)
        names = args.models.split(",") if args.models else list(configs)
        print(f"\n## Checks: bf16 against eager float32, B={B}, L={L}, {new} greedy tokens\n" if not args.tiny else
              f"\n## Checks (tiny, float32), B={B}, L={L}\n")
        print("| model | implementation | logits, left-padded | logits, packed | gradients | greedy tokens equal | |")
        print("|---|---|---|---|---|---|---|")
        failed = False
        for name in names:
            for row in check(name, configs[name], device, dtype, B, L, new):
                result["checks"].append(row)
                verdict = {True: "pass", False: "FAIL", None: ""}[row.get("pass")]
                failed |= row.get("pass") is False
                print(f"| {row['model']} | {row['impl']} | {row['padded']:.2e} | {row['packed']:.2e} | "
                      f"{row['grads']:.2e} | {row['tokens']:.0%} | {verdict} |")

    if not args.skip_throughput:
        impls = [i for i in args.impls.split(",") if i]
        B, L, DB, steps = (2, 32, 2, 4) if args.tiny else (args.batch, args.len, args.decode_batch, args.steps)
        cfg = configs["llama3_8b"]
        print(f"\n## Throughput, tokens/s: Llama-3-8B-shaped, 2 layers, {str(dtype).removeprefix('torch.')}; "
              f"prefill and train B={B} L={L}; decode B={DB} after {L} tokens, {steps} steps\n")
        for impl in impls:
            try:
                result["throughput"][impl] = throughput(cfg, impl, device, dtype, B, L, DB, steps, args.reps)
            except Exception as e:  # one implementation failing leaves the others' numbers
                result["throughput"][impl] = {"error": f"{type(e).__name__}: {e}"[:200]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print("| phase | " + " | ".join(impls) + " | " + " | ".join(f"attncc / {i}" for i in impls if i != "attncc")
              + " |")
        print("|---|" + "---|" * (2 * len(impls) - ("attncc" in impls)))
        for phase in ("prefill", "decode", "train"):
            cells = [result["throughput"][i].get(phase) for i in impls]
            ours = result["throughput"].get("attncc", {}).get(phase)
            text = [f"{c:,.0f}" if c else result["throughput"][i].get("error", "-") for c, i in zip(cells, impls)]
            ratios = [f"{ours / c:.2f}x" if ours and c else "-" for c, i in zip(cells, impls) if i != "attncc"]
            print(f"| {phase} | " + " | ".join(text + ratios) + " |")

    if device.type == "cuda":
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{gpu.lower().replace(' ', '-')}-hf.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {path}")
    if not args.skip_checks and failed:
        raise SystemExit("attncc failed a check (see the table)")


if __name__ == "__main__":
    main()
