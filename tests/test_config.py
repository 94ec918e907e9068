from dataclasses import dataclass, field

import pytest

from streamer.wire.config import ConfigError, load_config


@dataclass
class Inner:
    lr: float = 1e-3
    name: str = "x"


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    n: int = 2


def test_yaml_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lr: 0.5\nn: 3\n")
    cfg = load_config(Outer, p, ["inner.name=y", "n=7"])
    assert cfg == Outer(Inner(lr=0.5, name="y"), n=7)


def test_base_goes_under_the_file_and_overrides_and_is_not_written_into(tmp_path):
    base = {"inner": {"name": "b"}}
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lr: 0.5\n")
    assert load_config(Outer, p, ["inner.name=y"], base=base) == Outer(Inner(lr=0.5, name="y"))
    assert load_config(Outer, p, base=base) == Outer(Inner(lr=0.5, name="b"))
    assert base == {"inner": {"name": "b"}}


def test_unknown_field_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lx: 0.5\n")
    with pytest.raises(ConfigError, match=r"c.yaml.inner: unknown field 'lx'"):
        load_config(Outer, p)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"\$\.n"):
        load_config(Outer, overrides=["n=abc"])


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan"])
def test_non_finite_numbers_are_refused_with_the_field_named(text):
    with pytest.raises(ConfigError, match=r"Outer.inner.lr: .* is not a finite number"):
        load_config(Outer, None, [f"inner.lr={text}"])
    with pytest.raises(ConfigError, match=r"Number out of range - at `\$.inner.lr`"):
        load_config(Outer, None, ["inner.lr=1e400"])


def test_learner_config_refuses_an_infinite_learning_rate():
    from learner.config import LearnerConfig

    with pytest.raises(ConfigError, match=r"LearnerConfig.optim.lr: inf is not a finite number"):
        load_config(LearnerConfig, None, ["optim.lr=.inf"])


def test_choice_fields_are_literals_equal_to_their_registries_and_errors_list_the_choices():
    from typing import get_args

    from learner.algorithms import AGGS, GROUP_ESTIMATORS, KL_TYPES, POLICY_LOSSES
    from learner.config import Aggregation, Estimator, KLType, LearnerConfig, LossName

    assert get_args(LossName) == tuple(POLICY_LOSSES) and get_args(KLType) == tuple(KL_TYPES)
    assert get_args(Estimator) == ("gae", *GROUP_ESTIMATORS) and get_args(Aggregation) == tuple(AGGS)
    with pytest.raises(ConfigError, match="loss.kl_type: 'k2' is not one of k1, k3"):
        load_config(LearnerConfig, None, ["loss.kl_type=k2"])
    with pytest.raises(ConfigError, match="loss.agg: 'mean' is not one of token_mean"):  # an Optional choice
        load_config(LearnerConfig, None, ["loss.agg=mean"])


def test_learner_config_names_a_critic_depth_it_cannot_build():
    from learner.config import LearnerConfig

    assert load_config(LearnerConfig, None, ["value.layers=2"]).value.layers == 2
    with pytest.raises(ConfigError, match=r"value.layers: 0 must be >= 1"):
        load_config(LearnerConfig, None, ["value.layers=0"])
    with pytest.raises(ConfigError, match=r"value.layers: a critic shallower than the policy is not supported on "
                                          r"the megatron backend"):
        load_config(LearnerConfig, None, ["value.layers=2", "backend.name=megatron", "loss.kl_coef=0"])
