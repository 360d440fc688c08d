"""Cases run inside launched process groups (see tests/distributed.py); imported by the children.

Each rank builds the single-device reference from the same seed itself, so every comparison is local.
"""

from __future__ import annotations

import contextlib
import tempfile

import torch
import torch.distributed as dist

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, CommCounter, ParallelConfig
from boost_hf.perf.activation_memory import SavedTensorsProbe, saved_elements_per_layer
from boost_hf.perf.comm_formula import layer_communication, model_communication
from boost_hf.parallel.sharding import ShardSpec, gather_full, gather_full_many, shard_spec_of

SEED = 1234
# GQA (8 heads, 4 kv heads) and every dimension divisible by 4 so TP 2 and 4 both apply.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, rank=16, max_position_embeddings=64)
BATCH, SEQ = 2, 8


def tiny_config(**overrides) -> BoostLlamaConfig:
    return BoostLlamaConfig(**{**TINY, **overrides})


def batch():
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :2] = -100  # some ignored targets
    return ids, labels


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


class LayerProbe(SavedTensorsProbe):
    """A layer's saved-for-backward bytes (:class:`SavedTensorsProbe`) and its forward collectives."""

    def __init__(self, layer):
        super().__init__(layer)
        self.counter = CommCounter()

    def _enter(self, *_) -> None:
        super()._enter()
        self.counter.__enter__()

    def _exit(self, *_) -> None:
        self.counter.__exit__()
        super()._exit()


def train_step(model):
    """Forward with labels, backward, one optimizer step; returns loss, canonical grads/params, comm counts.

    The step is SGD with momentum and weight decay: Adam's first step is ``lr * sign(g)`` for gradients
    near zero, which turns fp32 summation-order noise (any two GEMM orders) into steps of size ``lr``.
    """
    ids, labels = batch()
    model.train()
    with CommCounter() as fwd:
        loss = model(ids, labels=labels).loss
    with CommCounter() as bwd:
        loss.backward()
    group = model.plan.group if hasattr(model, "plan") else None  # the reference is the single-device model
    grads = gathered(model, lambda p: p.grad, group)
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01).step()
    params = gathered(model, lambda p: p.detach(), group)
    return float(loss.detach()), grads, params, fwd.counts(), bwd.counts()


def gathered(model, tensor_of, group) -> dict[str, torch.Tensor]:
    """``{name: canonical tensor_of(parameter)}``, in one all-gather (one collective per parameter would be
    most of the tp 4 launch's time: 4 ranks share 2 cores, so each collective waits for a rank to be scheduled)."""
    names, params = zip(*model.named_parameters())
    return dict(zip(names, gather_full_many([tensor_of(p) for p in params], [shard_spec_of(p) for p in params], group)))


def parity_case(case: dict) -> dict:
    config = tiny_config(**case.get("model", {}))
    torch.manual_seed(SEED)
    reference = BoostLlamaForCausalLM(config)
    initial = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_loss, ref_grads, ref_params, _, _ = train_step(reference)

    parallel = ParallelConfig(tp_size=dist.get_world_size(), **case["parallel"])
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    probe = LayerProbe(model.model.layers[1])
    init_exact = all(torch.equal(p, initial[n]) for n, p in gathered(model, lambda p: p.detach(), model.plan.group).items())
    loss, grads, params, fwd, bwd = train_step(model)
    losses = [None] * dist.get_world_size()
    dist.all_gather_object(losses, loss)
    return {
        "case": case,
        "init_exact": init_exact,
        "same_names": sorted(grads) == sorted(ref_grads),
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "loss_same_on_ranks": len(set(losses)) == 1,
        "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
        "param_rel": max(rel(params[n], ref_params[n]) for n in ref_params),
        "worst_grad": max(ref_grads, key=lambda n: rel(grads[n], ref_grads[n])),
        "fwd": fwd,
        "bwd": bwd,
        "layer_fwd": probe.counter.counts(),
        **expected_communication(config, parallel, fwd, bwd, probe),
    }


def expected_communication(config, parallel, fwd, bwd, probe) -> dict:
    """Compare the counted collectives (calls and elements per kind) with the analytic formula."""
    tokens = BATCH * SEQ
    model = model_communication(config, parallel, tokens, with_loss=True)
    layer = layer_communication(config, parallel, tokens)

    result = {
        "fwd_matches": fwd == model.forward.to_dict(),
        "bwd_matches": bwd == model.backward.to_dict(),
        "layer_fwd_matches": probe.counter.counts() == layer.forward.to_dict(),
        "expected_fwd": model.forward.to_dict(),
        "expected_bwd": model.backward.to_dict(),
        "saved_bytes": probe.saved_bytes,
    }
    if parallel.activation_checkpointing != "none":
        result["expected_saved_bytes"] = 4 * saved_elements_per_layer(config, parallel, tokens, layer_idx=1)
    return result


def parity_cases(cases: list[dict]) -> list[dict]:
    return [parity_case(case) for case in cases]


def all_cases(world_size: int) -> list[dict]:
    cases = [
        {"model": {"bottleneck": None}, "parallel": {"tp_style": "megatron", "group_linears": g, "activation_checkpointing": c}}
        for g in (True, False)
        for c in ("none", "full")
    ]
    for bottleneck in ("svd", "cola", "lax"):
        for group_linears in (True, False):
            for checkpointing in ("none", "full", "lowrank"):
                common = {"group_linears": group_linears, "activation_checkpointing": checkpointing}
                model = {"bottleneck": bottleneck, **({"lax_gate": "kronecker"} if bottleneck == "lax" else {})}
                cases.append({"model": model, "parallel": {"tp_style": "vanilla", **common}})
                for rmsnorm in ("online", "sync"):
                    cases.append({"model": model, "parallel": {"tp_style": "btp", "rmsnorm": rmsnorm, **common}})
    for gate in ("dense", "identity"):  # the dense gate carries a bias
        for style in ("btp", "vanilla"):
            cases.append({"model": {"bottleneck": "lax", "lax_gate": gate, "lax_base": "svd"}, "parallel": {"tp_style": style}})
    cases.append({"model": {"bottleneck": "cola", "only_lr_act": False}, "parallel": {"tp_style": "btp"}})
    # biases after B (bottleneck) or of the dense projections (full rank), sharded with the output or added
    # once after the all-reduce
    biases = {"attention_bias": True, "mlp_bias": True}
    # a padding token that occurs in the batch: its embedding row stays zero and gets no gradient (CoLA's configs)
    padded = {"pad_token_id": int(batch()[0][0, 3])}
    cases += [
        {"model": {"bottleneck": None, **biases, **padded}, "parallel": {"tp_style": "megatron"}},
        {"model": {"bottleneck": None, **biases}, "parallel": {"tp_style": "megatron", "group_linears": False, "activation_checkpointing": "full"}},
        {"model": {"bottleneck": "cola", **biases}, "parallel": {"tp_style": "btp"}},
        {"model": {"bottleneck": "lax", "lax_gate": "dense", **biases}, "parallel": {"tp_style": "btp", "rmsnorm": "sync", "activation_checkpointing": "lowrank"}},
        {"model": {"bottleneck": "svd", **biases}, "parallel": {"tp_style": "btp", "group_linears": False}},
        {"model": {"bottleneck": "cola", **biases, **padded}, "parallel": {"tp_style": "vanilla"}},
        {"model": {"bottleneck": "cola", **padded}, "parallel": {"tp_style": "btp"}},
        {"model": {"bottleneck": "lax", "lax_gate": "dense", **biases}, "parallel": {"tp_style": "vanilla", "activation_checkpointing": "lowrank"}},
    ]
    return cases + tensor_train_cases() + sequence_parallel_cases()


def tensor_train_cases() -> list[dict]:
    """The BOOST release's tensor-train LLaMA (4 cores: modes of 64 (8, 8), of 96 (12, 8) / (8, 12), of 32 (4, 8); and 6
    cores with leading modes multiples of 4, input modes of 96 (4, 6, 4), output modes of 32 (4, 2, 4)): BTP (the first
    input and output cores split along their modes) with both exact norms, grouped or not, every checkpointing, biases;
    vanilla (the middle rank split)."""
    biases = {"attention_bias": True, "mlp_bias": True}
    return [
        {"model": {"bottleneck": "tt", "tt_cores": 6, "tt_leading_mode_multiple": 4}, "parallel": {"tp_style": "btp"}},
        {"model": {"bottleneck": "tt", **biases}, "parallel": {"tp_style": "btp", "group_linears": False, "activation_checkpointing": "lowrank"}},
        {"model": {"bottleneck": "tt"}, "parallel": {"tp_style": "btp", "rmsnorm": "sync", "activation_checkpointing": "full"}},
        {"model": {"bottleneck": "tt"}, "parallel": {"tp_style": "vanilla", "activation_checkpointing": "lowrank"}},
    ]


def sequence_parallel_cases() -> list[dict]:
    """Megatron with sequence parallelism: grouped or not, with and without full checkpointing, with biases
    (grouped or not);
    BTP with latent sequence parallelism: svd, cola and LaX (every gate), every exact norm, grouped or not,
    every checkpointing."""
    sp = {"tp_style": "megatron", "sequence_parallel": True}
    cases = [
        {"model": {"bottleneck": None}, "parallel": {**sp, "group_linears": g, "activation_checkpointing": c}}
        for g in (True, False)
        for c in ("none", "full")
    ]
    biases = {"attention_bias": True, "mlp_bias": True}
    cases.append({"model": {"bottleneck": None, **biases}, "parallel": {**sp, "activation_checkpointing": "full"}})
    cases += [{"model": {"bottleneck": None, **biases}, "parallel": {**sp, "group_linears": g}} for g in (True, False)]
    for bottleneck, rmsnorm, group_linears in (("cola", "online", True), ("svd", "sync", False), ("cola", "sync", True), ("svd", "online", False)):
        for checkpointing in ("none", "full", "lowrank"):
            cases.append({"model": {"bottleneck": bottleneck}, "parallel": {
                "tp_style": "btp", "sequence_parallel": True, "rmsnorm": rmsnorm, "group_linears": group_linears,
                "activation_checkpointing": checkpointing}})
    cases.append({"model": {"bottleneck": "cola", **biases}, "parallel": {"tp_style": "btp", "sequence_parallel": True, "activation_checkpointing": "lowrank"}})
    cases.append({"model": {"bottleneck": "tt", **biases}, "parallel": {"tp_style": "btp", "sequence_parallel": True, "activation_checkpointing": "lowrank"}})
    btp_sp = {"tp_style": "btp", "sequence_parallel": True}
    for checkpointing in ("none", "full", "lowrank"):  # LaX: the crossing and latent LayerNorm on N/p tokens
        cases.append({"model": {"bottleneck": "lax", "lax_gate": "kronecker"}, "parallel": {**btp_sp, "activation_checkpointing": checkpointing}})
    cases += [
        {"model": {"bottleneck": "lax", "lax_gate": "dense", **biases}, "parallel": {**btp_sp, "rmsnorm": "sync", "group_linears": False, "activation_checkpointing": "lowrank"}},
        {"model": {"bottleneck": "lax", "lax_gate": "identity", "lax_base": "svd"}, "parallel": btp_sp},
    ]
    return cases


def sequence_length_not_divisible() -> str | None:
    """Megatron with sequence parallelism on a sequence of ``world + 1`` tokens: the error, raised on every
    rank before any collective (``None`` if it ran)."""
    world = dist.get_world_size()
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(tiny_config(bottleneck=None), parallel_config=ParallelConfig(tp_size=world, tp_style="megatron", sequence_parallel=True))
    ids = torch.zeros(1, world + 1, dtype=torch.long)
    try:
        model(ids, labels=ids)
        message = None
    except ValueError as err:
        message = str(err)
    dist.barrier()
    return message


def checkpoint_round_trip(tmp_dir: str, bottleneck: str = "cola") -> dict:
    """Save at TP=world (BTP), load at TP=1 and TP=2 (and world): identical logits everywhere."""
    config = tiny_config(bottleneck=bottleneck)
    world = dist.get_world_size()
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(tp_size=world))
    ids, _ = batch()
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_dir)
    out = {}
    for tp in sorted({1, 2, world}):
        for style in ("btp", "vanilla"):
            loaded = BoostLlamaForCausalLM.from_pretrained(tmp_dir, parallel_config=ParallelConfig(tp_size=tp, tp_style=style))
            with torch.no_grad():
                out[f"tp{tp}-{style}"] = float((loaded(ids).logits - logits).abs().max())
    plain = BoostLlamaForCausalLM.from_pretrained(tmp_dir)
    with torch.no_grad():
        out["plain"] = float((plain(ids).logits - logits).abs().max())
    return out


def bad_configurations() -> dict:
    """Each bad layout raises ValueError on every rank before any collective (no hang)."""
    world = dist.get_world_size()
    bad = {
        "heads": (tiny_config(bottleneck="cola", num_attention_heads=3, num_key_value_heads=3, hidden_size=48, rank=12), ParallelConfig(tp_size=world)),
        "kv_heads": (tiny_config(bottleneck="cola", num_key_value_heads=1, rank=8), ParallelConfig(tp_size=world)),
        "megatron_lowrank": (tiny_config(bottleneck="cola"), ParallelConfig(tp_size=world, tp_style="megatron")),
        "btp_full_rank": (tiny_config(bottleneck=None), ParallelConfig(tp_size=world, tp_style="btp")),
        "tp_not_dividing_world": (tiny_config(bottleneck="cola"), ParallelConfig(tp_size=world + 1)),
        "tied_btp": (tiny_config(bottleneck="cola", tie_word_embeddings=True), ParallelConfig(tp_size=world)),
        # down_proj's input modes (9, 8): BTP cannot split the 9
        "tt_modes_btp": (tiny_config(bottleneck="tt", intermediate_size=72), ParallelConfig(tp_size=world)),
    }
    messages = {}
    for name, (config, parallel) in bad.items():
        try:
            BoostLlamaForCausalLM(config, parallel_config=parallel)
            messages[name] = None
        except ValueError as err:
            messages[name] = str(err)
    dist.barrier()  # every rank got here: nobody hangs in a collective
    return messages


HOOKED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn", "mlp")


def hugging_face_contract() -> dict:
    """A single-device model with forward hooks, then parallelized (the materialised model is sliced):
    the hooks fire, the logits are the single-device model's, ``inputs_embeds`` equal ``input_ids``, every layer's
    hidden state is returned and cached greedy generation gives the single-device model's uncached tokens."""
    world = dist.get_world_size()
    ids, _ = batch()
    out = {}
    for style, bottleneck in (("megatron", None), ("vanilla", "cola"), ("btp", "cola"), ("btp", "lax"), ("btp", "tt")):
        config = tiny_config(bottleneck=bottleneck)
        torch.manual_seed(SEED)
        model = BoostLlamaForCausalLM(config).eval()
        with torch.no_grad():
            reference = model(ids).logits
            continued = model.generate(ids[:1], max_new_tokens=4, do_sample=False, use_cache=False)
        calls = []
        for name, module in model.named_modules():
            if name.endswith(HOOKED):
                module.register_forward_hook(lambda m, i, o, name=name: calls.append(name))
        ParallelConfig(tp_size=world, tp_style=style).parallelize(model)
        with torch.no_grad():
            logits = model(ids).logits
            embeds = model.model.embed_tokens.weight  # [V, d] or a shard: look the ids up on one device instead
            from_embeds = model(inputs_embeds=torch.nn.functional.embedding(ids, gather_full(embeds, shard_spec_of(embeds), model.plan.group))).logits
            hidden = model(ids, output_hidden_states=True).hidden_states
        out[f"{style}-{bottleneck}"] = {
            "hooked": sorted(set(calls)) == sorted(n for n, _ in model.named_modules() if n.endswith(HOOKED)),
            "hook_calls": len(calls),
            "logits_rel": rel(logits, reference),
            "inputs_embeds_rel": rel(from_embeds, reference),
            "hidden_states": len(hidden),
            # the cached generate of the parallel model (the end-of-training sample) continues as one device does
            "cached_generate_equal": torch.equal(model.generate(ids[:1], max_new_tokens=4, do_sample=False), continued),
        }
    return out


def gather_many_round_trip() -> bool:
    """``gather_full_many`` of fp32 and bf16 shards along dims 0 and 1 and of a replicated tensor (one all-gather per
    dtype) returns the full tensors every rank sliced its shard from."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED)
    full = [torch.randn(4 * world, 3, generator=gen), torch.randn(2, 4 * world, generator=gen).bfloat16(),
            torch.randn(5, generator=gen), torch.randn(3, 2 * world, generator=gen)]
    specs = [ShardSpec(tuple(t.shape), dim, rank, world) for t, dim in zip(full, (0, 1, None, 1))]
    result = gather_full_many([spec.local_slice(t).clone() for t, spec in zip(full, specs)], specs, None)
    return all(g.dtype == t.dtype and torch.equal(g, t) for g, t in zip(result, full))


@contextlib.contextmanager
def shared_temporary_directory():
    """Global rank 0's temporary directory, the same path on every rank (one machine); removed after every rank
    has left the block."""
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        yield shared[0]
        dist.barrier()


def everything(world_size: int) -> dict:
    with shared_temporary_directory() as tmp:
        round_trip = checkpoint_round_trip(tmp + "/ckpt")
        tensor_train_round_trip = checkpoint_round_trip(tmp + "/ckpt-tt", "tt")
    return {
        "parity": parity_cases(all_cases(world_size)),
        "round_trip": round_trip,
        "tensor_train_round_trip": tensor_train_round_trip,
        "bad": bad_configurations(),
        "sequence_length_not_divisible": sequence_length_not_divisible(),
        "hugging_face": hugging_face_contract(),
        "gather_many": gather_many_round_trip(),
    }
