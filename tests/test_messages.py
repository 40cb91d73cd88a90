"""Errors a new user meets say what to do instead."""

from __future__ import annotations

import pytest

from fastrl import PolicyLossConfig


@pytest.mark.parametrize("loss_type", ["ppo", "PPO", "ppov2"])
def test_ppo_loss_type_points_at_the_ppo_constructor(loss_type):
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.ppo\(cliprange\)") as info:
        PolicyLossConfig(loss_type=loss_type)
    assert f"got {loss_type!r}" in str(info.value) and "'bnpo'" in str(info.value)
    ppo = PolicyLossConfig.ppo(0.2)  # what the message recommends is valid and is what it says
    assert (ppo.loss_type, ppo.epsilon_low, ppo.epsilon_high, ppo.beta) == ("bnpo", 0.2, 0.2, 0.0)


def test_other_unknown_loss_types_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"PolicyLossConfig\.loss_type must be one of \('grpo'") as info:
        PolicyLossConfig(loss_type="ppo2")
    assert ".ppo(" not in str(info.value)
