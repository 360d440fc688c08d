"""Megatron-LM's sequence parallelism (boost_hf/parallel/sequence_parallel.py): the column-parallel GEMM on gathered
tokens keeps only the token shard for backward, eager and compiled (one process, fake process group); a group whose
projection is pre-hooked or replaced falls back to gathering for it (TP2, gloo; parity of the plain groups at TP 2
and 4 is in test_tensor_parallel)."""

from __future__ import annotations

import pytest
import torch

from boost_hf.parallel.shared_storage import joined_rows
from boost_hf.perf.op_counter import OpCounter
from boost_hf.perf.rank_cost import fake_process_group
from tests.distributed import launch
from tests.parallel import sequence_parallel_cases

TOL = 1e-5


def _saved_shapes(fn, x, weights) -> list[tuple[int, ...]]:
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (shapes.append(tuple(t.shape)), t)[1], lambda t: t):
        outputs = fn(x, weights)
    sum(out.sum() for out in outputs).backward()
    return shapes


@pytest.mark.parametrize("grouped", [False, True], ids=["ungrouped", "grouped"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gathered_linear_keeps_the_token_shard_not_the_gathered_tokens(compiled, grouped):
    import torch.distributed as dist

    from boost_hf.parallel.fused import weight_views
    from boost_hf.parallel.sequence_parallel import gathered_linear
    from boost_hf.parallel.shared_storage import share_storage

    p, batch, shard, d = 4, 2, 8, 40  # every saved candidate has its own size
    with fake_process_group(p):
        group = dist.new_group(list(range(p)))
        weights = [torch.nn.Parameter(torch.randn(24, d)), torch.nn.Parameter(torch.randn(56, d))]
        share_storage(weights)
        x = torch.randn(batch, shard, d, requires_grad=True)

        def fn(x, weights):
            if grouped:  # one GEMM on the stacked weights
                weights = weight_views(weights, torch.float32)
            return [out.sin() for out in gathered_linear(x, weights, group, grouped=grouped)]  # sin keeps each output

        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True)
        shapes = _saved_shapes(fn, x, weights)
        assert x.grad.shape == x.shape and [w.grad.shape for w in weights] == [w.shape for w in weights]
        if grouped and not compiled:  # backward concatenates neither the outputs' gradients nor the weights' gradients
            assert joined_rows([w.grad for w in weights]) is not None
            loss = sum(out.sum() for out in fn(x, weights))
            with OpCounter() as backward:
                loss.backward()
            assert backward.ops_by_op["cat"] == 0, backward.ops_by_op
    assert all(torch.Size(s).numel() != batch * shard * p * d for s in shapes), shapes  # no [N, d] gathered input
    assert {(batch, shard, d), (batch * shard, d)} & set(shapes), shapes  # the [N/p, d] shard


@pytest.fixture(scope="module")
def fallback():
    return launch(sequence_parallel_cases.fallback_cases, 2, timeout=600)


def test_a_pre_hooked_or_replaced_projection_runs_on_the_gathered_tokens_and_matches_one_device(fallback):
    assert len(fallback) == 2 and all(len(rank_cases) == 6 for rank_cases in fallback)
    for rank_cases in fallback:
        for case in rank_cases:
            assert case["loss_rel"] <= TOL and case["grad_rel"] <= TOL, case
            seq = sequence_parallel_cases.SEQ
            seen_seq = {name: shapes[0][1] for name, shapes in case["seen"].items()}
            # the plain group's projections read the token shard; a group with a changed projection, every token
            expected_attention = seq if case["change"] != "none" else seq // 2
            assert seen_seq["q_proj"] == expected_attention and seen_seq["gate_proj"] == seq // 2, case
            if case["change"] != "replaced":  # the replacement is an nn.Linear without the forward hook
                assert seen_seq["k_proj"] == expected_attention, case
            assert all(shapes[1][1] == seq for shapes in case["seen"].values()), case  # outputs hold every token
