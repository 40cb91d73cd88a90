"""``TrainingHealthCallback``: watch the numbers TRL's documentation calls crucial and say, in plain words, when
they go wrong.

A ``transformers.TrainerCallback`` for fastrl's (and TRL's) GRPO and PPO trainers. Checks are rows of a table
(``CHECKS``): which logged metrics they read (GRPO and PPO names), the condition, and the sentence to print.
Each problem is logged with ``logging.warning`` on the ``fastrl.health`` logger (and as a rich panel with
``use_rich=True``), the first time it happens and then at most once every ``repeat_every`` logging steps; every
warning is also kept in ``callback.events`` as ``(global_step, check_name, message)``.

At the start of training it also warns about generation settings known to make the KL estimate negative
(sampling from a distribution other than the policy's: top-k, top-p < 1, min-p, repetition penalty, a forced
minimum length), and names ``sampling_replay``, which computes the log-probs over the sampler's kept ids; with
replay on, only a repetition penalty (which reweights the kept ids) is still named.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

from transformers import TrainerCallback

__all__ = ["Check", "CHECKS", "TrainingHealthCallback"]

logger = logging.getLogger("fastrl.health")

# Negative KL. One logged value is a noisy estimate (k1 averages log-ratios that are as often negative as positive),
# so a single slightly negative log is normal. Warn when it is large, or sustained beyond its own noise.
NEG_KL = -1e-3  # the mean KL over a window must be below this (not rounding noise) ...
NEG_KL_WINDOW = 8  # ... over this many consecutive logs (the current one and the `history` before it) ...
NEG_KL_Z = 5.0  # ... and this many standard errors below zero (t quantile 0.999 at 7 dof: 4.79)
LARGE_NEG_KL = -0.1  # nats: one log below this (and below LARGE_NEG_KL_Z x the recent spread) is not noise
LARGE_NEG_KL_Z = 4.0
HIGH_KL = 1.0  # nats per token: the policy has moved far from the reference
KL_GROWTH = 4.0  # KL this many times its value `history` logs ago ...
KL_GROWTH_FLOOR = 0.05  # ... and above this, counts as growing fast
RATIO_TOL = 0.2  # |mean ratio - 1| above this: the sampled data is far off-policy
HIGH_CLIP = 0.2  # fraction of tokens clipped
HIGH_TRUNCATION = 0.5  # fraction of completions cut at max_completion_length before EOS
VALUE_SPIKE = 10.0  # value loss this many times its recent median


@dataclass(frozen=True)
class Check:
    """One row: ``test(value, history)`` is True when something is wrong; ``history`` holds earlier values of
    the same metric (oldest first). ``message`` is formatted with ``key`` and ``value``."""

    name: str
    keys: tuple[str, ...]
    test: Callable[[float, list[float]], bool]
    message: str


def _not_finite(v: float, hist: list[float]) -> bool:
    return not math.isfinite(v)


def _kl_negative(v: float, hist: list[float]) -> bool:
    """Large (one log far below zero, beyond the recent spread) or sustained (a window whose mean is clearly < 0)."""
    if not math.isfinite(v):
        return False
    prev = [x for x in hist if math.isfinite(x)]
    spread = statistics.stdev(prev) if len(prev) >= 2 else 0.0
    if v < LARGE_NEG_KL and v < -LARGE_NEG_KL_Z * spread:
        return True
    window = (prev + [v])[-NEG_KL_WINDOW:]
    if len(window) < NEG_KL_WINDOW:
        return False
    mean = statistics.fmean(window)
    stderr = statistics.stdev(window) / math.sqrt(len(window))
    return mean < NEG_KL and mean < -NEG_KL_Z * stderr


def _kl_growing(v: float, hist: list[float]) -> bool:
    return len(hist) >= 3 and v > KL_GROWTH_FLOOR and hist[0] > 0 and v > KL_GROWTH * hist[0]


def _spike(v: float, hist: list[float]) -> bool:
    if len(hist) < 3 or not math.isfinite(v):
        return False
    med = sorted(hist)[len(hist) // 2]
    return med > 0 and v > VALUE_SPIKE * med


_KL = ("kl", "objective/kl")
_LOSSES = ("loss", "loss/policy_avg", "loss/value_avg", "policy_loss")
_REWARDS = ("reward", "objective/scores", "objective/rlhf_reward")

CHECKS: tuple[Check, ...] = (
    Check("loss_nan", _LOSSES, _not_finite,
          "{key} is {value}: training has diverged (check the learning rate, the reward scale and bf16 overflow); "
          "later updates are meaningless."),
    Check("reward_nan", _REWARDS, _not_finite,
          "{key} is {value}: the reward is not finite (a reward function or the reward model returned NaN/inf); "
          "the advantages and the loss are NaN from here on."),
    Check("kl_negative", _KL, _kl_negative,
          "{key} = {value:.4g}: the KL estimate is negative beyond its noise (far below zero, or below zero over "
          "several logs in a row), and a true KL never is. The completions were not sampled from the policy being "
          "trained (top-k / top-p / min-p sampling without sampling_replay, a different temperature, a stale "
          "inference engine)."),
    Check("kl_high", _KL, lambda v, h: math.isfinite(v) and v > HIGH_KL,
          "{key} = {value:.4g} nats per token: the policy has moved far from the reference; the KL penalty is "
          "not holding it (raise beta, lower the learning rate)."),
    Check("kl_growing", _KL, _kl_growing,
          "{key} = {value:.4g} is growing fast (more than 4x within a few logs): the policy is drifting away "
          "quickly; watch the reward for hacking."),
    Check("ratio_off", ("val/ratio", "sampling/importance_sampling_ratio/mean"),
          lambda v, h: math.isfinite(v) and abs(v - 1.0) > RATIO_TOL,
          "{key} = {value:.4g} is far from 1: the data being trained on is far off-policy (too many updates per "
          "batch, or the sampler disagrees with the trainer); clipping will throw most of it away."),
    Check("clip_high", ("clip_ratio/region_mean", "policy/clipfrac_avg", "cispo_clip_ratio"),
          lambda v, h: math.isfinite(v) and v > HIGH_CLIP,
          "{key} = {value:.3g}: a large share of tokens is clipped, so most of the batch gives no gradient "
          "(lower the learning rate or num_iterations)."),
    Check("truncated", ("completions/clipped_ratio",), lambda v, h: math.isfinite(v) and v > HIGH_TRUNCATION,
          "{key} = {value:.3g}: most completions hit max_completion_length before EOS; their rewards judge "
          "cut-off text (raise max_completion_length, or set mask_truncated_completions=True)."),
    Check("value_loss_spike", ("loss/value_avg",), _spike,
          "{key} = {value:.4g} spiked (10x its recent median): the value head is unstable (lower vf_coef or the "
          "learning rate, or whiten the rewards)."),
)


class TrainingHealthCallback(TrainerCallback):
    """Warn in plain words when a GRPO/PPO run's health metrics go wrong (see the module docstring).

    Args:
        checks: the table of checks (default ``CHECKS``).
        repeat_every: after a check fires, stay quiet about it for this many logging steps.
        history: how many earlier values per metric the checks may look at (the sustained negative-KL check
            needs ``NEG_KL_WINDOW - 1``, the default).
        use_rich: also print each warning as a rich panel (when rich is installed).
    """

    def __init__(self, checks: tuple[Check, ...] = CHECKS, repeat_every: int = 20, history: int = NEG_KL_WINDOW - 1,
                 use_rich: bool = False):
        self.checks = tuple(checks)
        self.repeat_every = int(repeat_every)
        self.use_rich = use_rich
        self.events: list[tuple[int, str, str]] = []
        self._hist: dict[str, deque] = defaultdict(lambda: deque(maxlen=history))
        self._last_fired: dict[str, int] = {}
        self._n_logs = 0

    # ------------------------------------------------------------------------------------------------------
    def _warn(self, step: int, name: str, message: str) -> None:
        self.events.append((step, name, message))
        logger.warning("[fastrl health, step %d] %s", step, message)
        if self.use_rich:
            try:
                from rich.console import Console
                from rich.panel import Panel

                Console(stderr=True).print(Panel(message, title=f"fastrl health: {name} (step {step})",
                                                 border_style="yellow"))
            except ImportError:
                pass

    def check_logs(self, logs: dict, step: int = 0) -> list[str]:
        """Run every check on one ``logs`` dict; return the names of the checks that fired (also warned)."""
        self._n_logs += 1
        fired = []
        values = {}
        for key, value in logs.items():
            bare = key[len("eval_"):] if key.startswith("eval_") else key
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    continue
            values[key] = (bare, float(value))
        for check in self.checks:
            for key, (bare, value) in values.items():
                if bare not in check.keys:
                    continue
                hist = list(self._hist[key])
                if check.test(value, hist):
                    tag = f"{check.name}:{key}"
                    last = self._last_fired.get(tag)
                    if last is None or self._n_logs - last >= self.repeat_every:
                        self._last_fired[tag] = self._n_logs
                        self._warn(step, check.name, check.message.format(key=key, value=value))
                    fired.append(check.name)
        for key, (_, value) in values.items():
            self._hist[key].append(value)
        return fired

    def check_generation_settings(self, args, model=None) -> list[str]:
        """Warn about sampling settings that make the KL estimate negative; return the settings named.

        With ``args.sampling_replay`` on ("kept_set" or "rule") the log-probs are computed over the sampler's
        support, so the truncation settings (top-k, top-p, min-p, a minimum length) are no longer named; a
        repetition penalty reweights the kept ids and is still named."""
        replay = getattr(args, "sampling_replay", "off")
        bad = self._sampling_settings(args, model)
        if replay in ("kept_set", "rule"):
            bad = [b for b in bad if b.startswith("repetition_penalty")]
        if bad:
            advice = ("Sample from the full distribution (top_k=0, top_p=1, no min-p, no repetition penalty, no "
                      "forced minimum length), or set sampling_replay='kept_set' (or 'rule') so that the log-probs "
                      "are computed over the ids the sampler kept.")
            if replay != "off":
                advice = (f"sampling_replay={replay!r} replays which ids were kept, not a penalty's reweighting of "
                          "them.")
            self._warn(
                0, "generation_settings",
                "generation settings " + ", ".join(bad) + " sample completions from a distribution other than the "
                "policy's; the per-token log-probs the loss uses are the policy's, so the KL estimate can go "
                "negative and the ratios drift. " + advice,
            )
        return bad

    @staticmethod
    def _sampling_settings(args, model=None) -> list[str]:
        bad = []
        top_k = getattr(args, "top_k", None)
        if top_k not in (None, 0, -1):
            bad.append(f"top_k={top_k}")
        top_p = getattr(args, "top_p", None)
        if top_p is not None and top_p < 1.0:
            bad.append(f"top_p={top_p}")
        min_p = getattr(args, "min_p", None)
        if min_p not in (None, 0, 0.0):
            bad.append(f"min_p={min_p}")
        rep = getattr(args, "repetition_penalty", None)
        if rep not in (None, 1, 1.0):
            bad.append(f"repetition_penalty={rep}")
        gen_kwargs = getattr(args, "generation_kwargs", None) or {}
        if isinstance(gen_kwargs, dict):
            for k in ("min_length", "min_new_tokens"):
                if gen_kwargs.get(k):
                    bad.append(f"{k}={gen_kwargs[k]}")
            for k, ok in (("top_k", (0, None)), ("top_p", (1.0, None)), ("min_p", (0.0, None))):
                if k in gen_kwargs and gen_kwargs[k] not in ok and f"{k}={gen_kwargs[k]}" not in bad:
                    bad.append(f"{k}={gen_kwargs[k]}")
        gen_cfg = getattr(model, "generation_config", None)
        for k in ("min_length", "min_new_tokens"):
            v = getattr(gen_cfg, k, None)
            if v and not any(b.startswith(k + "=") for b in bad):
                bad.append(f"{k}={v} (model.generation_config)")
        return bad

    # ------------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.check_generation_settings(args, model)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs:
            self.check_logs(logs, step=getattr(state, "global_step", 0))
