"""Every clip range and coefficient of ``PolicyLossConfig`` and of ``GRPOConfig``'s loss and fastrl options is checked
against the range where it means something (an error naming the option, the range and the value), and a misspelt
keyword is answered with the closest option names."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest

from fastrl import PolicyLossConfig
from fastrl._options import number, unknown_keyword_message

# (field, a value refused, the range the message states, a value just inside it)
POLICY_RANGES = [
    ("epsilon_low", 1.5, "a number in [0, 1)", 0.999),
    ("epsilon_low", 1.0, "a number in [0, 1)", 0.5),
    ("epsilon_low", -0.1, "a number in [0, 1)", 0.2),
    ("epsilon_high", 0.0, "a finite number > 0", 1e-3),
    ("delta", 1.0, "None or a finite number > 1", 1.01),
    ("delta", 0.5, "None or a finite number > 1", 2.0),
    ("beta", -0.01, "a finite number >= 0", 0.0),
    ("entropy_coef", -0.01, "a finite number >= 0", 0.0),
    ("temperature", 0.0, "a finite number > 0", 1e-3),
    ("sapo_temperature_neg", 0.0, "a finite number > 0", 0.5),
    ("vespo_k_pos", -1.0, "a finite number >= 0", 0.0),
    ("vespo_lambda_neg", float("inf"), "a finite number >= 0", 0.0),
    ("top_entropy_quantile", 1.01, "a number in [0, 1]", 0.0),
    ("off_policy_mask_threshold", 0.0, "None or a finite number > 0", 0.5),
    ("off_policy_mask_threshold", float("nan"), "None or a finite number > 0", None),
]


@pytest.mark.parametrize("field,bad,expected,good", POLICY_RANGES, ids=[f"{f}={b}" for f, b, _, _ in POLICY_RANGES])
def test_policy_loss_config_refuses_a_value_outside_its_range(field, bad, expected, good):
    with pytest.raises(ValueError) as info:
        PolicyLossConfig(**{field: bad})
    assert str(info.value).startswith(f"PolicyLossConfig.{field} must be {expected}, got {bad!r}"), str(info.value)
    PolicyLossConfig(**{field: good})  # the edge inside the range is accepted


def test_an_epsilon_low_of_one_or_more_says_why_it_could_never_bind():
    with pytest.raises(ValueError, match=r"lower clip bound 1 - 1.5 must stay above 0"):
        PolicyLossConfig(epsilon_low=1.5)


def test_epsilon_high_taken_from_a_zero_epsilon_low_says_so():
    with pytest.raises(ValueError, match="epsilon_high must be a finite number > 0, got 0.0.*takes epsilon_low's"):
        PolicyLossConfig(epsilon_low=0.0)
    assert PolicyLossConfig(epsilon_low=0.0, epsilon_high=0.28).epsilon_high == 0.28
    # cispo: epsilon_high is the cap on the ratio itself (TRL recommends 5.0)
    assert PolicyLossConfig(loss_type="cispo", epsilon_high=5.0).epsilon_high == 5.0


@pytest.mark.parametrize("keyword,suggestion", [
    ("epsilon_lo", "'epsilon_low'"), ("epsilon", "'epsilon_low'"), ("loss_typ", "'loss_type'"), ("Beta", "'beta'"),
])
def test_policy_loss_config_suggests_the_closest_option(keyword, suggestion):
    with pytest.raises(TypeError) as info:
        PolicyLossConfig(**{keyword: 0.1})
    message = str(info.value)
    assert message.startswith(f"PolicyLossConfig got an unexpected keyword argument {keyword!r}; did you mean"), message
    assert suggestion in message, message
    with pytest.raises(TypeError, match="did you mean"):  # dataclasses.replace goes through the same __init__
        dataclasses.replace(PolicyLossConfig(), **{keyword: 0.1})


def test_a_keyword_close_to_nothing_lists_the_options():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz'; its options are beta, delta, "):
        PolicyLossConfig(zzz=1)


def test_the_signature_stays_the_dataclasss():
    params = inspect.signature(PolicyLossConfig).parameters
    assert list(params)[:3] == ["loss_type", "epsilon_low", "epsilon_high"]
    assert PolicyLossConfig("grpo", 0.1).epsilon_low == 0.1  # positional arguments still work


def test_number_states_range_and_reason():
    with pytest.raises(ValueError, match=r"^X.y must be a number in \(0, 2\], got True: why$"):
        number("X", "y", True, low=0, high=2, low_open=True, why="why")  # a bool is not a number
    number("X", "y", None, low=0, optional=True)
    # an alias matched closely answers with the option it stands for; no close match lists every option
    assert unknown_keyword_message("C", "bb_", ["a"], {"bb": "a"}).endswith("; did you mean 'a'?")
    assert unknown_keyword_message("C", "zz", ["a"], {"bb": "a"}).endswith("'zz'; its options are a")


# ------------------------------------------------------------------------------------------------ GRPOConfig

def _grpo(tmp_path, **kw):
    pytest.importorskip("trl")
    from fastrl import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", **kw)


GRPO_RANGES = [
    (dict(epsilon=1.5), r"GRPOConfig.epsilon must be a number in \[0, 1\), got 1.5: the ratio's lower clip bound"),
    (dict(epsilon=0.0), r"GRPOConfig.epsilon_high must be a finite number > 0, got 0.0.*takes epsilon's value"),
    (dict(epsilon_high=0.0), r"GRPOConfig.epsilon_high must be a finite number > 0, got 0.0"),
    (dict(delta=1.0), r"GRPOConfig.delta must be None or a finite number > 1, got 1.0"),
    (dict(loss_type="sapo", delta=0.9), r"GRPOConfig.delta must be None or a finite number > 1, got 0.9"),
    (dict(beta=-0.04), r"GRPOConfig.beta must be a finite number >= 0, got -0.04"),
    (dict(entropy_coef=-0.01), r"GRPOConfig.entropy_coef must be a finite number >= 0, got -0.01"),
    (dict(entropy_coef_min=-0.1), r"GRPOConfig.entropy_coef_min must be a finite number >= 0, got -0.1"),
    (dict(entropy_coef_min=0.5, entropy_coef_max=0.1), r"GRPOConfig.entropy_coef_max must be a finite number >= 0.5"),
    (dict(off_policy_mask_threshold=-0.5), r"GRPOConfig.off_policy_mask_threshold must be None or a finite number > 0"),
    (dict(sapo_temperature_pos=0.0), r"GRPOConfig.sapo_temperature_pos must be a finite number > 0"),
    (dict(vespo_k_neg=-2.0), r"GRPOConfig.vespo_k_neg must be a finite number >= 0"),
    (dict(fastrl_backend="trition"), r"GRPOConfig.fastrl_backend must be None or one of .*got 'trition'; did you mean "
                                     r"'triton'\?"),
    (dict(fastrl_chunk_tokens=0), r"GRPOConfig.fastrl_chunk_tokens must be None or a positive int, got 0"),
    (dict(fused_loss="yes"), r"GRPOConfig.fused_loss must be a bool, got 'yes'"),
    (dict(one_pass_loss=1), r"GRPOConfig.one_pass_loss must be a bool, got 1"),
]


@pytest.mark.parametrize("kw,match", GRPO_RANGES,
                         ids=[",".join(f"{k}={v}" for k, v in kw.items()) for kw, _ in GRPO_RANGES])
def test_grpo_config_refuses_a_value_outside_its_range(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _grpo(tmp_path, **kw)


def test_grpo_config_accepts_the_edges(tmp_path):
    args = _grpo(tmp_path, epsilon=0.0, epsilon_high=0.28, delta=1.01, entropy_coef=0.0, loss_type="dapo")
    assert (args.epsilon, args.epsilon_high, args.delta) == (0.0, 0.28, 1.01)
    _grpo(tmp_path, loss_type="cispo", epsilon_high=5.0)


@pytest.mark.parametrize("keyword,suggestion", [
    ("epsilon_lo", "'epsilon'"), ("epsilon_low", "'epsilon'"), ("fastrl_backed", "'fastrl_backend'"),
    ("backend", "'fastrl_backend'"), ("one_pass", "'one_pass_loss'"),
])
def test_grpo_config_suggests_the_closest_option(tmp_path, keyword, suggestion):
    with pytest.raises(TypeError) as info:
        _grpo(tmp_path, **{keyword: 0.1})
    message = str(info.value)
    assert message.startswith(f"GRPOConfig got an unexpected keyword argument {keyword!r}; did you mean "), message
    assert suggestion in message, message


def test_grpo_config_still_parses_from_the_command_line(tmp_path):
    pytest.importorskip("trl")
    from transformers import HfArgumentParser

    from fastrl import GRPOConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", "--epsilon_high", "0.28",
             "--fastrl_backend", "torch", "--report_to", "none"])
    assert (args.epsilon_high, args.fastrl_backend) == (0.28, "torch")
    assert "fastrl_backend" in inspect.signature(GRPOConfig).parameters
