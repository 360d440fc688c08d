"""A local ``evaluate`` metric: perplexity and bits per byte from summed token negative log-likelihoods.

Load it offline with ``evaluate.load("<path to this folder>")`` (boost-hf: ``boost_hf.evaluation.load_metric()``).

Inputs, one entry per evaluated chunk (a batch, a document or one process's share of a distributed run):

* ``nll_sum``: summed next-token negative log-likelihood in nats;
* ``token_count``: number of predicted tokens behind that sum;
* ``byte_count``: UTF-8 bytes of the text those tokens encode.

Outputs, over all entries (sums are added first, in float64, so splitting the data changes nothing but rounding):
``loss = sum(nll) / sum(tokens)``, ``perplexity = exp(loss)``, ``bits_per_byte = sum(nll) / (ln 2 * sum(bytes))``
(``None`` when no byte counts are given).
"""

import math

import datasets
import evaluate

_DESCRIPTION = __doc__
_KWARGS_DESCRIPTION = """
Args:
    nll_sum (list of float): summed negative log-likelihoods (nats).
    token_count (list of int): predicted tokens behind each sum.
    byte_count (list of int): UTF-8 bytes of the text of those tokens.
Returns:
    loss (float): mean negative log-likelihood per token (nats).
    perplexity (float): exp(loss).
    bits_per_byte (float): sum of NLL in bits over the total bytes.
    tokens (int), bytes (int): the totals.
Examples:
    >>> metric = evaluate.load("boost_hf/evaluation/bits_per_byte")
    >>> metric.compute(nll_sum=[6.931471805599453], token_count=[10], byte_count=[10])["bits_per_byte"]
    1.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class BitsPerByte(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"nll_sum": datasets.Value("float64"), "token_count": datasets.Value("int64"), "byte_count": datasets.Value("int64")}
            ),
        )

    def _compute(self, nll_sum, token_count, byte_count):
        nll, tokens, size = math.fsum(nll_sum), sum(token_count), sum(byte_count)
        if tokens <= 0:
            raise ValueError("token_count sums to 0: there is nothing to evaluate.")
        loss = nll / tokens
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 700.0)),
            "bits_per_byte": nll / (math.log(2) * size) if size > 0 else None,
            "tokens": tokens,
            "bytes": size,
        }
