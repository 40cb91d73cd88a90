"""Scalar options of the GRPO-family / PPO policy loss, as one frozen dataclass.

Every field mirrors an argument of TRL 1.16's ``GRPOConfig`` that ``GRPOTrainer._compute_loss`` reads and that
changes the loss value or its gradient; names and defaults are TRL's, except ``epsilon_low`` (TRL: ``epsilon``),
``kl_estimator`` (a fastrl extension, TRL hard-codes k3; ``"exact"`` is the whole-vocabulary KL) and ``max_completion_length`` (TRL defaults it to 512
as a generation length; here it is only the dr_grpo normaliser and must be given for dr_grpo).
The arithmetic that uses them is ``fastrl.losses.arithmetic.policy_loss_from_logprobs`` (re-exported by
``fastrl.reference``, the spec the tests compare against).
"""

from __future__ import annotations

import dataclasses

from fastrl._options import is_finite_number, number, suggest_keywords

__all__ = ["LOSS_TYPES", "KL_ESTIMATORS", "IMPORTANCE_SAMPLING_LEVELS", "PolicyLossConfig"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# k1/k2/k3 estimate KL(pi || pi_ref) from the sampled token's log-probs; "exact" is the KL itself, summed over the
# whole vocabulary at every position from both models' hidden states (fastrl.fused_divergence, beta=1)
KL_ESTIMATORS = ("k1", "k2", "k3", "exact")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# Loss types whose per-token term is TRL's -min(coef_1 * A, clip(coef_1) * A), the only place TRL reads `delta`.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


_OWNER = "PolicyLossConfig"


def _bad(field: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{_OWNER}.{field} must be {expected}, got {value!r}")


@suggest_keywords(aliases={"epsilon": "epsilon_low"})  # TRL's GRPOConfig calls epsilon_low `epsilon`
@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Options of the per-token policy loss of TRL 1.16's ``GRPOTrainer._compute_loss``.

    Fields (TRL name in brackets where it differs), each checked against the range where it means something
    (``ValueError`` naming the field, the range and the value; a misspelt keyword gets ``TypeError`` with the
    closest names):

    - ``loss_type``: one of ``LOSS_TYPES``; TRL's default ``"dapo"``.
    - ``epsilon_low`` [``epsilon``] = 0.2 and ``epsilon_high`` = None -> ``epsilon_low`` (TRL's rule). For
      ``cispo`` ``epsilon_high`` is the cap on the ratio itself (TRL clamps ``coef_1`` at ``epsilon_high``, not at
      ``1 + epsilon_high``; TRL recommends 5.0 there, but its default is still ``epsilon``, i.e. 0.2).
      ``epsilon_low`` in [0, 1) (at 1 or more the lower bound ``1 - epsilon_low`` is at or below 0, under every
      ratio: it could never bind); ``epsilon_high`` > 0.
    - ``delta``: two-sided clipping (INTELLECT-2), caps ``coef_1`` at ``delta`` (> 1); None = off. TRL reads it only
      for the clipped loss types (grpo, bnpo, dr_grpo, dapo, luspo) and silently ignores it otherwise; here
      setting it with another loss type is a ``ValueError`` rather than a silent no-op.
    - ``beta`` = 0.0: KL coefficient; ``kl_estimator`` = "k3" (TRL only has k3; k1/k2 are placed the same way);
      ``use_bias_correction_kl`` = True multiplies the per-token KL by the (differentiable) ratio ``coef_1``.
      ``kl_estimator="exact"``: the per-token KL is ``KL(pi_theta(.|s_t) || pi_ref(.|s_t))`` summed over the whole
      vocabulary (``fastrl.fused_divergence(..., beta=1.0)`` from both models' last hidden states), with its exact
      gradient, placed and normalised where the k3 term is. It is *not* multiplied by ``coef_1`` whatever
      ``use_bias_correction_kl`` says: k1/k2/k3 are functions of the one sampled token, so an off-policy sample
      needs the ratio to estimate the KL of the current policy; the exact KL is already the expectation over the
      next token under the current policy, and a ratio would only re-weight the positions (TRL's k3 times the
      ratio has the exact KL as its expectation at each position). The loss then takes ``per_token_kl``
      (``policy_loss_from_logprobs``) or ``ref_hidden`` / ``ref_weight`` (``fastrl.policy_loss``), never
      ``ref_logprobs``.
    - ``entropy_coef`` = 0.0 (>= 0): entropy bonus ``loss - entropy_coef * masked_mean(entropy)``. TRL's adaptive
      variant (``use_adaptive_entropy``, ``entropy_target``, ``entropy_coef_min/max/delta``) is trainer state
      updated at optimizer-step boundaries from window-global, cross-process entropy, not a per-batch formula:
      only the fixed coefficient lives here, and an adaptive trainer passes the coefficient it applies this step
      (0.0 while TRL's gate is closed) through ``dataclasses.replace``.
    - ``importance_sampling_level`` = "token" (or "sequence", GSPO: ``exp(masked mean_t log ratio)``).
    - ``temperature`` = 1.0: divides the logits before the log-softmax; applied by the ops that produce the
      log-probs and entropies, not by the loss arithmetic (kept here so one config drives the whole path).
    - ``max_completion_length`` = None: dr_grpo's normaliser ``B * max_completion_length``; required for dr_grpo.
    - ``sapo_temperature_neg`` = 1.05, ``sapo_temperature_pos`` = 1.0: SAPO gate temperatures.
    - ``vespo_k_pos`` = 2.0, ``vespo_lambda_pos`` = 3.0, ``vespo_k_neg`` = 3.0, ``vespo_lambda_neg`` = 2.0.
    - ``top_entropy_quantile`` = 1.0: keep only tokens whose entropy is in the top quantile of the batch
      ("Beyond the 80/20 rule"); 1.0 = off.
    - ``off_policy_mask_threshold`` = None: DeepSeek-V3.2 off-policy sequence mask (drop a negative-advantage
      sequence whose mean ``sampling_logp - logp`` exceeds it); None = off, else > 0. ``beta`` >= 0,
      ``temperature`` and the SAPO temperatures > 0, the VESPO parameters >= 0, ``top_entropy_quantile`` in [0, 1].

    Left to the trainer (they do not act on the per-token tensors given to the loss, or they are state):
    ``vllm_importance_sampling_correction/_mode/_clip_min/_clip_max`` (they build the truncated/masked IS ratio
    from old and sampling log-probs during generation; the loss takes the finished ratio as
    ``importance_weights``), ``use_adaptive_entropy`` and its ``entropy_*`` knobs (see above),
    ``num_iterations`` / ``steps_per_generation`` / gradient accumulation and ``num_processes`` (they rescale the
    normalisers; this loss is TRL's with gradient accumulation 1 on one process), ``mask_truncated_completions``
    (edits the mask before the loss), ``router_aux_loss_coef`` (MoE aux loss from the model), ``scale_rewards``
    and ``multi_objective_aggregation`` (build the advantages).

    PPO: TRL's PPOv2 policy loss, ``masked_mean(max(-A * rho, -A * clip(rho, 1 - c, 1 + c)))`` with per-token
    advantages and no KL in the loss (PPOv2 puts the KL into the rewards), is exactly ``loss_type="bnpo"`` (sum
    over masked tokens / number of masked tokens), ``beta=0``, ``epsilon_low = epsilon_high = c``, token-level
    ratios, no delta, no entropy bonus: ``-min(rho A, clip(rho) A) = max(-rho A, -clip(rho) A)``. That is
    ``PolicyLossConfig.ppo(cliprange)``. (bnpo clamps the token count at 1 where PPOv2 would divide by 0.)
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = True
    entropy_coef: float = 0.0
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    max_completion_length: int | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            if isinstance(self.loss_type, str) and self.loss_type.lower() in ("ppo", "ppov2"):
                raise ValueError(
                    f"PolicyLossConfig.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}: PPO's clipped "
                    "policy loss is PolicyLossConfig.ppo(cliprange), i.e. loss_type='bnpo' with epsilon_low = "
                    "epsilon_high = cliprange and beta=0 (PPO puts the KL into the rewards)"
                )
            raise _bad("loss_type", f"one of {LOSS_TYPES}", self.loss_type)
        self._check_clip_range()
        number(_OWNER, "beta", self.beta, low=0, why="a KL coefficient below 0 would reward moving away from the "
               "reference policy")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise _bad("kl_estimator", f"one of {KL_ESTIMATORS}", self.kl_estimator)
        if not isinstance(self.use_bias_correction_kl, bool):
            raise _bad("use_bias_correction_kl", "a bool", self.use_bias_correction_kl)
        number(_OWNER, "entropy_coef", self.entropy_coef, low=0, why="the entropy bonus subtracts entropy_coef x "
               "the mean entropy from the loss; a negative one would push the policy towards collapse")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            levels = IMPORTANCE_SAMPLING_LEVELS
            raise _bad("importance_sampling_level", f"one of {levels}", self.importance_sampling_level)
        number(_OWNER, "temperature", self.temperature, low=0, low_open=True, why="the logits are divided by it")
        if self.max_completion_length is not None and (
            not isinstance(self.max_completion_length, int)
            or isinstance(self.max_completion_length, bool)
            or self.max_completion_length <= 0
        ):
            raise _bad("max_completion_length", "None or an int > 0", self.max_completion_length)
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise _bad("max_completion_length", "an int > 0 when loss_type='dr_grpo'", self.max_completion_length)
        for name in ("sapo_temperature_neg", "sapo_temperature_pos"):
            number(_OWNER, name, getattr(self, name), low=0, low_open=True, why="SAPO's gate divides by it")
        for name in ("vespo_k_pos", "vespo_k_neg"):
            number(_OWNER, name, getattr(self, name), low=0, why="VESPO's power of the ratio; below 0 it would "
                   "up-weight the samples it is meant to down-weight")
        for name in ("vespo_lambda_pos", "vespo_lambda_neg"):
            number(_OWNER, name, getattr(self, name), low=0, why="VESPO's exponential decay rate")
        number(_OWNER, "top_entropy_quantile", self.top_entropy_quantile, low=0, high=1,
               why="the share of tokens kept by entropy (1.0 keeps all)")
        number(_OWNER, "off_policy_mask_threshold", self.off_policy_mask_threshold, low=0, low_open=True,
               optional=True, why="a bound on a sequence's mean log-ratio between the sampler and the policy "
               "(DeepSeek-V3.2's delta; TRL expects a positive value, e.g. 0.5)")

    def _check_clip_range(self) -> None:
        """epsilon_low, epsilon_high (TRL's default: epsilon_low) and delta, each where it can bind."""
        number(_OWNER, "epsilon_low", self.epsilon_low, low=0, high=1, high_open=True,
               why=f"the ratio's lower clip bound 1 - {self.epsilon_low!r} must stay above 0, or no ratio (always > 0) "
               "can ever reach it" if is_finite_number(self.epsilon_low) and self.epsilon_low >= 1 else "")
        derived = self.epsilon_high is None
        if derived:
            # TRL: `epsilon_high if epsilon_high is not None else epsilon`.
            object.__setattr__(self, "epsilon_high", self.epsilon_low)
        why = "cispo caps the ratio at it" if self.loss_type == "cispo" else "the ratio's upper clip bound is 1 + it"
        number(_OWNER, "epsilon_high", self.epsilon_high, low=0, low_open=True,
               why=why + ("; left as None it takes epsilon_low's value: give it one of its own" if derived else ""))
        number(_OWNER, "delta", self.delta, low=1, low_open=True, optional=True,
               why="two-sided clipping caps the ratio at delta; at or below 1 it would cap even an unchanged "
               "policy's ratio (TRL recommends more than 1 + epsilon_high)")
        if self.delta is not None and self.loss_type not in CLIPPED_LOSS_TYPES:
            raise _bad("delta", f"None for loss_type={self.loss_type!r} (TRL ignores it there)", self.delta)

    @classmethod
    def ppo(cls, cliprange: float = 0.2) -> PolicyLossConfig:
        """TRL PPOv2's clipped policy loss (see the class docstring for why this is bnpo)."""
        return cls(
            loss_type="bnpo",
            epsilon_low=cliprange,
            epsilon_high=cliprange,
            beta=0.0,
            importance_sampling_level="token",
            entropy_coef=0.0,
        )

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss value or its gradient reads the per-token entropies."""
        return self.entropy_coef != 0.0 or self.top_entropy_quantile < 1.0

    @property
    def one_pass_granularity(self) -> str | None:
        """How far the gradient w.r.t. one token's logp / entropy reaches; decides the one-pass fused path.

        "token": it depends only on that token's inputs (logp, entropy, old/ref logp, advantage, IS weight)
        plus batch constants known before the forward (mask counts, num_items_in_batch, B,
        max_completion_length). "sequence": it also depends on the other tokens of the same sequence.
        None: it depends on other sequences' log-probs or entropies.
        """
        # top_entropy_quantile < 1: the entropy mask compares each token's entropy with a quantile of the
        # entropies of ALL masked tokens of the batch (gathered across processes in TRL), so whether a token
        # gets any policy gradient depends on every other sequence's entropies.
        if self.top_entropy_quantile < 1.0:
            return None
        # vespo: phi(w) uses w = exp(sum_t clamp(logp_t - old_t)) over the whole sequence (whatever
        # importance_sampling_level says; TRL computes it from the per-token log ratio), so each token's
        # gradient -phi * A is scaled by a function of every token of its sequence.
        if self.loss_type == "vespo":
            return "sequence"
        # Sequence-level IS (GSPO): coef_1 = exp(masked mean_t (logp_t - old_t)) is shared by the sequence; its
        # value (clip region, sapo gate, cispo cap, KL bias correction) and its derivative couple all tokens.
        if self.importance_sampling_level == "sequence":
            return "sequence"
        # Off-policy sequence mask: keep = (A >= 0) | (masked mean_t (sampling_t - logp_t) <= threshold), a
        # piecewise-constant factor that reads the (detached) logp of every token of the sequence.
        if self.off_policy_mask_threshold is not None:
            return "sequence"
        # Token-level ratio, for every remaining loss type:
        # - grpo: per-token term of coef_1 = exp(logp - old) of that token, divided by the row's mask count and B;
        # - bnpo: divided by the batch's mask count; dr_grpo: by B * max_completion_length;
        # - dapo / cispo: by num_items_in_batch (cispo's cap clamp(coef_1).detach() is the token's own);
        # - sapo: sigmoid gate of the token's own coef_1; luspo: row sum then mean over B;
        # - delta: a per-token clamp; KL (any estimator, with or without bias correction): per-token in logp
        #   and ref_logp, times the token's own coef_1; IS weights: given constants;
        # - the exact KL ("exact"): an additive term, beta * KL_t times a batch-constant weight, whose gradient
        #   flows through its own graph (fastrl.losses.policy), not through logp / entropy;
        # - entropy bonus: d/dH_n = -coef * m_n / (number of masked tokens), a batch constant.
        return "token"
