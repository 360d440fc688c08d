"""boost-hf: bottleneck-aware tensor parallelism (BOOST) for low-rank LLM pre-training, Hugging Face style."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_boost_llama import BoostLlamaConfig
from .modeling_boost_llama import BoostLlamaForCausalLM, BoostLlamaModel, BoostLlamaPreTrainedModel
from .parallel.comm_counter import CommCounter
from .parallel.config import ParallelConfig
from .parallel.parallelize import parallelize
from .checkpoint import model_hooks  # noqa: F401  (a ParallelConfig builds, loads and saves a shard through it)

AutoConfig.register(BoostLlamaConfig.model_type, BoostLlamaConfig, exist_ok=True)
AutoModel.register(BoostLlamaConfig, BoostLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(BoostLlamaConfig, BoostLlamaForCausalLM, exist_ok=True)

__version__ = "0.1.0"

_TRAINING = ("BoostTrainer", "BoostTrainingArguments")


def __getattr__(name: str):
    """``BoostTrainer`` / ``BoostTrainingArguments`` load lazily (importing ``transformers.Trainer`` is slow)."""
    if name in _TRAINING:
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'boost_hf' has no attribute {name!r}")

__all__ = [
    "BoostLlamaConfig",
    "BoostLlamaModel",
    "BoostLlamaForCausalLM",
    "BoostLlamaPreTrainedModel",
    "ParallelConfig",
    "parallelize",
    "CommCounter",
    "BoostTrainer",
    "BoostTrainingArguments",
]
