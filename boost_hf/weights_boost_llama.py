"""Where the weights of a boost-hf LLaMA come from: drawn from the seed by name, or loaded from a checkpoint.

A sibling of ``modeling_boost_llama.py`` that ships with it as remote code (``save_pretrained`` copies the files the
model file imports relatively), so it imports only ``torch``, ``transformers``, the standard library, the
configuration and the tensor-train projections.

:class:`SeededInitialization` draws every parameter from a generator seeded by the global seed and the parameter's
canonical name, so a model is reproducible from the seed alone and at every tensor-parallel size.

:class:`CheckedLoading` is the causal LM's ``from_pretrained``:

* a checkpoint of another architecture (missing, unexpected or wrongly-shaped weights) raises, unless the caller asks
  for the loading report or to ignore sizes;
* a checkpoint records the architecture its weights were trained as (boost-hf's ``manifest.json``, else its saved
  ``config.json``): a config that computes another function raises;
* a checkpoint written by the CoLA authors' code (``model_type: "cola"``) is converted while it loads;
* with a boost-hf ``parallel_config``, this rank's shard is loaded (through the config object: this file never
  imports boost-hf).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers import initialization as init
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import Transpose, WeightConverter

from .configuration_boost_llama import AUTHORS_COLA_MODEL_TYPE
from .tensor_train_boost_llama import BoostLlamaTensorTrainCores


def name_seed(seed: int, name: str) -> int:
    """A per-parameter seed from the global seed and the parameter's name (the same at every TP size)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def is_a(module: nn.Module, class_name: str) -> bool:
    """Whether ``module`` is an instance of the model file's class ``class_name`` (or of a subclass, e.g. a
    tensor-parallel module adopting it): matched by name, as transformers' ``_init_weights`` matches norms, since this
    file does not import the model file that imports it."""
    return any(cls.__name__ == class_name for cls in type(module).__mro__)


class SeededInitialization:
    """The initialisation of :class:`~.modeling_boost_llama.BoostLlamaPreTrainedModel` (a mixin before
    ``PreTrainedModel`` in its bases)."""

    def initial_value(self, module: nn.Module, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor | None:
        """The initial value of parameter ``name`` of ``module`` at its full ``shape`` (``None``: not ours).

        Dense weights ``N(0, initializer_range^2)``; bottleneck factors ``N(0, s^2)`` with
        ``s = r^(-1/4) (in + out)^(-1/4)`` (CoLA; ``factor_init="xavier"``: ``s = sqrt(2 / (rows + columns))`` of each
        factor's own shape) and the bias after ``B`` ``U(-out^(-1/2), out^(-1/2))`` (CoLA); LaX
        gates as their authors initialise them: the dense gate ``N(0, 0.02^2)`` with a zero bias (timm's
        ``nn.Linear`` init), each Kronecker factor ``[n, n]`` Kaiming-uniform ``U(-sqrt(6/n), sqrt(6/n))``;
        tensor-train cores ``[r_in, m, r_out]`` as the BOOST release initialises them, ``N(0, s^2)`` with
        ``s = (r_in r_out)^(-1/4) initializer_range^(1 / tt_cores)`` (their product has std about
        ``initializer_range``), and a zero bias; norm weights 1 and other biases 0.
        """
        low_rank, lax = is_a(module, "BoostLlamaLowRankLinear"), is_a(module, "BoostLlamaLaxLinear")
        if low_rank and name in ("A", "B") and self.config.factor_init == "xavier":
            std = (2.0 / (shape[0] + shape[1])) ** 0.5
        elif low_rank and name in ("A", "B"):
            std = (module.rank**-0.25) * ((module.in_features + module.out_features) ** -0.25)
        elif low_rank and name == "bias":
            bound = module.out_features**-0.5
            return torch.empty(shape).uniform_(-bound, bound, generator=generator)
        elif lax and name == "gate":
            std = 0.02
        elif isinstance(module, BoostLlamaTensorTrainCores):
            rank_in, _, rank_out = shape
            std = (rank_in * rank_out) ** -0.25 * self.config.initializer_range ** (1.0 / self.config.tt_cores)
        elif lax and name in ("gate_left", "gate_right"):
            bound = (6.0 / shape[1]) ** 0.5  # torch.nn.init.kaiming_uniform_ with its defaults (fan_in, a=0)
            return torch.empty(shape).uniform_(-bound, bound, generator=generator)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
            std = self.config.initializer_range
        elif name in ("bias", "gate_bias"):
            return torch.zeros(shape)
        elif (is_a(module, "BoostLlamaRMSNorm") or isinstance(module, nn.LayerNorm)) and name == "weight":
            return torch.ones(shape)
        else:
            return None
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def parameter_name(self, module: nn.Module, name: str) -> str:
        """The checkpoint name of ``module``'s parameter ``name``, relative to the base model (``lm_head.weight``)."""
        names = self.__dict__.get("_module_names")
        if names is None or module not in names:
            names = self.__dict__["_module_names"] = {m: n for n, m in self.named_modules()}
        full = f"{names[module]}.{name}" if names[module] else name
        prefix = self.base_model_prefix + "."
        return full[len(prefix):] if full.startswith(prefix) else full

    def _init_weights(self, module: nn.Module) -> None:
        """Every parameter is drawn from a generator seeded by ``(torch.initial_seed(), its name)``: the
        model is reproducible from the seed alone and independent of how it is later sharded."""
        if is_a(module, "BoostLlamaRotaryEmbedding"):
            super()._init_weights(module)
        for name, param in module.named_parameters(recurse=False):
            generator = torch.Generator().manual_seed(name_seed(torch.initial_seed(), self.parameter_name(module, name)))
            value = self.initial_value(module, name, tuple(param.shape), generator)
            if value is None:
                continue  # not a parameter of this model's own modules (e.g. an adapter added later)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                value[module.padding_idx] = 0.0
            init.copy_(param, value)


HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "subfolder", "proxies")


def is_authors_cola_checkpoint(pretrained_model_name_or_path, kwargs: dict) -> bool:
    """Whether the checkpoint's ``config.json`` was written by the CoLA authors' code (``model_type: "cola"``)."""
    hub = {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(pretrained_model_name_or_path, **hub)
    except OSError:
        return False  # no config to read: the ordinary load reports it
    return config_dict.get("model_type") == AUTHORS_COLA_MODEL_TYPE


def authors_cola_weight_conversions() -> list[WeightConverter]:
    """transformers' checkpoint conversions from the CoLA authors' parameters: ``*.cola_a [in, r]`` -> ``A``
    (transposed), ``*.cola_b [r, out]`` -> ``B`` (transposed); every other name (embedding, norms, biases after
    ``B``, LM head) is already ours."""
    return [
        WeightConverter(source_patterns="cola_a", target_patterns="A", operations=[Transpose(0, 1)]),
        WeightConverter(source_patterns="cola_b", target_patterns="B", operations=[Transpose(0, 1)]),
    ]


@contextlib.contextmanager
def converting_authors_cola(class_name: str):
    """Within: ``from_pretrained`` of ``class_name`` applies :func:`authors_cola_weight_conversions` (registered
    with transformers' conversion mapping for that class only while loading, then restored)."""
    previous = get_checkpoint_conversion_mapping(class_name)
    register_checkpoint_conversion_mapping(class_name, authors_cola_weight_conversions(), overwrite=True)
    try:
        yield
    finally:
        register_checkpoint_conversion_mapping(class_name, previous or [], overwrite=True)


class CheckedLoading:
    """The loading policy of :class:`~.modeling_boost_llama.BoostLlamaForCausalLM` (a mixin before
    ``PreTrainedModel`` in its bases: ``super().from_pretrained`` is transformers')."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, parallel_config=None, check_architecture=True, **kwargs):
        """``PreTrainedModel.from_pretrained``; with a boost-hf ``parallel_config``, this rank's shard of the
        given tensor-parallel layout, reading only this rank's slices of the checkpoint.

        A checkpoint (folder or Hub id) must match the model exactly: missing, unexpected or wrongly-shaped
        weights raise, unless ``output_loading_info=True`` (the report is returned instead) or
        ``ignore_mismatched_sizes=True`` (sizes only). ``from_pretrained(None, config=..., state_dict=...)``
        reads no checkpoint and behaves as in transformers (missing weights are initialised). A checkpoint records the
        architecture its weights were trained as (boost-hf's ``manifest.json``, else its saved ``config.json``): a config
        that computes another function (see :meth:`_check_saved_architecture`) raises unless ``check_architecture=False``.

        A checkpoint written by the CoLA authors' code (``model_type: "cola"``) is converted while it loads
        (:meth:`from_authors_cola`)."""
        if check_architecture and pretrained_model_name_or_path is not None:
            cls._check_saved_architecture(str(pretrained_model_name_or_path), kwargs)
        if pretrained_model_name_or_path is not None and is_authors_cola_checkpoint(pretrained_model_name_or_path, kwargs):
            return cls.from_authors_cola(pretrained_model_name_or_path, *model_args, parallel_config=parallel_config, **kwargs)
        if parallel_config is not None:  # the architecture was checked above
            return parallel_config.load_pretrained(cls, pretrained_model_name_or_path, *model_args, check_architecture=False, **kwargs)
        return cls._from_pretrained_checked(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def from_authors_cola(cls, pretrained_model_name_or_path, *model_args, parallel_config=None, **kwargs):
        """A checkpoint written by the CoLA authors' code (``alvin-zyl/CoLA``), loaded as it is: its
        ``config.json`` read as ours (``BoostLlamaConfig.get_config_dict``), its ``*.cola_a`` / ``*.cola_b``
        transposed into ``A`` / ``B`` by transformers' checkpoint conversion (:func:`authors_cola_weight_conversions`).
        The model saves in the canonical format. With a ``parallel_config`` the whole checkpoint is converted on
        each rank, then sliced into this rank's shard (no collective but the layout's checks)."""
        with converting_authors_cola(cls.__name__):
            loaded = cls._from_pretrained_checked(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model._weight_conversions = []  # converted once: save_pretrained writes our names, not the authors'
        if parallel_config is not None:
            parallel_config.parallelize(model)
        return loaded

    @classmethod
    def _from_pretrained_checked(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained`` that raises on any mismatch between checkpoint and model."""
        if pretrained_model_name_or_path is None:
            # No checkpoint to check (weights from ``state_dict=`` and ``config=`` only): exactly transformers'
            # behaviour, missing weights initialised and reported with ``output_loading_info``.
            return super().from_pretrained(None, *model_args, **kwargs)
        # Unlike a plain transformers load, a checkpoint of another architecture (missing, unexpected or
        # wrongly-shaped weights) is an error, unless the caller asks for the loading report or to ignore sizes.
        wants_report = kwargs.pop("output_loading_info", False)
        tolerate_sizes = kwargs.get("ignore_mismatched_sizes", False)
        kwargs["ignore_mismatched_sizes"] = True
        model, report = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        if wants_report:
            return model, report
        order = {name: i for i, name in enumerate(model.state_dict())}
        mismatched = [] if tolerate_sizes else sorted(report.get("mismatched_keys", ()), key=lambda m: order.get(m[0], -1))
        problems = {
            "missing": sorted(report.get("missing_keys", ()), key=lambda name: order.get(name, -1)),
            "unexpected": sorted(report.get("unexpected_keys", ())),
            "shape mismatch": [f"{name}: checkpoint {tuple(saved)} vs model {tuple(ours)}" for name, saved, ours in mismatched],
        }
        if any(problems.values()):
            earlier_lax = any(name.endswith(".gate_bias") for name in problems["missing"]) or any(
                ".layers.0." in name and ".latent_norm." in name for name in problems["unexpected"]
            )
            raise ValueError(
                "checkpoint does not match this model's architecture (was it saved from another bottleneck, rank "
                "or size? load it with its own config.json): "
                + "; ".join(f"{kind} {names[:5]}{'...' if len(names) > 5 else ''}" for kind, names in problems.items() if names)
                + (
                    ". These are LaX weights of boost-hf's earlier LaX (a latent LayerNorm in block 0, a dense gate "
                    "without bias), which computes another function than the LaX authors' definition used now."
                    if earlier_lax else ""
                )
            )
        return model

    @classmethod
    def _check_saved_architecture(cls, pretrained_model_name_or_path: str, kwargs: dict) -> None:
        """Raise ``ValueError`` naming the fields where the config used to load a checkpoint (``config=``, keyword
        overrides such as ``only_lr_act=False``, or an edited ``config.json``) differs from the architecture the
        checkpoint records: the same tensors would compute another function (a cola checkpoint read as svd,
        ``only_lr_act`` or the LaX base flipped, ...). The record is the folder's ``manifest.json`` (written by
        boost-hf's trainer) or else its saved ``config.json`` (``save_pretrained``; local or on the Hub); a checkpoint
        of another model type (e.g. ``LlamaForCausalLM``) has none here."""
        config = kwargs.get("config")
        if config is not None and not isinstance(config, cls.config_class):
            return
        record = cls._saved_architecture(pretrained_model_name_or_path, kwargs)
        if record is None:
            return
        if config is None:
            config, _ = cls.config_class.from_pretrained(pretrained_model_name_or_path, return_unused_kwargs=True, **kwargs)
        different = config.architecture_differences(record)
        if different:
            raise ValueError(
                f"{pretrained_model_name_or_path!r} was saved from another architecture than the config used to load it "
                f"({'; '.join(different)}): its weights would compute another function. Load it with its own config.json "
                "(no config= or overrides), or pass check_architecture=False to load the tensors anyway."
            )

    @classmethod
    def _saved_architecture(cls, pretrained_model_name_or_path: str, kwargs: dict) -> dict | None:
        """The architecture record of a checkpoint: its ``manifest.json``'s, else that of its ``config.json`` when it
        is a config of this model type; ``None`` when there is neither."""
        manifest = os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder") or "", "manifest.json")
        if os.path.isfile(manifest):
            with open(manifest) as f:
                record = json.load(f).get("architecture")
            if record is not None:
                return record
        hub = {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}
        try:
            saved, _ = cls.config_class.get_config_dict(pretrained_model_name_or_path, **hub)
        except OSError:
            return None  # no config to read: the ordinary load reports it
        if saved.get("model_type") != cls.config_class.model_type:
            return None
        return cls.config_class.from_dict(saved).architecture_record()


__all__ = ["CheckedLoading", "SeededInitialization", "name_seed", "HUB_KWARGS", "authors_cola_weight_conversions", "converting_authors_cola", "is_authors_cola_checkpoint"]
