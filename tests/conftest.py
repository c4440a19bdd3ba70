"""Shared fixtures for equiv's own tests."""

from __future__ import annotations

import hypothesis
import pytest

import equiv
from equiv.examples import Args
from equiv.execution.record import Execution, Placement, execute
from equiv.spec import _REGISTRY, get_spec


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


def execution(fn, *args, seed=0, costly=True) -> Execution:
    """The core's record of one eager CPU example of the spec of ``fn`` (white-box tests)."""
    spec = get_spec(fn)
    place = Placement("eager", "eager", "cpu", spec.impl, None, None, None)
    return execute(spec, equiv.settings(), Args(*args), seed, place, costly)
