"""Preference losses, registered by name. Each is a pure function of per-pair tensors and declares,
beside its formula, the hyperparameters it reads and whether it keeps running state.

Notation, per pair: ``π_c``, ``π_r`` summed completion log-probs of the chosen and rejected
completion under the policy; ``ref_c``, ``ref_r`` the same under the reference (0 when
reference-free); ``|y_c|``, ``|y_r|`` completion lengths in tokens;
``Δ = (π_c − ref_c) − (π_r − ref_r)``; implicit rewards ``r_c = β(π_c − ref_c)``,
``r_r = β(π_r − ref_r)``; ``ε`` label smoothing; ``σ`` the logistic function.

A loss with a new hyperparameter adds a field to :class:`PreferenceHyperparameters` and names it
in its ``register_loss``: the DPO config section, the trainer's arguments and the ``params`` its
function receives all take it from there.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field

from trainers.lazy import LazyModule
from trainers.registry import RegisteredName, Registry

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:  # the registry is read at config validation, which imports no torch
    torch = LazyModule("torch")
    F = LazyModule("torch.nn.functional")


@dataclass(frozen=True)
class PairLogps:
    """Per-pair inputs of a preference loss; every tensor has shape ``(pairs,)``."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_lengths: torch.Tensor
    rejected_lengths: torch.Tensor
    # Σ_t log π(y_t) of the chosen completion when ``chosen`` was reweighted (LD-DPO's ld_alpha scales
    # the tokens beyond the shorter completion inside the implicit reward only); None: ``chosen`` is it.
    chosen_unweighted: torch.Tensor | None = None

    @property
    def chosen_likelihood(self) -> torch.Tensor:
        """``log π(y_c)``, the chosen completion's log-likelihood, for NLL terms (sft, cpo, orpo)."""
        return self.chosen if self.chosen_unweighted is None else self.chosen_unweighted

    @property
    def chosen_logratios(self) -> torch.Tensor:
        return self.chosen - self.ref_chosen

    @property
    def rejected_logratios(self) -> torch.Tensor:
        return self.rejected - self.ref_rejected

    @property
    def margin(self) -> torch.Tensor:
        """``Δ``: the difference of the two log-ratios."""
        return self.chosen_logratios - self.rejected_logratios

    @property
    def length_normalised_margin(self) -> torch.Tensor:
        """``(π_c − ref_c)/|y_c| − (π_r − ref_r)/|y_r|``."""
        chosen = self.chosen_logratios / self.chosen_lengths.clamp(min=1)
        return chosen - self.rejected_logratios / self.rejected_lengths.clamp(min=1)


def reward_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> dict[str, torch.Tensor]:
    """Implicit rewards β·(π − ref): their means, the margin and how often chosen wins."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }


def smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    """``−(1 − ε) log σ(z) − ε log σ(−z)``."""
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def capped_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with ``x`` capped below the log of the dtype's largest value, so it stays finite."""
    return torch.exp(x.clamp(max=math.log(torch.finfo(x.dtype).max) - 1))


FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
# f-DPO's margin before β for each f, from the log-ratios ℓ_c, ℓ_r and α (see ``f_divergence_loss``).
F_DIVERGENCE_MARGINS: dict[FDivergence, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "reverse_kl": lambda chosen, rejected, alpha: chosen - rejected,
    "forward_kl": lambda chosen, rejected, alpha: capped_exp(-rejected) - capped_exp(-chosen),
    "js_divergence": lambda chosen, rejected, alpha: (chosen - F.softplus(chosen)) - (rejected - F.softplus(rejected)),
    "alpha_divergence": lambda chosen, rejected, alpha: (
        (capped_exp(-alpha * rejected) - capped_exp(-alpha * chosen)) / alpha
    ),
}


class PreferenceHyperparameters(BaseModel):
    """The hyperparameters of the registered losses: the one schema of these fields (the DPO
    config section inherits them, the trainer's arguments are built from that section)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    beta: float = Field(
        0.1, gt=0, description="β: scale of the log-ratios, e.g. −log σ(β·[(π_c − ref_c) − (π_r − ref_r)]) for sigmoid."
    )
    label_smoothing: float = Field(
        0.0,
        ge=0.0,
        lt=0.5,
        description="ε: assumed label-flip rate, used by sigmoid (cDPO), robust, exo_pair, aot, aot_pair, "
        "f_divergence, simpo and cpo.",
    )
    discopop_tau: float = Field(0.05, gt=0, description="τ of the discopop loss.")
    f_divergence_type: FDivergence = Field(
        "reverse_kl",
        description="f of the f_divergence loss (f-DPO): reverse_kl (= sigmoid), forward_kl, js_divergence or "
        "alpha_divergence.",
    )
    f_alpha: float = Field(
        0.5,
        gt=0,
        description="α of f_divergence_type: alpha_divergence, f'(u) = (1 − u^−α)/α as in the f-DPO paper (1 is "
        "forward KL). TRL computes (u^(α−1) − 1)/(α − 1): TRL's α is 1 − this α.",
    )
    simpo_gamma: float = Field(0.5, ge=0, description="γ, the target reward margin of simpo.")
    cpo_alpha: float = Field(1.0, ge=0, description="α, the weight of the chosen NLL term of cpo.")
    orpo_lambda: float = Field(0.1, gt=0, description="λ, the weight of the odds-ratio term of orpo.")


# β also scales the logged implicit rewards, so it matters even to a loss that does not read it.
ALWAYS_USED = frozenset({"beta"})


class LossParams(PreferenceHyperparameters):
    """What a loss function receives: the hyperparameters, and the running state the trainer keeps."""

    reward_shift: float = 0.0  # δ of a stateful loss (bco_pair): the running mean of the implicit rewards


LossFunction = Callable[[PairLogps, LossParams], "torch.Tensor"]


@dataclass(frozen=True)
class PreferenceLoss:
    """A registered loss: its per-pair function and what it needs from the trainer."""

    name: str
    function: LossFunction
    hyperparameters: frozenset[str]  # fields of PreferenceHyperparameters the function reads
    stateful: bool = False  # reads ``params.reward_shift``, updated by the trainer on training steps
    needs_reference: bool = True  # reads ``ref_chosen``/``ref_rejected``; False: reference-free objective
    per_pair: bool = True  # term i is pair i's; False: batch-level (AOT: term i is the i-th quantile)

    def __call__(self, pairs: PairLogps, params: LossParams) -> torch.Tensor:
        return self.function(pairs, params)


PREFERENCE_LOSSES: Registry[PreferenceLoss] = Registry("preference loss", "loss_type")
get_loss = PREFERENCE_LOSSES.lookup
LossName = Annotated[str, RegisteredName(PREFERENCE_LOSSES)]


def register_loss(
    name: str,
    *,
    hyperparameters: Sequence[str],
    stateful: bool = False,
    needs_reference: bool = True,
    per_pair: bool = True,
) -> Callable[[LossFunction], LossFunction]:
    unknown = set(hyperparameters) - set(PreferenceHyperparameters.model_fields)
    if unknown:
        raise ValueError(f"loss {name!r} reads {sorted(unknown)}, which are not fields of PreferenceHyperparameters")

    def decorator(function: LossFunction) -> LossFunction:
        loss = PreferenceLoss(name, function, frozenset(hyperparameters), stateful, needs_reference, per_pair)
        PREFERENCE_LOSSES.add(name, loss)
        return function

    return decorator


@register_loss("sigmoid", hyperparameters=("beta", "label_smoothing"))
def sigmoid_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """DPO (Rafailov et al., 2023, arXiv:2305.18290), with conservative label smoothing ε
    (cDPO, Mitchell 2023):

        L = −(1 − ε) log σ(βΔ) − ε log σ(−βΔ)
    """
    return smoothed_sigmoid(params.beta * pairs.margin, params.label_smoothing)


@register_loss("robust", hyperparameters=("beta", "label_smoothing"))
def robust_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """Robust DPO (Chowdhury et al., 2024, arXiv:2403.00409), unbiased under label-flip rate ε < ½:

    L = [ −(1 − ε) log σ(βΔ) + ε log σ(−βΔ) ] / (1 − 2ε)
    """
    z = params.beta * pairs.margin
    eps = params.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


@register_loss("hinge", hyperparameters=("beta",))
def hinge_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """SLiC calibration hinge (Zhao et al., 2023, arXiv:2305.10425) on the DPO log-ratios:

    L = max(0, 1 − βΔ)
    """
    return F.relu(1 - params.beta * pairs.margin)


@register_loss("ipo", hyperparameters=("beta",))
def ipo_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """IPO (Azar et al., 2023, arXiv:2310.12036), log-probs averaged over completion length:

    Δ̄ = (π_c − ref_c)/|y_c| − (π_r − ref_r)/|y_r|,    L = (Δ̄ − 1/(2β))²
    """
    return (pairs.length_normalised_margin - 1 / (2 * params.beta)) ** 2


@register_loss("exo_pair", hyperparameters=("beta", "label_smoothing"))
def exo_pair_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """EXO, pairwise (Ji et al., 2024, arXiv:2402.00856): reverse KL from the model's preference
    distribution ``(σ(βΔ), σ(−βΔ))`` to the smoothed labels ``(1 − ε, ε)``; ε = 10⁻³ when 0:

        L = σ(βΔ) [log σ(βΔ) − log(1 − ε)] + σ(−βΔ) [log σ(−βΔ) − log ε]
    """
    z = params.beta * pairs.margin
    eps = params.label_smoothing or 1e-3
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log(1 - eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(eps)
    )


@register_loss("nca_pair", hyperparameters=("beta",))
def nca_pair_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """NCA, pairwise (Chen et al., 2024, arXiv:2402.05369):

    L = −log σ(r_c) − ½ log σ(−r_c) − ½ log σ(−r_r)
    """
    chosen = params.beta * pairs.chosen_logratios
    rejected = params.beta * pairs.rejected_logratios
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


@register_loss("bco_pair", hyperparameters=("beta",), stateful=True)
def bco_pair_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """BCO on pairs (Jung et al., 2024, arXiv:2404.04656): chosen vs. rejected as a binary
    classifier of the implicit reward, shifted by δ, the running mean of all implicit rewards:

        L = −log σ(r_c − δ) − log σ(−(r_r − δ))
    """
    chosen = params.beta * pairs.chosen_logratios
    rejected = params.beta * pairs.rejected_logratios
    delta = params.reward_shift
    return -F.logsigmoid(chosen - delta) - F.logsigmoid(-(rejected - delta))


@register_loss("sppo_hard", hyperparameters=("beta",))
def sppo_hard_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """SPPO with hard labels (Wu et al., 2024, arXiv:2405.00675): winner probability 1, loser 0:

    L = (π_c − ref_c − 1/(2β))² + (π_r − ref_r + 1/(2β))²
    """
    target = 1 / (2 * params.beta)
    return (pairs.chosen_logratios - target) ** 2 + (pairs.rejected_logratios + target) ** 2


@register_loss("apo_zero", hyperparameters=("beta",))
def apo_zero_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al., 2024, arXiv:2408.06266): raise the chosen, lower the
    rejected likelihood (for chosen completions better than the model's own):

        L = 1 − σ(r_c) + σ(r_r)
    """
    return (
        1 - torch.sigmoid(params.beta * pairs.chosen_logratios) + torch.sigmoid(params.beta * pairs.rejected_logratios)
    )


@register_loss("apo_down", hyperparameters=("beta",))
def apo_down_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al., 2024, arXiv:2408.06266): lower both likelihoods, the
    rejected more (for chosen completions worse than the model's own):

        L = σ(r_c) + 1 − σ(βΔ)
    """
    return torch.sigmoid(params.beta * pairs.chosen_logratios) + 1 - torch.sigmoid(params.beta * pairs.margin)


@register_loss("sigmoid_norm", hyperparameters=("beta",))
def sigmoid_norm_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """Length-normalised DPO (Tülu 3, Lambert et al., 2024, arXiv:2411.15124):

    L = −log σ(β · [(π_c − ref_c)/|y_c| − (π_r − ref_r)/|y_r|])
    """
    return -F.logsigmoid(params.beta * pairs.length_normalised_margin)


@register_loss("discopop", hyperparameters=("beta", "discopop_tau"))
def discopop_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """DiscoPOP / log-ratio modulated loss (Lu et al., 2024, arXiv:2406.08414), temperature τ:

        z = βΔ,  m = σ(z/τ),  L = −log σ(z) · (1 − m) + exp(−z) · m

    ``exp(−z)·m`` is evaluated as ``exp(−z + log σ(z/τ))``: equal, and finite for very negative z.
    """
    z = params.beta * pairs.margin
    modulation = torch.sigmoid(z / params.discopop_tau)
    return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z + F.logsigmoid(z / params.discopop_tau))


@register_loss("sft", hyperparameters=(), needs_reference=False)
def sft_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """Negative log-likelihood of the chosen completion, per token (RPO's NLL term, Pang et
    al., 2024, arXiv:2404.19733); the reference plays no part, and neither does LD-DPO's ld_alpha
    (``π_c`` here is the true ``Σ_t log π(y_t)``):

        L = −π_c / |y_c|
    """
    return -pairs.chosen_likelihood / pairs.chosen_lengths.clamp(min=1)


@register_loss("aot_pair", hyperparameters=("beta", "label_smoothing"), per_pair=False)
def aot_pair_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """AOT on the reward distributions (Melnyk et al., 2024, arXiv:2406.05882): optimal transport in
    one dimension makes the distribution of chosen rewards dominate that of rejected rewards in the
    first order, quantile by quantile; it never uses which chosen goes with which rejected (the
    paper's unpaired setting; TRL's name before v0.28, now ``aot_unpaired``). The sigmoid loss on
    *sorted* log-ratios: with ``↑`` sorting over the pairs of the batch, ``u = sort↑(π_c − ref_c)``,
    ``v = sort↑(π_r − ref_r)``, pair ``i``:

        d_i = u_i − v_i,    L_i = −(1 − ε) log σ(βd_i) − ε log σ(−βd_i)

    A batch-level loss: ``L_i`` depends on every pair of the batch it sorts, which is the
    per-process micro-batch. Gradient accumulation and several processes therefore sort smaller
    batches than one large batch would (like ``bco_pair``'s δ, per micro-batch); with one pair per
    micro-batch it is the sigmoid loss.
    """
    chosen = torch.sort(pairs.chosen_logratios, dim=0).values
    rejected = torch.sort(pairs.rejected_logratios, dim=0).values
    return smoothed_sigmoid(params.beta * (chosen - rejected), params.label_smoothing)


@register_loss("aot", hyperparameters=("beta", "label_smoothing"), per_pair=False)
def aot_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """AOT on paired data (Melnyk et al., 2024, arXiv:2406.05882): the distribution of the policy's
    per-pair log-likelihood ratios ``π_c − π_r`` should dominate the reference's ``ref_c − ref_r``
    in the first order, quantile by quantile; sorted over the pairs of the batch,
    ``u = sort↑(π_c − π_r)``, ``v = sort↑(ref_c − ref_r)``, pair ``i``:

        d_i = u_i − v_i,    L_i = −(1 − ε) log σ(βd_i) − ε log σ(−βd_i)

    Batch-level, sorted per micro-batch and process: see ``aot_pair``.
    """
    policy = torch.sort(pairs.chosen - pairs.rejected, dim=0).values
    reference = torch.sort(pairs.ref_chosen - pairs.ref_rejected, dim=0).values
    return smoothed_sigmoid(params.beta * (policy - reference), params.label_smoothing)


@register_loss("f_divergence", hyperparameters=("beta", "label_smoothing", "f_divergence_type", "f_alpha"))
def f_divergence_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """f-DPO (Wang et al., 2023, arXiv:2309.16240): DPO under a KL-regulariser generalised to an
    f-divergence; the implicit reward is ``β f'(u)`` of the ratio ``u = π/ref``, with
    ``ℓ = log u`` (``ℓ_c = π_c − ref_c``, ``ℓ_r = π_r − ref_r``):

        reverse_kl        f'(u) = log u + 1            z = β(ℓ_c − ℓ_r) = βΔ           (DPO)
        forward_kl        f'(u) = 1 − 1/u              z = β(e^{−ℓ_r} − e^{−ℓ_c})
        js_divergence     f'(u) = log(2u/(1 + u))      z = β[(ℓ_c − log(1 + e^{ℓ_c})) − (ℓ_r − log(1 + e^{ℓ_r}))]
        alpha_divergence  f'(u) = (1 − u^{−α})/α       z = β(e^{−αℓ_r} − e^{−αℓ_c})/α

        L = −(1 − ε) log σ(z) − ε log σ(−z)

    ``α = f_alpha``; ``alpha_divergence`` with α = 1 is ``forward_kl``. The exponentials are capped
    below the dtype's overflow.
    """
    margin = F_DIVERGENCE_MARGINS[params.f_divergence_type]
    z = margin(pairs.chosen_logratios, pairs.rejected_logratios, params.f_alpha)
    return smoothed_sigmoid(params.beta * z, params.label_smoothing)


@register_loss("simpo", hyperparameters=("beta", "label_smoothing", "simpo_gamma"), needs_reference=False)
def simpo_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """SimPO (Meng et al., 2024, arXiv:2405.14734): reference-free, the length-normalised policy
    log-probs as the reward, with a target margin γ (and label smoothing ε):

        z = β(π_c/|y_c| − π_r/|y_r|) − γ,    L = −(1 − ε) log σ(z) − ε log σ(−z)
    """
    chosen = pairs.chosen / pairs.chosen_lengths.clamp(min=1)
    rejected = pairs.rejected / pairs.rejected_lengths.clamp(min=1)
    return smoothed_sigmoid(params.beta * (chosen - rejected) - params.simpo_gamma, params.label_smoothing)


@register_loss("cpo", hyperparameters=("beta", "label_smoothing", "cpo_alpha"), needs_reference=False)
def cpo_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """CPO (Xu et al., 2024, arXiv:2401.08417): reference-free DPO (a uniform reference) plus
    α times the per-token NLL of the chosen completion:

        z = β(π_c − π_r),    L = −(1 − ε) log σ(z) − ε log σ(−z) − α π_c/|y_c|
    """
    nll = -pairs.chosen_likelihood / pairs.chosen_lengths.clamp(min=1)
    return (
        smoothed_sigmoid(params.beta * (pairs.chosen - pairs.rejected), params.label_smoothing) + params.cpo_alpha * nll
    )


@register_loss("orpo", hyperparameters=("orpo_lambda",), needs_reference=False)
def orpo_loss(pairs: PairLogps, params: LossParams) -> torch.Tensor:
    """ORPO (Hong et al., 2024, arXiv:2403.07691): the chosen per-token NLL plus λ times the
    log-odds-ratio term, on the average per-token log-probs ``a_c = π_c/|y_c|``, ``a_r = π_r/|y_r|``
    (``odds(y) = P/(1 − P)`` with ``P = e^{a}``); reference-free:

        log odds(y) = a − log(1 − e^{a}),
        L = −a_c − λ log σ(log odds(y_c) − log odds(y_r))

    ``log(1 − e^{a})`` is evaluated as ``log(−expm1(a))``; it is finite for ``a < 0`` (any completion
    whose probability is below 1). The NLL term ``−a_c`` reads the true log-likelihood: LD-DPO's
    ld_alpha reweights the odds-ratio term only.
    """
    chosen = pairs.chosen / pairs.chosen_lengths.clamp(min=1)
    rejected = pairs.rejected / pairs.rejected_lengths.clamp(min=1)
    log_odds = (chosen - torch.log(-torch.expm1(chosen))) - (rejected - torch.log(-torch.expm1(rejected)))
    nll = -pairs.chosen_likelihood / pairs.chosen_lengths.clamp(min=1)
    return nll - params.orpo_lambda * F.logsigmoid(log_odds)


@dataclass(frozen=True)
class LossMix:
    """A weighted sum of registered losses: ``L = Σ_k w_k L_k``."""

    losses: tuple[PreferenceLoss, ...]
    weights: tuple[float, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(loss.name for loss in self.losses)

    @property
    def stateful(self) -> bool:
        return any(loss.stateful for loss in self.losses)

    @property
    def hyperparameters(self) -> frozenset[str]:
        return frozenset().union(*(loss.hyperparameters for loss in self.losses))

    @property
    def needs_reference(self) -> bool:
        """False when every loss is reference-free: then nothing reads reference log-probs."""
        return any(loss.needs_reference for loss in self.losses)

    @property
    def batch_level(self) -> tuple[str, ...]:
        """The losses whose term ``i`` is not pair ``i``'s (per-pair weights cannot apply to them)."""
        return tuple(loss.name for loss in self.losses if not loss.per_pair)

    def __call__(self, pairs: PairLogps, params: LossParams) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-pair total loss, and each component's per-pair loss (unweighted) by name."""
        components = {loss.name: loss(pairs, params) for loss in self.losses}
        total = functools.reduce(
            operator.add, (weight * loss for weight, loss in zip(self.weights, components.values()))
        )
        return total, components


def resolve_losses(
    loss_type: str | Sequence[str], loss_weights: Sequence[float] | None, hyperparameters: PreferenceHyperparameters
) -> LossMix:
    """Validate a loss configuration; raises ``ValueError`` naming the offending option.

    A hyperparameter set away from its default that none of the chosen losses reads is an error:
    it would silently do nothing."""
    names = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not names:
        raise ValueError("loss_type: give one loss name or a non-empty list")
    losses = tuple(get_loss(name) for name in names)
    if len(set(names)) != len(names):
        raise ValueError(f"loss_type: {list(names)} repeats a loss; give each once and weight it with loss_weights")
    weights = (1.0,) * len(names) if loss_weights is None else tuple(float(w) for w in loss_weights)
    if len(weights) != len(names):
        raise ValueError(f"loss_weights: {len(weights)} weights for {len(names)} losses {list(names)}")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) == 0:
        raise ValueError(f"loss_weights: {list(weights)} must be finite, non-negative and not all zero")
    mix = LossMix(losses, weights)
    defaults = PreferenceHyperparameters()
    for field in sorted(PreferenceHyperparameters.model_fields.keys() - mix.hyperparameters - ALWAYS_USED):
        value = getattr(hyperparameters, field)
        if value != getattr(defaults, field):
            readers = sorted(loss.name for loss in PREFERENCE_LOSSES.values() if field in loss.hyperparameters)
            raise ValueError(f"{field}: {value} has no effect on {list(names)}; it is read by {readers}")
    if hyperparameters.f_alpha != defaults.f_alpha and hyperparameters.f_divergence_type != "alpha_divergence":
        raise ValueError(
            f"f_alpha: {hyperparameters.f_alpha} has no effect with f_divergence_type: "
            f"{hyperparameters.f_divergence_type}; it is read with alpha_divergence"
        )
    return mix
