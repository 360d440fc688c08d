"""transformers' common model tests pointed at boost-hf's classes, once per bottleneck.

Not collected by boost-hf's own test run (its name does not start with ``test_``):
``run_hf_common_tests.sh`` copies it to ``tests/models/boost_llama/test_modeling_boost_llama.py`` in a scratch
folder next to transformers' own ``tests/`` (from the pinned version's source distribution) and runs it
there. Only our config and classes are swapped in (as transformers' ``tests/models/llama`` does for
``LlamaConfig``/``LlamaModel``/``LlamaForCausalLM``); each class below sets the bottleneck and rank through
the tester's config kwargs. Tests that cannot apply are listed in :data:`NOT_APPLICABLE` with the reason.
"""

import unittest

from transformers import is_torch_available

from ...causal_lm_tester import CausalLMModelTest, CausalLMModelTester

if is_torch_available():
    from transformers.models.auto import modeling_auto

    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, BoostLlamaModel
    from boost_hf.modeling_boost_llama import BoostLlamaRotaryEmbedding

    # The common tests pick labels and base-model rules by class name from transformers' own name tables
    # (where an in-tree model is listed); list ours there as LLaMA is. boost_hf itself registers the classes
    # with the Auto* factories at import.
    modeling_auto.MODEL_MAPPING_NAMES.setdefault("boost_llama", "BoostLlamaModel")
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("boost_llama", "BoostLlamaForCausalLM")

# test name -> why it cannot apply to boost-hf (each is skipped with this reason)
NOT_APPLICABLE = {
    "test_sequence_classification_model": "boost-hf offers no sequence-classification head",
    "test_sequence_classification_model_for_single_label": "boost-hf offers no sequence-classification head",
    "test_sequence_classification_model_for_multi_label": "boost-hf offers no sequence-classification head",
    "test_token_classification_model": "boost-hf offers no token-classification head",
    "test_tp_plan_matches_params": "tensor parallelism is boost-hf's own (parallelize / ParallelConfig), not a tp_plan",
    "test_tied_head_has_a_tp_plan_entry": "tensor parallelism is boost-hf's own (parallelize / ParallelConfig), not a tp_plan",
}


class BoostLlamaModelTester(CausalLMModelTester):
    if is_torch_available():
        config_class = BoostLlamaConfig
        base_model_class = BoostLlamaModel
        causal_lm_class = BoostLlamaForCausalLM

    bottleneck = None
    rank = None

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self.bottleneck = type(self).bottleneck
        self.rank = type(self).rank
        self.hidden_act = "silu"  # the tester's "gelu" would do too; LLaMA's own default


def _tester(bottleneck, rank):
    return type(f"BoostLlama{(bottleneck or 'Full').capitalize()}ModelTester", (BoostLlamaModelTester,),
                {"bottleneck": bottleneck, "rank": rank})


class _BoostLlamaCommon(CausalLMModelTest):
    pipeline_model_mapping = (
        {"feature-extraction": BoostLlamaModel, "text-generation": BoostLlamaForCausalLM} if is_torch_available() else {}
    )
    all_generative_model_classes = (BoostLlamaForCausalLM,) if is_torch_available() else ()
    rotary_embedding_layer = BoostLlamaRotaryEmbedding if is_torch_available() else None
    # HF runs this one only for models added in 2023 or later (read off a "# Copyright <year>" line): ours is.
    test_can_init_all_missing_weights_before_2023 = True

    def setUp(self):
        name = self._testMethodName
        for prefix, reason in NOT_APPLICABLE.items():
            if name == prefix or name.startswith(prefix + "_"):
                self.skipTest(reason)
        super().setUp()


class BoostLlamaFullModelTest(_BoostLlamaCommon, unittest.TestCase):
    model_tester_class = _tester(None, None)


class BoostLlamaSvdModelTest(_BoostLlamaCommon, unittest.TestCase):
    model_tester_class = _tester("svd", 8)


class BoostLlamaColaModelTest(_BoostLlamaCommon, unittest.TestCase):
    model_tester_class = _tester("cola", 8)


class BoostLlamaLaxModelTest(_BoostLlamaCommon, unittest.TestCase):
    model_tester_class = _tester("lax", 8)
