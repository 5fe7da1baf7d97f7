"""The log level names, read the same on every Python the service supports (3.10 included)."""

from __future__ import annotations

import logging

import pytest

from tokenmill_service.contract.log_setup import level_number


def test_level_names_are_read_without_python_3_11s_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    # Python 3.10 has no logging.getLevelNamesMapping (the service once called it, and failed there).
    monkeypatch.delattr(logging, "getLevelNamesMapping", raising=False)
    assert [level_number(name) for name in ("debug", "info", "warning", "error")] == [10, 20, 30, 40]
    assert level_number("WARNING") == logging.WARNING


def test_an_unknown_level_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        level_number("loud")
