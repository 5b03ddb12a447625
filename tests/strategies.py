"""Hypothesis strategies derived from the family records: a registered family is drawn from with
no entry here."""

from __future__ import annotations

from hypothesis import strategies as st

from mmparity.models import registry as families


def family_configs(name: str):
    """Configs of ``name`` drawn by its record's ``random_config(pick)``, ``pick`` being hypothesis'
    choice among the options it is given (so failures shrink towards the first option)."""
    random_config = families.get(name).hooks.config.random

    @st.composite
    def configs(draw):
        return random_config(lambda options: draw(st.sampled_from(list(options))))

    return configs()


def tp_sizes(name: str, cfg, largest: int = 8) -> list[int]:
    """The TP sizes up to ``largest`` that the family's own converter accepts for ``cfg``."""
    validate = families.get(name).rule_set(cfg).validate_tp
    return [t for t in range(1, largest + 1) if not (validate and validate(t))]


@st.composite
def config_and_tp(draw, name: str):
    """A config of family ``name`` and a TP size its converter accepts for it."""
    cfg = draw(family_configs(name))
    return cfg, draw(st.sampled_from(tp_sizes(name, cfg)))


CONFIGS = {name: family_configs(name) for name in families.names()}
