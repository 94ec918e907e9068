from dataclasses import dataclass, field

import pytest

from streamer.config import ConfigError, load_config


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


def test_unknown_field_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("inner:\n  lx: 0.5\n")
    with pytest.raises(ConfigError, match=r"c.yaml.inner: unknown field 'lx'"):
        load_config(Outer, p)


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"\$\.n"):
        load_config(Outer, overrides=["n=abc"])
