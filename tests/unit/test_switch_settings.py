"""A switch setting (``--expert-parallel``): on when the flag is given, else from its environment variable
(1/true/yes/on, 0/false/no/off), off by default; any other value is refused naming the variable."""

from __future__ import annotations

import pytest

from tokenmill_service.contract.config import load_settings
from tokenmill_service.contract.plan.options import LoadOptions


def test_the_flag_turns_it_on_and_the_default_is_off() -> None:
    assert load_settings(["--expert-parallel"], environ={}).expert_parallel is True
    assert load_settings([], environ={}).expert_parallel is False
    assert LoadOptions.from_settings(load_settings(["--expert-parallel"], environ={})).expert_parallel is True


@pytest.mark.parametrize(
    ("value", "expected"), [("1", True), ("On", True), ("true", True), ("0", False), ("off", False)]
)
def test_the_environment_sets_it(value: str, expected: bool) -> None:
    assert load_settings([], environ={"TOKENMILL_EXPERT_PARALLEL": value}).expert_parallel is expected


def test_another_value_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="TOKENMILL_EXPERT_PARALLEL='maybe' is not a valid bool"):
        load_settings([], environ={"TOKENMILL_EXPERT_PARALLEL": "maybe"})
