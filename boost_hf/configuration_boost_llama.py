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
tt         ``y = B (A x)`` with ``A`` and ``B`` contracted from tensor-train cores (the BOOST release's
           ``TensorTrainLinear``, :class:`TensorTrainShape`)
=========  ==============================================================================

With ``attention_bias`` / ``mlp_bias`` a bottleneck projection adds its bias after ``B`` (as CoLA does).

All validation lives in :meth:`BoostLlamaConfig.validate`, called on construction.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig
from transformers.activations import ACT2FN

BOTTLENECKS = (None, "svd", "cola", "lax", "tt")
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
PRESET_ARCHS: dict[str, str | None] = {"llama": None, "svd": "svd", "cola": "cola", "lax": "lax", "tt": "tt"}
# Tensor-train presets: the BOOST release's configs (examples/tensor/config_tt_llama_{60m,1b}.yaml: an intermediate size
# with balanced modes, 6 cores, tt_rank = the table's rank, 4096 positions; its 1b ties the embeddings) and, for the
# other sizes, boost-hf's: the table's shape, 6 cores, leading modes multiples of 4 (BTP at tp_size 2 and 4).
RELEASE_TT_PRESETS: dict[str, dict[str, Any]] = {
    "60m": dict(intermediate_size=1344, max_position_embeddings=4096),
    "1b": dict(intermediate_size=5472, max_position_embeddings=4096, tie_word_embeddings=True),
}
TT_PRESET_CORES = 6
TT_PRESET_LEADING_MODE_MULTIPLE = 4

AUTHORS_COLA_MODEL_TYPE = "cola"
"""``model_type`` of a ``config.json`` written by the CoLA authors' code (``alvin-zyl/CoLA``)."""
AUTHORS_COLA_M_MODEL_TYPE = "cola_m"
TENSOR_TRAIN_FIELDS = ("tt_rank", "tt_cores", "tt_rank_ratio", "tt_leading_mode_multiple")
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


# ---------------------------------------------------------------------- tensor train
@dataclass(frozen=True)
class TensorTrainShape:
    """The cores of one tensor-train projection ``d_in -> d_out``, as the BOOST release's ``TensorTrainLinear``
    (``examples/tensor/basic_tt_llama.py``) lays them out.

    ``modes = input_modes + output_modes`` (products ``d_in`` and ``d_out``); core ``i`` is
    ``[ranks[i], modes[i], ranks[i + 1]]`` (``ranks[0] = ranks[-1] = 1``). The input cores contract into
    ``A^T: [d_in, r]`` and the output cores into ``B^T: [r, d_out]``, ``r = ranks[len(input_modes)]`` (the
    *middle rank*); a row of ``A^T`` is indexed by ``(i_0, i_1, ...)`` row-major (``i_0``, the first input core's
    mode, varies slowest), a column of ``B^T`` by ``(o_0, o_1, ...)`` likewise."""

    input_modes: tuple[int, ...]
    output_modes: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def modes(self) -> tuple[int, ...]:
        return self.input_modes + self.output_modes

    @property
    def core_shapes(self) -> list[tuple[int, int, int]]:
        """``[rank_in, mode, rank_out]`` of every core, input cores first."""
        return [(self.ranks[i], mode, self.ranks[i + 1]) for i, mode in enumerate(self.modes)]

    @property
    def split(self) -> int:
        """Index of the first output core."""
        return len(self.input_modes)

    @property
    def middle_rank(self) -> int:
        return self.ranks[self.split]

    @property
    def parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.core_shapes)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@functools.cache
def _balanced_factors(n: int, count: int) -> tuple[int, ...]:
    """The release's balanced exact factorisation of ``n`` into ``count`` factors, in the order it builds them: one
    factor is ``n`` itself; otherwise each divisor ``d`` of ``n`` (ascending) followed by the balanced factorisation
    of ``n / d`` into ``count - 1`` factors is a candidate, and the candidate with the smallest sum of squared
    deviations from its mean wins (the first one on a tie; float arithmetic as the release computes it)."""
    if count == 1:
        return (n,)
    best, best_spread = None, math.inf
    for d in _divisors(n):
        candidate = (d, *_balanced_factors(n // d, count - 1))
        mean = sum(candidate) / len(candidate)
        spread = sum((f - mean) ** 2 for f in candidate)
        if spread < best_spread:
            best, best_spread = candidate, spread
    return best


def tensor_train_modes(n: int, count: int, *, descending: bool, leading_multiple: int = 1) -> tuple[int, ...]:
    """The modes of ``n`` over ``count`` cores: the release's balanced factors sorted descending (input modes) or
    ascending (output modes). With ``leading_multiple > 1`` and a first mode that is not a multiple of it, the first
    mode (in that order) that is becomes the leading one, the others keeping their order (the same factors, another
    order: boost-hf's choice, so that tensor parallelism can split the leading mode); unchanged if none is."""
    modes = sorted(_balanced_factors(n, count), reverse=descending)
    if modes[0] % leading_multiple != 0:
        multiples = [mode for mode in modes if mode % leading_multiple == 0]
        if multiples:
            modes.remove(multiples[0])
            modes.insert(0, multiples[0])
    return tuple(modes)


def tensor_train_ranks(modes: tuple[int, ...], tt_rank: int, tt_rank_ratio: float) -> tuple[int, ...]:
    """Bond ranks of cores of ``modes`` as the release's ``validate_tt_rank(rank=tt_rank, constant_rank=True,
    allow_overparametrization=False, per_decomp_rank_ratio_limit=tt_rank_ratio)`` gives them: 1 at both ends; the
    rank after core ``i - 1`` is ``tt_rank`` if that is at most ``cap = min(rank_{i-1} modes[i-1], prod(modes[i:]))``
    (what an SVD of that unfolding can realise), else ``int(cap * tt_rank_ratio)``."""
    ranks = [1]
    for i in range(1, len(modes)):
        cap = min(ranks[-1] * modes[i - 1], math.prod(modes[i:]))
        ranks.append(tt_rank if tt_rank <= cap else int(cap * tt_rank_ratio))
    return (*ranks, 1)


def tensor_train_shape(d_in: int, d_out: int, tt_rank: int, tt_cores: int, tt_rank_ratio: float = 1.0,
                       leading_mode_multiple: int = 1) -> TensorTrainShape:
    """The cores of a projection ``d_in -> d_out`` with ``tt_cores`` cores (even): ``tt_cores / 2`` input modes of
    ``d_in`` (descending) and as many output modes of ``d_out`` (ascending), see :func:`tensor_train_modes`, with
    the ranks of :func:`tensor_train_ranks`."""
    half = tt_cores // 2
    inputs = tensor_train_modes(d_in, half, descending=True, leading_multiple=leading_mode_multiple)
    outputs = tensor_train_modes(d_out, half, descending=False, leading_multiple=leading_mode_multiple)
    return TensorTrainShape(inputs, outputs, tensor_train_ranks(inputs + outputs, tt_rank, tt_rank_ratio))


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


class DerivedRankError(ValueError):
    """``bottleneck="tt"`` with a ``rank`` other than the one its tensor trains give (``derived``)."""

    def __init__(self, rank: int, derived: int, tt_rank: int, tt_cores: int, tt_rank_ratio: float):
        self.rank, self.derived, self.tt_rank = rank, derived, tt_rank
        self.derivation = f"{derived} from tt_rank={tt_rank}, tt_cores={tt_cores}, tt_rank_ratio={tt_rank_ratio}"
        super().__init__(
            f"rank ({rank}) is derived for bottleneck='tt' (the middle rank of the tensor trains, {self.derivation}): "
            f"leave rank unset or set it to {derived}, or choose the tt_rank that gives {rank}."
        )


class BoostLlamaConfig(PretrainedConfig):
    r"""Configuration of :class:`~boost_hf.BoostLlamaForCausalLM`.

    The LLaMA fields have the names and defaults of ``transformers.LlamaConfig``. Extra fields:

    Args:
        bottleneck: ``None`` (full-rank LLaMA), ``"svd"``, ``"cola"``, ``"lax"`` or ``"tt"``.
        rank: bottleneck rank ``r`` of every projection; default ``hidden_size // 4``. For ``"tt"`` it is the middle
            rank of the tensor trains, derived from the ``tt_*`` fields (leave it unset, or give that value).
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
        tt_rank: tensor train (``bottleneck="tt"``): the bond rank of every core, where a core's unfolding can
            realise it (see :func:`tensor_train_ranks`); default ``hidden_size // 4``.
        tt_cores: tensor train: cores per projection (even: half for the input modes, half for the output modes).
            Default 4, as the BOOST release.
        tt_rank_ratio: tensor train: a bond rank that ``tt_rank`` exceeds becomes ``int(cap * tt_rank_ratio)`` of
            the largest rank its unfolding realises (the release's ``per_decomp_rank_ratio_limit``). Default 1.0.
        tt_leading_mode_multiple: tensor train: the first input mode and the first output mode of every projection
            are multiples of this (the modes tensor parallelism splits under ``tp_style="btp"``: ``tp_size`` must
            divide them). Default 1: the release's modes and order. Otherwise a balanced mode that is a multiple
            leads (:func:`tensor_train_modes`): the same factors in another order, another model than the release's.
        initializer_range: std of the dense weights (embedding, LM head, full-rank projections); tensor-train cores
            take it as the release does: core ``[r_in, m, r_out]`` ``N(0, s^2)``,
            ``s = (r_in r_out)^(-1/4) initializer_range^(1 / tt_cores)``.
        factor_init: how the bottleneck factors are initialised, ``"cola"`` (default) or ``"xavier"`` (each factor
            Xavier-normal, as the LORO authors initialise theirs); see :data:`FACTOR_INITS`. Initialisation only: it
            does not change what given weights compute.
    """

    model_type = "boost_llama"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the KV cache, by its name before and after transformers 5.24

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
        tt_rank: int | None = None,
        tt_cores: int = 4,
        tt_rank_ratio: float = 1.0,
        tt_leading_mode_multiple: int = 1,
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
        # a tensor train's rank is its middle rank, derived in validate()
        self.rank = rank if rank is not None or bottleneck == "tt" else hidden_size // 4
        self.only_lr_act = only_lr_act
        self.lr_act = lr_act
        self.lax_gate = lax_gate
        self.lax_latent_norm = lax_latent_norm
        self.lax_base = lax_base
        self.lax_kronecker_factor = lax_kronecker_factor
        self.lax_version = lax_version
        self.factor_init = factor_init
        self.tt_rank = tt_rank if tt_rank is not None else hidden_size // 4
        self.tt_cores = tt_cores
        self.tt_rank_ratio = tt_rank_ratio
        self.tt_leading_mode_multiple = tt_leading_mode_multiple
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
        "lax_base", "lax_kronecker_factor", "lax_version", "tt_rank", "tt_cores", "tt_rank_ratio", "tt_leading_mode_multiple",
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
        if record["bottleneck"] != "tt":
            for name in TENSOR_TRAIN_FIELDS:
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

    def tensor_train_shape(self, name: str) -> TensorTrainShape:
        """The tensor-train cores of projection ``name`` (``q_proj`` ... ``down_proj``) of a ``"tt"`` model."""
        d_in, d_out = self.projection_shapes()[name]
        return tensor_train_shape(d_in, d_out, self.tt_rank, self.tt_cores, self.tt_rank_ratio, self.tt_leading_mode_multiple)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the field to change if the configuration is wrong or inconsistent."""
        check_config_fields(self)
        if self.bottleneck not in BOTTLENECKS:
            raise ValueError(
                f"Unknown bottleneck {self.bottleneck!r}: use one of None (full rank), 'svd', 'cola', 'lax', 'tt'."
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
        if self.bottleneck == "tt":
            self._validate_tensor_train()
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

    def _validate_tensor_train(self) -> None:
        """The ``tt_*`` fields; sets ``rank`` to the middle rank shared by the 7 projections' tensor trains."""
        check_int("tt_rank", self.tt_rank)
        check_int("tt_cores", self.tt_cores, minimum=2)
        if self.tt_cores % 2 != 0:
            raise ValueError(
                f"tt_cores must be even (half the cores take the input modes, half the output modes), got {self.tt_cores}: "
                "the BOOST release's TensorTrainLinear cannot build an odd count either."
            )
        check_real("tt_rank_ratio", self.tt_rank_ratio, positive=True)
        check_int("tt_leading_mode_multiple", self.tt_leading_mode_multiple)
        if self.factor_init != "cola":
            raise ValueError(
                f"factor_init={self.factor_init!r} initialises factors A and B, which a tensor train (bottleneck='tt') "
                "does not hold: its cores start as the BOOST release draws them. Leave factor_init at its default."
            )
        shapes = {name: self.tensor_train_shape(name) for name in self.projection_shapes()}
        multiple = self.tt_leading_mode_multiple
        for name, shape in shapes.items():
            if min(shape.ranks) < 1:
                raise ValueError(
                    f"tt_rank_ratio ({self.tt_rank_ratio}) makes a bond rank of {name} zero (ranks {list(shape.ranks)} for "
                    f"modes {list(shape.modes)}): raise tt_rank_ratio or lower tt_rank."
                )
            for kind, modes in (("input", shape.input_modes), ("output", shape.output_modes)):
                if modes[0] % multiple != 0:
                    raise ValueError(
                        f"tt_leading_mode_multiple={multiple}: no {kind} mode of {name} is a multiple of it ({kind} modes "
                        f"{list(modes)}, the balanced factors of {math.prod(modes)} over {len(modes)} cores): choose a "
                        "multiple that one of them has, another tt_cores, or tt_leading_mode_multiple=1."
                    )
        middle = {name: shape.middle_rank for name, shape in shapes.items()}
        if len(set(middle.values())) > 1:
            raise ValueError(
                f"tt_rank ({self.tt_rank}) gives the projections different middle ranks ({middle}: a tensor train's middle "
                "rank is at most its input and output widths): every projection needs the same bottleneck rank; lower "
                f"tt_rank to at most {min(middle.values())}."
            )
        derived = next(iter(middle.values()))
        if self.rank is None:
            self.rank = derived
        elif self.rank != derived:
            raise DerivedRankError(self.rank, derived, self.tt_rank, self.tt_cores, self.tt_rank_ratio)

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
        lax, tt and size in 60m, 130m, 350m, 1b, 7b (CoLA's table) or 3b, 13b, 30b (BOOST's table).

        Vocabulary 32000, untied LM head, r = d/4 (CoLA), no GQA. ``tt``: ``tt_rank`` = that r, 6 cores; ``tt-60m``
        and ``tt-1b`` are the BOOST release's configs (see :data:`RELEASE_TT_PRESETS`), the other sizes boost-hf's
        (leading modes multiples of 4). ``overrides`` replace any field.
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
        if arch == "tt" or (overrides.get("bottleneck") == "tt" and "rank" not in overrides):
            del fields["rank"]  # derived from the tensor trains (a low-rank preset's r is no tensor train's)
            fields.update(tt_rank=rank, tt_cores=TT_PRESET_CORES)
            fields.update(RELEASE_TT_PRESETS.get(size, dict(tt_leading_mode_multiple=TT_PRESET_LEADING_MODE_MULTIPLE)))
        fields.update(overrides)
        return cls(**fields)


# Every saved config ships this file and names it in ``auto_map`` (remote code: ``trust_remote_code=True``).
BoostLlamaConfig.register_for_auto_class()

__all__ = [
    "BoostLlamaConfig", "DerivedRankError", "BOTTLENECKS", "FACTOR_INITS", "LAX_GATES", "LAX_BASES", "LAX_VERSION", "PRESET_SIZES",
    "RELEASE_TT_PRESETS", "AUTHORS_COLA_MODEL_TYPE", "from_authors_cola", "TensorTrainShape", "tensor_train_modes",
    "tensor_train_ranks", "tensor_train_shape",
]
