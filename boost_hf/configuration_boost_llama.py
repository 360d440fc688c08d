"""Configuration of the boost-hf LLaMA family: full-rank LLaMA and its low-rank bottleneck variants.

Every one of the 7 projections of a decoder block (q, k, v, o, gate, up, down) is either a dense
``W (d_in -> d_out)`` (``bottleneck=None``, exactly ``transformers.LlamaForCausalLM``) or a bottleneck
``A (d_in -> r), B (r -> d_out)``:

=========  ==============================================================================
svd        ``y = B (A x)``
cola       ``y = B act(A x)``                                   (CoLA)
lax        block 0: ``h = act(A x)``; block l > 0: ``h = act(LayerNorm_r(A x + G h_prev))``;
           ``y = B h``; ``h_prev`` is the previous block's ``h`` of the same projection
           (LaX latent crossing, as its authors' ``TensorizedLinear``)
=========  ==============================================================================

With ``attention_bias`` / ``mlp_bias`` a bottleneck projection adds its bias after ``B`` (as CoLA does).

All validation lives in :meth:`BoostLlamaConfig.validate`, called on construction.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

BOTTLENECKS = (None, "svd", "cola", "lax")
LAX_GATES = ("dense", "kronecker", "identity")
LAX_BASES = ("cola", "svd")
FACTOR_INITS = ("cola", "xavier")
"""How the bottleneck factors ``A`` and ``B`` are drawn (``factor_init``): ``"cola"``, both ``N(0, s^2)`` with
``s = r^(-1/4) (d_in + d_out)^(-1/4)`` (CoLA's ``ColaLayer``); ``"xavier"``, each factor Xavier-normal on its own shape,
``A [r, d_in]`` with std ``sqrt(2 / (r + d_in))`` and ``B [d_out, r]`` with ``sqrt(2 / (d_out + r))`` (the LORO authors'
``--loro_init xavier``, ``torch.nn.init.xavier_normal_`` per factor)."""
LAX_VERSION = 2
"""The LaX definition this code computes: 2 = the authors' (block 0 plain, the latent fed to ``B`` handed on,
latent LayerNorm eps 1e-6, dense gate with a bias). 1 = boost-hf's earlier LaX (a latent LayerNorm in block 0,
the pre-norm sum handed on, eps 1e-5, no gate bias), another function: refused."""

# name -> (layers, hidden, heads, intermediate, rank): CoLA's table (60m..7b) and BOOST's (3b, 13b, 30b).
PRESET_SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "60m": (8, 512, 8, 1376, 128),
    "130m": (12, 768, 12, 2048, 256),
    "350m": (24, 1024, 16, 2736, 256),
    "1b": (24, 2048, 32, 5461, 512),
    "7b": (32, 4096, 32, 11008, 1024),
    "3b": (28, 3072, 24, 8192, 768),
    "13b": (40, 5120, 40, 13824, 1280),
    "30b": (36, 8192, 64, 22016, 2048),
}
PRESET_ARCHS: dict[str, str | None] = {"llama": None, "svd": "svd", "cola": "cola", "lax": "lax"}

AUTHORS_COLA_MODEL_TYPE = "cola"
"""``model_type`` of a ``config.json`` written by the CoLA authors' code (``alvin-zyl/CoLA``)."""
AUTHORS_COLA_M_MODEL_TYPE = "cola_m"
AUTHORS_COLA_DROPPED = ("model_type", "architectures", "auto_map", "lr_act_type", "pretraining_tp", "max_sequence_length", "rope_scaling")


def from_authors_cola(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The fields of a ``config.json`` written by the CoLA authors' code as ours.

    Their ``ColaConfig`` is a ``LlamaConfig`` plus ``rank`` (default ``hidden_size // 4``), ``only_lr_act``
    (default true) and ``lr_act_type``. Their projections apply ``hidden_act`` to the latent whatever
    ``lr_act_type`` says, so ``lr_act = hidden_act``; ``max_sequence_length`` and ``lr_act_type`` are unused by
    their model and dropped; ``pad_token_id`` (0 in their configs: a zero, frozen embedding row) and the biases
    after ``B`` (``attention_bias`` / ``mlp_bias``) mean the same here. Raises ``ValueError`` for what their
    model cannot run (``pretraining_tp > 1``, key/value heads other than the query heads: their k and v
    projections are ``heads * head_dim`` wide) or what is not converted (``rope_scaling``).
    """
    if config_dict.get("model_type") == AUTHORS_COLA_M_MODEL_TYPE:
        raise ValueError(
            "a CoLA-M checkpoint (model_type 'cola_m', ColaMForCausalLM) splits each projection over pre_/post_ modules "
            "and moves each block's down-projection B into the next block: it is not converted. Load it with the "
            "authors' code into ColaForCausalLM (the same function) and save that; its folder loads here."
        )
    if config_dict.get("pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp={config_dict['pretraining_tp']}: the CoLA authors' model only runs with 1.")
    if config_dict.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={config_dict['rope_scaling']!r} in a CoLA authors' config.json is not converted: remove it or convert by hand.")
    heads = config_dict.get("num_attention_heads", 32)
    if config_dict.get("num_key_value_heads") not in (None, heads):
        raise ValueError(
            f"num_key_value_heads={config_dict['num_key_value_heads']} differs from num_attention_heads={heads}: the CoLA "
            "authors' k_proj and v_proj are num_attention_heads * head_dim wide, so such a checkpoint has no GQA to convert."
        )
    ours = {key: value for key, value in config_dict.items() if key not in AUTHORS_COLA_DROPPED}
    ours.update(bottleneck="cola", lr_act=config_dict.get("hidden_act", "silu"))
    return ours



# ---------------------------------------------------------------------- field checks
INT_FIELDS_AT_LEAST_1 = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
OPTIONAL_INT_FIELDS = {"rank": None, "lax_kronecker_factor": 1, "lax_version": None}  # name -> minimum (rank's range: validate())
BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "attention_bias", "mlp_bias", "only_lr_act", "lax_latent_norm")
ACTIVATION_FIELDS = ("hidden_act", "lr_act")
TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = 1) -> None:
    """``value`` must be an int (not a bool, float or str) and at least ``minimum`` (``None``: any int)."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}: write it without quotes or decimals.")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def check_real(name: str, value, *, positive: bool = False, low: float | None = None, high: float | None = None) -> None:
    """``value`` must be a finite real number (an int is fine), ``> 0`` if ``positive``, within ``[low, high)``."""
    if not _is_real(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}: write it without quotes.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")
    if low is not None and high is not None and not low <= value < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {value}.")


def check_config_fields(config) -> None:
    """Raise ``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the first bad field of ``config``.

    Checks integers (``>= 1``; ``rank`` and ``lax_kronecker_factor`` may be ``None``), booleans, the
    activations (``hidden_act``, ``lr_act``: names of ``transformers.activations.ACT2FN``), ``initializer_range``
    (finite, > 0), ``rms_norm_eps`` (> 0), ``attention_dropout`` (in [0, 1)), ``rope_parameters`` (a dict with a
    finite ``rope_theta`` > 0) and, when set, the special token ids (``0 <= id < vocab_size``).
    """
    for name in INT_FIELDS_AT_LEAST_1:
        check_int(name, getattr(config, name))
    for name, minimum in OPTIONAL_INT_FIELDS.items():
        if getattr(config, name, None) is not None:
            check_int(name, getattr(config, name), minimum=minimum)
    for name in BOOL_FIELDS:
        value = getattr(config, name, False)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be true or false, got {type(value).__name__} {value!r}.")
    for name in ACTIVATION_FIELDS:
        if name == "lr_act" and getattr(config, "bottleneck", None) is None:
            continue  # full rank has no latent activation
        value = getattr(config, name)
        if not isinstance(value, str) or value not in ACT2FN:
            raise ValueError(f"unknown {name} {value!r}: use an activation name of transformers' ACT2FN, e.g. 'silu' or 'gelu'.")
    check_real("initializer_range", config.initializer_range, positive=True)
    check_real("rms_norm_eps", config.rms_norm_eps, positive=True)
    check_real("attention_dropout", config.attention_dropout, low=0.0, high=1.0)
    rope = config.rope_parameters
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        raise ValueError(f"rope_parameters must be a dict with a 'rope_theta' (e.g. {{'rope_type': 'default', 'rope_theta': 10000.0}}), got {rope!r}.")
    check_real("rope_theta", rope["rope_theta"], positive=True)
    for name in TOKEN_ID_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            check_int(name, value, minimum=0)
            if value >= config.vocab_size:
                raise ValueError(f"{name} ({value}) must be < vocab_size ({config.vocab_size}): raise vocab_size or fix the token id.")


class BoostLlamaConfig(PretrainedConfig):
    r"""Configuration of :class:`~boost_hf.BoostLlamaForCausalLM`.

    The LLaMA fields have the names and defaults of ``transformers.LlamaConfig``. Extra fields:

    Args:
        bottleneck: ``None`` (full-rank LLaMA), ``"svd"``, ``"cola"`` or ``"lax"``.
        rank: bottleneck rank ``r`` of every projection; default ``hidden_size // 4``.
        only_lr_act: CoLA: drop the SwiGLU SiLU of the MLP and keep only the latent activations
            (``down(gate(x) * up(x))``). CoLA's 60M/130M reference configs set it to ``False``.
        lr_act: activation applied to the r-dim latent (cola, and lax on a cola base); any
            ``transformers.activations.ACT2FN`` name. Default ``"silu"``.
        lax_gate: LaX crossing gate ``G`` (r x r): ``"kronecker"`` (default, as in every configuration the LaX
            authors published: ``G = L kron R`` with two factors of sizes ``a`` and ``r / a``, see
            ``lax_kronecker_factor``), ``"dense"`` (``r x r`` weight and a bias) or ``"identity"`` (no parameters).
        lax_latent_norm: LaX: LayerNorm (eps 1e-6) over the r-dim latent after the crossing (blocks after the
            first; the authors always apply it).
        lax_base: ``"cola"`` (activation on the latent) or ``"svd"`` (no activation).
        lax_kronecker_factor: left factor size of the Kronecker gate; must divide ``rank``. Default: the
            largest divisor of ``rank`` not above ``sqrt(rank)`` (the authors' most balanced pair).
        lax_version: the LaX definition (see :data:`LAX_VERSION`); only the current one is accepted. A saved
            LaX ``config.json`` without it was written by the earlier definition and is refused on load.
        initializer_range: std of the dense weights (embedding, LM head, full-rank projections).
        factor_init: how the bottleneck factors are initialised, ``"cola"`` (default) or ``"xavier"`` (each factor
            Xavier-normal, as the LORO authors initialise theirs); see :data:`FACTOR_INITS`. Initialisation only: it
            does not change what given weights compute.
    """

    model_type = "boost_llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 4096,
        intermediate_size: int = 11008,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        rope_parameters: dict[str, Any] | None = None,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        mlp_bias: bool = False,
        bottleneck: str | None = None,
        rank: int | None = None,
        only_lr_act: bool = True,
        lr_act: str = "silu",
        lax_gate: str = "kronecker",
        lax_latent_norm: bool = True,
        lax_base: str = "cola",
        lax_kronecker_factor: int | None = None,
        lax_version: int = LAX_VERSION,
        factor_init: str = "cola",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else (hidden_size // max(num_attention_heads, 1))
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.mlp_bias = mlp_bias
        if rope_parameters is None:
            rope_parameters = {"rope_type": "default", "rope_theta": float(rope_theta)}
        self.rope_parameters = dict(rope_parameters)
        self.bottleneck = bottleneck
        self.rank = rank if rank is not None else hidden_size // 4
        self.only_lr_act = only_lr_act
        self.lr_act = lr_act
        self.lax_gate = lax_gate
        self.lax_latent_norm = lax_latent_norm
        self.lax_base = lax_base
        self.lax_kronecker_factor = lax_kronecker_factor
        self.lax_version = lax_version
        self.factor_init = factor_init
        self.validate()  # before transformers' own checks, so every mistake gets our ValueError
        super().__init__(
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )

    # ------------------------------------------------------------------ derived sizes
    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def q_dim(self) -> int:
        """Width of the query projection output, ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projection outputs, ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @property
    def is_low_rank(self) -> bool:
        return self.bottleneck is not None

    @property
    def latent_activation(self) -> str | None:
        """Activation applied to the r-dim latent, or ``None`` (svd, lax on an svd base, full rank)."""
        if self.bottleneck == "cola" or (self.bottleneck == "lax" and self.lax_base == "cola"):
            return self.lr_act
        return None

    @property
    def mlp_activation(self) -> str | None:
        """Activation of the SwiGLU gate, or ``None`` when CoLA-style models drop it (``only_lr_act``)."""
        if self.latent_activation is not None and self.only_lr_act:
            return None
        return self.hidden_act

    @property
    def kronecker_factors(self) -> tuple[int, int]:
        """Sizes ``(a, b)`` with ``a * b == rank`` of the Kronecker-factored LaX gate."""
        a = self.lax_kronecker_factor
        if a is None:
            a = max(k for k in range(1, int(self.rank**0.5) + 1) if self.rank % k == 0)
        return a, self.rank // a

    ARCHITECTURE_FIELDS = (  # a class constant, not a config field
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
        "mlp_bias", "rope_theta", "bottleneck", "rank", "only_lr_act", "lr_act", "lax_gate", "lax_latent_norm",
        "lax_base", "lax_kronecker_factor", "lax_version",
    )
    """Fields that change what the same weights compute (the *architecture record* of a checkpoint's manifest)."""

    def architecture_record(self) -> dict:
        """The :attr:`ARCHITECTURE_FIELDS` of this config, JSON-serialisable. Options of a bottleneck that is not used
        are ``None`` (a full-rank model has no rank, an svd model no ``lr_act``), so two configs computing the same
        function have the same record."""
        record = {name: getattr(self, name, None) for name in self.ARCHITECTURE_FIELDS}
        if record["bottleneck"] is None:
            for name in ("rank", "only_lr_act", "lr_act"):
                record[name] = None
        if self.latent_activation is None:
            record["lr_act"] = record["only_lr_act"] = None
        if record["bottleneck"] == "lax":
            record["lax_kronecker_factor"] = list(self.kronecker_factors) if self.lax_gate == "kronecker" else None
        else:
            for name in ("lax_gate", "lax_latent_norm", "lax_base", "lax_kronecker_factor", "lax_version"):
                record[name] = None
        return record

    def architecture_differences(self, record: dict) -> list[str]:
        """``"only_lr_act: checkpoint True, config False"`` for every field where ``record`` (a checkpoint's) differs."""
        ours = self.architecture_record()
        return [f"{name}: checkpoint {record.get(name)!r}, config {ours[name]!r}" for name in self.ARCHITECTURE_FIELDS
                if json.dumps(record.get(name)) != json.dumps(ours[name])]

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """Canonical ``(d_in, d_out)`` of the 7 projections of a block."""
        d, f = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (d, self.q_dim),
            "k_proj": (d, self.kv_dim),
            "v_proj": (d, self.kv_dim),
            "o_proj": (self.q_dim, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
        }

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the field to change if the configuration is wrong or inconsistent."""
        check_config_fields(self)
        if self.bottleneck not in BOTTLENECKS:
            raise ValueError(
                f"Unknown bottleneck {self.bottleneck!r}: use one of None (full rank), 'svd', 'cola', 'lax'."
            )
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}): choose num_key_value_heads among the divisors of the head count."
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}): change one of them."
            )
        if self.head_dim < 1 or self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be a positive even number for rotary embeddings: "
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) into an even head size."
            )
        if self.factor_init not in FACTOR_INITS:
            raise ValueError(f"Unknown factor_init {self.factor_init!r}: use one of {FACTOR_INITS}.")
        if self.bottleneck is None:
            return
        smallest = min(min(shape) for shape in self.projection_shapes().values())
        if not 1 <= self.rank <= smallest:
            raise ValueError(
                f"rank ({self.rank}) must be between 1 and the smallest projection dimension ({smallest}, "
                f"from hidden_size={self.hidden_size}, kv width={self.kv_dim}, "
                f"intermediate_size={self.intermediate_size}): lower rank."
            )
        if self.bottleneck == "lax":
            if self.lax_gate not in LAX_GATES:
                raise ValueError(f"Unknown lax_gate {self.lax_gate!r}: use one of {LAX_GATES}.")
            if self.lax_base not in LAX_BASES:
                raise ValueError(f"Unknown lax_base {self.lax_base!r}: use one of {LAX_BASES}.")
            if self.lax_version != LAX_VERSION:
                raise ValueError(
                    f"lax_version {self.lax_version!r}: this LaX checkpoint was written by boost-hf's earlier LaX, which "
                    "computes another function than the LaX authors' (it LayerNorms the latent in block 0, hands the "
                    "pre-norm sum A x + G c_prev to the next block instead of the latent fed to B, uses eps 1e-5 and a "
                    f"dense gate without bias). Only lax_version={LAX_VERSION} (the authors' definition) is supported: "
                    "retrain the model, or load it with the boost-hf release that wrote it."
                )
            if self.lax_gate == "kronecker" and self.lax_kronecker_factor is not None:
                if self.lax_kronecker_factor < 1 or self.rank % self.lax_kronecker_factor != 0:
                    raise ValueError(
                        f"lax_kronecker_factor ({self.lax_kronecker_factor}) must divide rank ({self.rank})."
                    )

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs) -> tuple[dict[str, Any], dict[str, Any]]:
        """``PretrainedConfig.get_config_dict``, with a CoLA authors' ``config.json`` read as ours
        (:func:`from_authors_cola`)."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") in (AUTHORS_COLA_MODEL_TYPE, AUTHORS_COLA_M_MODEL_TYPE):
            config_dict = from_authors_cola(config_dict)
        return config_dict, kwargs

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "BoostLlamaConfig":
        """``PretrainedConfig.from_dict``; a CoLA authors' configuration is read as ours
        (:func:`from_authors_cola`); a saved LaX configuration without ``lax_version`` predates the authors'
        definition and is refused (see :data:`LAX_VERSION`)."""
        if config_dict.get("model_type") in (AUTHORS_COLA_MODEL_TYPE, AUTHORS_COLA_M_MODEL_TYPE):
            config_dict = from_authors_cola(config_dict)
        if config_dict.get("bottleneck") == "lax" and "lax_version" not in config_dict:
            config_dict = {**config_dict, "lax_version": 1}
        return super().from_dict(config_dict, **kwargs)

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset_names(cls) -> list[str]:
        return [f"{arch}-{size}" for arch in PRESET_ARCHS for size in PRESET_SIZES]

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "BoostLlamaConfig":
        """Build a reference configuration: ``"<arch>-<size>"`` with arch in llama (full rank), svd, cola,
        lax and size in 60m, 130m, 350m, 1b, 7b (CoLA's table) or 3b, 13b, 30b (BOOST's table).

        Vocabulary 32000, untied LM head, r = d/4 (CoLA), no GQA. ``overrides`` replace any field.
        """
        arch, _, size = name.lower().partition("-")
        if arch not in PRESET_ARCHS or size not in PRESET_SIZES:
            raise ValueError(f"Unknown preset {name!r}: use one of {', '.join(cls.preset_names())}.")
        layers, hidden, heads, intermediate, rank = PRESET_SIZES[size]
        fields: dict[str, Any] = dict(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=4096 if size in ("3b", "7b", "13b", "30b") else 2048,
            tie_word_embeddings=False,
            bottleneck=PRESET_ARCHS[arch],
            rank=rank,
            # CoLA's 60M/130M reference configs keep the SwiGLU SiLU.
            only_lr_act=size not in ("60m", "130m"),
        )
        fields.update(overrides)
        return cls(**fields)


# Every saved config ships this file and names it in ``auto_map`` (remote code: ``trust_remote_code=True``).
BoostLlamaConfig.register_for_auto_class()

__all__ = ["BoostLlamaConfig", "BOTTLENECKS", "FACTOR_INITS", "LAX_GATES", "LAX_BASES", "LAX_VERSION", "PRESET_SIZES", "AUTHORS_COLA_MODEL_TYPE", "from_authors_cola"]
