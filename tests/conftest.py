"""Shared fixtures for equiv's own tests."""

from __future__ import annotations

import hypothesis
import pytest

import equiv
from equiv.spec import _REGISTRY


@pytest.fixture(autouse=True)
def _isolated_registry():
    """Specs registered inside a test do not leak into other tests."""
    before = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(before)


#: settings for fast tests of equiv itself: few examples, fixed seed, no database, eager only
#: (settings() inherits the loaded profile, whose modes include compile[aot_eager])
FAST = equiv.settings(max_examples=15, seed=1234, modes=("eager",),
                      hypothesis_settings=hypothesis.settings(database=None))
