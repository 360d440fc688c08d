"""A compiled tensor-parallel decoder layer and loss (``fullgraph=True``, forward and backward, gloo TP 2) compute
the eager model's loss and every gradient (fp32, 1e-5 relative). See tests/parallel/compile_cases.py; run in the 2-rank
launch shared with other files (tests/parallel/tp2_model_cases.py). On one device, the compiled loss (the head's
logits to the loss) equals eager's and keeps no fp32 ``[tokens, vocab]`` tensor for backward."""

from __future__ import annotations

import math

import pytest
import torch

from tests.parallel import compile_cases
from tests.parallel.tp2_model_cases import section

TOL = 1e-5


@pytest.fixture(scope="module")
def reports(tp2_model_results):
    return section(tp2_model_results, "compile")


def test_every_layout_compiles_without_graph_break_and_matches_eager(reports):
    for rank_reports in reports:
        assert len(rank_reports) == len(compile_cases.CASES)
        bad = [(r["case"], r["loss_rel"], r["grad_rel"]) for r in rank_reports if r["loss_rel"] > TOL or r["grad_rel"] > TOL]
        assert not bad, bad
        assert all(r["same_names"] for r in rank_reports)


def test_the_compiled_loss_equals_eager_and_keeps_no_fp32_logits():
    """One device, fp32: every decoder layer and the loss compiled (``fullgraph=True``, what ``--torch_compile`` compiles)
    against eager: the loss and every gradient within 1e-5 relative. On bf16 logits the compiled loss keeps no fp32
    tensor of the logits' size for backward; eager's keeps its fp32 log-probabilities."""
    import torch._inductor.config

    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
    from boost_hf.parallel.compile import compile_model

    torch._inductor.config.compile_threads = 1
    config = BoostLlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                              num_key_value_heads=4, rank=16, bottleneck="cola")
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = BoostLlamaForCausalLM(config).train()
        if compiled:
            torch._dynamo.reset()
            compile_model(model, fullgraph=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        results[compiled] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
        logits = torch.randn(2, 24, 512, dtype=torch.bfloat16, requires_grad=True)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
            model.loss_function(logits=logits, labels=ids, vocab_size=512).backward()
        fp32_logits = [shape for dtype, shape in kept if dtype == torch.float32 and math.prod(shape) >= logits.numel()]
        assert bool(fp32_logits) == (not compiled), kept
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results[False], results[True]
    assert abs(float(compiled_loss - eager_loss)) <= TOL * abs(float(eager_loss))
    for name, grad in eager_grads.items():
        assert float((compiled_grads[name] - grad).abs().max()) <= TOL * float(grad.abs().max()), name
