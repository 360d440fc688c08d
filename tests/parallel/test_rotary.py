"""RoPE of the tensor-parallel attention (boost_hf/parallel/rotary.py): transformers' function, in the compute
dtype, without copies."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from boost_hf import BoostLlamaConfig
from boost_hf.modeling_boost_llama import BoostLlamaRotaryEmbedding
from boost_hf.parallel.modules import adopt
from boost_hf.parallel.rotary import ComputeDtypeRotaryEmbedding, apply_rotary
from boost_hf.perf.op_counter import OpCounter

B, S, HQ, HK, D = 2, 5, 4, 2, 8


def _fused_qkv(dtype=torch.float64):
    """``q: [B, S, HQ, D]`` and ``k: [B, S, HK, D]`` as adjacent views of one fused GEMM output (and ``v``)."""
    qkv = torch.randn(B, S, (HQ + 2 * HK) * D, dtype=dtype, requires_grad=True)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    return qkv, q.view(B, S, HQ, D), k.view(B, S, HK, D)


def _separate(dtype=torch.float64):
    q = torch.randn(B, S, HQ * D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, HK * D, dtype=dtype, requires_grad=True)
    return (q, k), q.view(B, S, HQ, D), k.view(B, S, HK, D)


@pytest.mark.parametrize("make", [_separate, _fused_qkv], ids=["separate", "fused"])
def test_equals_transformers_rope_forward_and_backward(make):
    torch.manual_seed(0)
    leaves, q, k = make()
    cos, sin = torch.randn(1, S, D, dtype=torch.float64), torch.randn(1, S, D, dtype=torch.float64)  # any tables
    ours = apply_rotary(q, k, cos, sin)
    reference = [t.transpose(1, 2) for t in apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)]
    weights = [torch.randn_like(t) for t in ours]
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-12)
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(out, weights)), leaves) for out in (ours, reference)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: apply_rotary(a, b, cos, sin), (q.detach().requires_grad_(), k.detach().requires_grad_()))


@pytest.mark.parametrize("make", [_separate, _fused_qkv], ids=["separate", "fused"])
def test_runs_in_the_compute_dtype_without_copies(make):
    _, q, k = make(torch.bfloat16)
    cos, sin = torch.randn(1, S, D), torch.randn(1, S, D)  # fp32 tables are cast to the queries' dtype
    with OpCounter() as forward:
        rq, rk = apply_rotary(q, k, cos, sin)
    grad_outputs = torch.ones_like(rq), torch.ones_like(rk)
    with OpCounter() as backward:
        grads = torch.autograd.grad((rq, rk), (q, k), grad_outputs)
    assert rq.dtype == rk.dtype == grads[0].dtype == grads[1].dtype == torch.bfloat16
    assert sum(forward.ops_by_op.values()) == (3 if make is _fused_qkv else 6) + 2  # + the two table casts
    assert dict(backward.ops_by_op) == {"mul": 2, "addcmul_": 4}
    assert not {"clone", "cat", "copy_"} & set(forward.ops_by_op)


def test_rotary_embedding_returns_tables_in_the_autocast_dtype():
    config = BoostLlamaConfig.from_preset("llama-60m")
    rotary = adopt(BoostLlamaRotaryEmbedding(config), ComputeDtypeRotaryEmbedding)
    x, positions = torch.zeros(1, S, config.hidden_size), torch.arange(S)[None]
    reference = BoostLlamaRotaryEmbedding(config)(x, positions)
    assert all(t.dtype == torch.float32 and torch.equal(t, r) for t, r in zip(rotary(x, positions), reference))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tables = rotary(x, positions)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, r.bfloat16()) for t, r in zip(tables, reference))
