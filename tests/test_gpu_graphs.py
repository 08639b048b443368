"""attncc inside CUDA graphs: torch.compile(mode="reduce-overhead") and torch.cuda.graph.

A captured call must be device work only: a replay runs the recorded kernels on the same
addresses and nothing of attncc's Python. So these tests train and run small models for several
steps with new input values (and a second length) under CUDA graphs and compare outputs and
gradients with eager attncc on the same inputs, step by step:

    model       a two-block transformer with ALiBi + causal attncc attention (bf16 and fp32)
    documents   a document mask read from a captured tensor that changes in place between
                replays: the tile classification must be part of the graph and must not be
                cached from the warm-up run (autograd.Launch.blocks)
    dropout     fresh masks on every step, equal to eager with torch's generator: the dropout op
                stays outside the graphs (its seeds are host numbers, autograd._seeds)
    eager graph torch.cuda.graph around eager attncc calls, replayed on new values

Run with ``python -m pytest -m gpu tests/test_gpu_graphs.py`` on a CUDA machine.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import attncc
from conftest import assert_close_to_reference, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# compiled against eager model: the same attncc kernels; inductor fuses and rounds the other ops
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
D_MODEL, HEADS = 128, 2  # head dim 64


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphEvents:
    """CUDA graphs that cudagraph trees recorded and replayed, and graphs inductor decided not to
    capture (skips), since the test began."""

    def __init__(self):
        from torch._dynamo.utils import counters
        self.recorded = self.replayed = 0
        self._counters, self._skips = counters, counters["inductor"]["cudagraph_skips"]

    @property
    def skips(self) -> int:
        return self._counters["inductor"]["cudagraph_skips"] - self._skips


@pytest.fixture
def graph_events(monkeypatch):
    from torch._inductor import cudagraph_trees
    events = GraphEvents()
    manager = cudagraph_trees.CUDAGraphTreeManager
    record, execute = manager.record_function, manager.execute_node

    def counting_record(self, *args, **kwargs):
        events.recorded += 1
        return record(self, *args, **kwargs)

    def counting_execute(self, *args, **kwargs):
        events.replayed += 1
        return execute(self, *args, **kwargs)
    monkeypatch.setattr(manager, "record_function", counting_record)
    monkeypatch.setattr(manager, "execute_node", counting_execute)
    return events


class Block(nn.Module):
    def __init__(self, dropout_p: float = 0.0):
        super().__init__()
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)], device="cuda")

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        self.ln = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.proj = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.attn = attncc.nn.Attention(attncc.Variant(alibi, causal, dropout_p=dropout_p), layout="blhd")

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(B, L, 3, HEADS, -1).unbind(2)
        return x + self.proj(self.attn(q, k, v).reshape(B, L, -1))


def model(dtype, dropout_p=0.0, seed=0):
    torch.manual_seed(seed)  # the same weights for every model made with this seed
    return nn.Sequential(Block(dropout_p), Block(dropout_p)).to(device="cuda", dtype=dtype)


def step(fn, params, x):
    """(output, loss, gradients) of one training step; the output cloned (a replay reuses its memory)."""
    out = fn(x)
    loss = out.float().square().mean()
    grads = torch.autograd.grad(loss, params)
    return out.detach().clone(), loss.detach().clone(), [g.clone() for g in grads]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reduce_overhead_training_steps_equal_eager(dtype, graph_events):
    eager, graphed = model(dtype), model(dtype)
    compiled = torch.compile(graphed, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    # new values every step; a second length (a recompilation, new graphs), then the first again
    for i, L in enumerate((256,) * 4 + (192,) * 3 + (256,) * 2):
        x = torch.randn(2, L, D_MODEL, device="cuda", dtype=dtype, generator=gen)
        torch.compiler.cudagraph_mark_step_begin()
        out, loss, grads = step(compiled, list(graphed.parameters()), x)
        want_out, want_loss, want = step(eager, list(eager.parameters()), x)
        assert rel_err(out, want_out) < TOL[dtype], i
        assert abs(loss.item() - want_loss.item()) <= TOL[dtype] * abs(want_loss.item()), i
        for (name, _), g, w in zip(graphed.named_parameters(), grads, want):
            assert rel_err(g, w) < GRAD_TOL[dtype], (i, name)
    assert graph_events.skips == 0
    # forward and backward recorded; replayed from the third step of a length on
    assert graph_events.recorded >= 2 and graph_events.replayed >= 4


def test_reduce_overhead_document_mask_follows_ids_changed_in_place(graph_events):
    """The mask reads document ids (a block-sparse variant): classifying its tiles is cached
    across eager calls, but for a graph it must not be: recorded, so that each replay classifies
    the ids of that replay, and not kept from the warm-up run, whose memory comes from the
    graphs' pool (cudagraph trees check that only outputs stay alive there)."""
    L = 512
    docs = torch.zeros(L, dtype=torch.int32, device="cuda")

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)
    kernel = attncc.compile(attncc.Variant(None, same_doc_causal))
    fn = lambda q, k, v: kernel(q, k, v, return_lse=True)  # noqa: E731
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for i in range(5):
        cuts = torch.randint(1, L, (3,), generator=gen, device="cuda")
        docs.copy_((torch.arange(L, device="cuda")[:, None] >= cuts[None, :]).sum(-1).to(torch.int32))
        q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        g = torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        torch.compiler.cudagraph_mark_step_begin()
        out, lse = compiled(q, k, v)
        got = [t.clone() for t in torch.autograd.grad(out, (q, k, v), g)]
        out, lse = out.detach().clone(), lse.detach().clone()
        want_out, want_lse = fn(q, k, v)
        want = torch.autograd.grad(want_out, (q, k, v), g)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0, msg=f"step {i}")  # the same kernels
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0, msg=f"step {i}")
        for name, a, b in zip("qkv", got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {i}: d{name}")
        ref, ref_lse = attncc.reference.attention_variant(kernel.variant, q.double(), k.double(), v.double(),
                                                          return_lse=True)
        assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
    assert graph_events.skips == 0 and graph_events.replayed >= 3


def test_reduce_overhead_dropout_fresh_per_step_and_equal_to_eager():
    """Dropout's seeds are host numbers: attncc::attention_dropout is tagged cudagraph_unsafe, so
    inductor runs it between graphs and each step draws a new mask. With torch's generator
    (fallback_random) the compiled steps draw what eager draws: equal outputs and gradients."""
    import torch._inductor.config as inductor_config
    dtype = torch.float32
    eager, graphed = model(dtype, dropout_p=0.25), model(dtype, dropout_p=0.25)
    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(graphed, mode="reduce-overhead")
        x = torch.randn(2, 256, D_MODEL, device="cuda", dtype=dtype)
        outs = []
        for i in range(4):  # the same input: only the masks differ between steps
            torch.manual_seed(100 + i)
            torch.compiler.cudagraph_mark_step_begin()
            out, loss, grads = step(compiled, list(graphed.parameters()), x)
            torch.manual_seed(100 + i)
            want_out, want_loss, want = step(eager, list(eager.parameters()), x)
            assert rel_err(out, want_out) < TOL[dtype], i
            for g, w in zip(grads, want):
                assert rel_err(g, w) < GRAD_TOL[dtype], i
            outs.append(out)
    assert not torch.equal(outs[2], outs[3])


def test_eager_calls_in_a_cuda_graph_replay_on_new_values():
    """torch.cuda.graph around eager attncc calls (forward and backward): replays on new input
    values equal fresh eager calls."""
    slopes = torch.rand(4, device="cuda")
    kernel = attncc.compile(attncc.Variant(lambda s, b, h, q, k: s + slopes[h] * (k - q), causal))
    static = [torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3)]
    grad_out = torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.float16)

    def run():
        out = kernel(*static)
        return (out, *torch.autograd.grad(out, static, grad_out))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and load outside the capture
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for i in range(3):
        with torch.no_grad():
            for t in static:
                t.copy_(torch.randn_like(t))
            slopes.copy_(torch.rand_like(slopes))  # a captured tensor changes in place
        graph.replay()
        want = run()
        for name, a, b in zip(("out", "dq", "dk", "dv"), captured, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"replay {i}: {name}")


def test_dropout_inside_a_hand_made_cuda_graph_is_refused():
    kernel = attncc.compile(attncc.Variant(None, causal, dropout_p=0.5))
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16)
    kernel(q, q, q)  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception) as failure:
        with torch.cuda.graph(graph):
            kernel(q, q, q)
    chain = [failure.value, failure.value.__context__]
    assert any(isinstance(e, attncc.AttnccError) and "CUDA graph" in str(e) for e in chain), chain
