"""``generate`` on every bottleneck, as a ``LlamaForCausalLM`` user relies on it: the decoding strategies
with dict outputs (scores, logits, attentions, hidden states per step), cache equivalences, left padding,
continuing from a cache, prompts given as embeddings, assisted and prompt-lookup decoding, and compiled
static-cache generation. (transformers' own ``GenerationTesterMixin`` for 5.23 is not in its source
distribution; see ``tests/hf_common_tests.md``.)"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from transformers import CompileConfig, DynamicCache

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from boost_hf.modeling_boost_llama import CACHE_NAME

BOTTLENECKS = [None, "svd", "cola", "lax", "tt"]
NEW = 3  # new tokens per generate call
LAYERS, HEADS = 2, 4


def build(bottleneck, attn="eager") -> BoostLlamaForCausalLM:
    config = BoostLlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64, rank=8,
                              bottleneck=bottleneck, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config)
    model.set_attn_implementation(attn)
    return model.eval()


def prompt(batch: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.fixture(params=BOTTLENECKS, ids=lambda b: str(b))
def bottleneck(request):
    return request.param


STRATEGIES = {
    "greedy": dict(do_sample=False, num_beams=1),
    "sample": dict(do_sample=True, num_beams=1, top_k=10),
    "beam": dict(do_sample=False, num_beams=2, num_return_sequences=2),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=10),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_dict_outputs_of_every_strategy(bottleneck, strategy):
    """Per generated step: scores and logits ``[rows, V]``, attentions per layer ``[rows, heads, q, kv]``,
    hidden states per layer (embeddings + each block) ``[rows, q, d]``; the first step sees the prompt."""
    model, x = build(bottleneck), prompt()
    torch.manual_seed(0)
    out = model.generate(x, max_new_tokens=NEW, return_dict_in_generate=True, output_scores=True, output_logits=True,
                         output_attentions=True, output_hidden_states=True, **STRATEGIES[strategy])
    beams = STRATEGIES[strategy]["num_beams"]
    rows = x.shape[0] * beams
    assert out.sequences.shape == (x.shape[0] * STRATEGIES[strategy].get("num_return_sequences", 1), x.shape[1] + NEW)
    assert len(out.scores) == len(out.logits) == len(out.attentions) == len(out.hidden_states) == NEW
    for step in range(NEW):
        q = x.shape[1] if step == 0 else 1
        kv = x.shape[1] + step
        assert out.scores[step].shape == out.logits[step].shape == (rows, 96)
        assert len(out.attentions[step]) == LAYERS and len(out.hidden_states[step]) == LAYERS + 1
        assert all(a.shape == (rows, HEADS, q, kv) for a in out.attentions[step])
        assert all(h.shape == (rows, q, 32) for h in out.hidden_states[step])
    if beams > 1:
        assert out.sequences_scores.shape == (out.sequences.shape[0],) and out.beam_indices is not None


def test_greedy_is_the_argmax_of_the_forward(bottleneck):
    """Greedy decoding picks, step after step, the argmax of a full forward over the tokens so far."""
    model, x = build(bottleneck), prompt()
    out = model.generate(x, max_new_tokens=NEW, do_sample=False)
    seq = x
    for _ in range(NEW):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def argmax_continuation(model, x: torch.Tensor, new: int) -> torch.Tensor:
    """``x`` continued ``new`` tokens by the argmax of a full forward (no cache) over the tokens so far."""
    with torch.no_grad():
        for _ in range(new):
            x = torch.cat([x, model(x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


CACHED_PATHS = {  # generate's keyword arguments -> the same without the cache
    "greedy": dict(do_sample=False),
    "static-cache": dict(do_sample=False, cache_implementation="static"),
    "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "sample": dict(do_sample=True, top_k=10),
}


@pytest.mark.parametrize("path", list(CACHED_PATHS))
def test_cached_generation_equals_uncached_generation(bottleneck, path, caplog):
    """Every decoding path with its KV cache gives the tokens it gives without one (each step a full forward), and greedy
    ones are the argmax of the forward, on whichever transformers runs (5.24 passes the cache as ``cache``, earlier
    releases as ``past_key_values``): a cache the model did not read would restart at position 0 every step. Nothing
    warns of a deprecated name."""
    model, x = build(bottleneck), prompt(length=6)
    new = 8
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="transformers"):
        warnings.simplefilter("error", FutureWarning)
        torch.manual_seed(0)
        cached = model.generate(x, max_new_tokens=new, **CACHED_PATHS[path])
        torch.manual_seed(0)
        uncached = model.generate(x, max_new_tokens=new, use_cache=False,
                                  **{k: v for k, v in CACHED_PATHS[path].items() if k != "cache_implementation"})
    assert not [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert torch.equal(cached, uncached)
    if path in ("greedy", "static-cache"):
        assert torch.equal(cached, argmax_continuation(model, x, new))


def test_the_cache_under_either_name_gives_the_same_logits(bottleneck):
    """A forward given the cache as ``cache`` or as ``past_key_values`` continues from it; two different caches at once
    are refused."""
    model, x = build(bottleneck), prompt(length=6)
    with torch.no_grad():
        whole = model(x).logits[:, -1]
        for name in ("cache", "past_key_values"):
            cache = DynamicCache(config=model.config)
            model(x[:, :-1], **{name: cache}, use_cache=True)
            assert cache.get_seq_length() == x.shape[1] - 1, name
            torch.testing.assert_close(model(x[:, -1:], **{name: cache}, use_cache=True).logits[:, -1], whole,
                                       rtol=1e-5, atol=1e-5 * whole.abs().max().item(), msg=name)
        with pytest.raises(ValueError, match="two KV caches"):
            model(x, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))


def test_left_padding_does_not_change_the_continuation(bottleneck):
    """A prompt left-padded in a batch with a longer one continues as it does alone."""
    model, x = build(bottleneck, attn="sdpa"), prompt(batch=1)
    alone = model.generate(x, max_new_tokens=NEW, do_sample=False)
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), x], dim=1), prompt(batch=1, length=8)])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    out = model.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out[0, 3:], alone[0])


def test_continuing_from_a_cache_equals_one_call(bottleneck):
    model, x = build(bottleneck), prompt()
    once = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=2 * NEW, do_sample=False)
    first = model.generate(x, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                           **{CACHE_NAME: DynamicCache(config=model.config)})  # the running transformers' name
    assert getattr(first, CACHE_NAME).get_seq_length() == x.shape[1] + NEW - 1
    again = model.generate(first.sequences, attention_mask=torch.ones_like(first.sequences), max_new_tokens=NEW,
                           do_sample=False, **{CACHE_NAME: getattr(first, CACHE_NAME)})
    assert torch.equal(again, once)


def test_prompt_as_embeddings_generates_the_same_tokens(bottleneck):
    model, x = build(bottleneck), prompt()
    by_ids = model.generate(x, max_new_tokens=NEW, do_sample=False)
    by_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(x), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(by_embeds, by_ids[:, x.shape[1]:])


def test_assisted_and_prompt_lookup_decoding_equal_greedy(bottleneck):
    model, x = build(bottleneck), prompt(batch=1)
    greedy = model.generate(x, max_new_tokens=NEW, do_sample=False)
    assistant = build("cola")
    assert torch.equal(model.generate(x, max_new_tokens=NEW, do_sample=False, assistant_model=assistant), greedy)
    assert torch.equal(model.generate(x, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=2), greedy)


def test_compiled_static_cache_generation_equals_eager(bottleneck):
    """``generate`` with a static cache runs the ``torch.compile``'d (full-graph) model and decodes the same
    tokens. (On CPU transformers compiles only when asked to for every device.)"""
    model, x = build(bottleneck, attn="sdpa"), prompt()
    eager = model.generate(x, max_new_tokens=NEW, do_sample=False)
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    compiled = model.generate(x, max_new_tokens=NEW, do_sample=False, cache_implementation="static", compile_config=config)
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, eager)


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, 96)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")


def test_pipelines_load_a_saved_model_by_path(bottleneck, tmp_path):
    """``pipeline("text-generation")`` and ``pipeline("feature-extraction")`` on a saved folder (through the
    Auto classes) continue and embed as the model does."""
    from transformers import pipeline

    model, tokenizer = build(bottleneck, attn="sdpa"), _word_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    text = "w5 w17 w33 w8"
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    generated = generator(text, max_new_tokens=NEW, do_sample=False, return_full_text=False)[0]["generated_text"]
    x = tokenizer(text, return_tensors="pt").input_ids
    expected = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False)[0, x.shape[1]:]
    assert generated.split() == tokenizer.convert_ids_to_tokens(expected.tolist())
    features = pipeline("feature-extraction", model=str(tmp_path), device="cpu")(text, return_tensors=True)
    torch.testing.assert_close(features[0], model.model(x).last_hidden_state[0])
