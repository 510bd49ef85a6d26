"""The OpenMP workers' wait policy: minfer's spin count unless the user chose one."""

from __future__ import annotations

import os

import pytest

from minfer.backends.cpu import waits


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    return monkeypatch


def test_default_spin_count_is_set(clean_env: pytest.MonkeyPatch) -> None:
    waits.configure_waits()
    assert os.environ["GOMP_SPINCOUNT"] == waits.SPINCOUNT == "5000"


@pytest.mark.parametrize(("name", "value"), [("GOMP_SPINCOUNT", "123"),
                                             ("OMP_WAIT_POLICY", "passive")])
def test_a_users_choice_stands(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    clean_env.setenv(name, value)
    waits.configure_waits()
    assert os.environ[name] == value
    if name == "OMP_WAIT_POLICY":
        assert "GOMP_SPINCOUNT" not in os.environ
