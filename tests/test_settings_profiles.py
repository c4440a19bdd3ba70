"""Settings: immutability, profiles, validation, and the precedence
decorator > check(...) arguments > pytest option > EQUIV_PROFILE > default."""

from __future__ import annotations

import dataclasses

import hypothesis
import pytest
import torch
from hypothesis.database import InMemoryExampleDatabase

import equiv
from equiv import settings
from equiv._settings import _load_environment_profile


@pytest.fixture(autouse=True)
def _restore_profile():
    """Each test starts and ends with the profile and session options it found."""
    previous = settings._push_session()
    yield
    settings._pop_session(previous)


def add_ref(x, y):
    return x + y


def make_add(**decorator):
    @equivalent(**decorator)
    def add(x, y):
        return torch.add(x, y)

    return add


def equivalent(**decorator):
    return equiv.equivalent_to(add_ref, **decorator)


def test_settings_are_immutable_and_hashable():
    """A settings object cannot be changed in place; derive a new one instead."""
    s = settings(max_examples=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_examples = 6  # type: ignore[misc]
    assert settings(s, seed=3).max_examples == 5 and hash(s) == hash(settings(max_examples=5))


def test_builtin_profiles():
    """default is quick, ci is derandomized with more examples, thorough explores more."""
    d, ci, th = (settings.get_profile(n) for n in ("default", "ci", "thorough"))
    assert (d.max_examples, d.derandomize, d.modes, d.devices) == (
        60, False, ("eager", "compile[aot_eager]"), ("cpu",))
    assert ci.derandomize and ci.max_examples > d.max_examples
    assert th.max_examples > ci.max_examples and "float64" in th.dtypes


def test_dtypes_and_per_dtype_tolerances():
    """dtypes take names or torch dtypes; tolerance(dtype) looks up the per-dtype pair."""
    s = settings(dtypes=(torch.float16, "float32"), tolerances={"float16": (1e-3, 1e-5)})
    assert s.dtypes == ("float16", "float32")
    assert s.tolerance(torch.float16) == (1e-3, 1e-5) and s.tolerance("float32") is None


def test_schedule_and_memory_checks_are_switched_by_checks():
    """Schedules and the memory contract belong to the spec; settings select the checks."""
    s = settings(checks=("forward", "schedule", "memory"))
    assert s.checks == ("forward", "schedule", "memory")
    with pytest.raises(equiv.InvalidArgument, match=r"settings\(\) got unknown option"):
        settings(memory={"max_peak_ratio": 1.0})


@pytest.mark.parametrize("changes, message", [
    ({"max_examples": 0}, "settings(max_examples=0): give a positive integer."),
    ({"modes": "eager"}, "settings(modes='eager'): give a tuple of strings, e.g. ('eager',)."),
    ({"dtypes": ("float17",)}, "settings(dtypes=('float17',)) names unknown dtype(s) "
                               "['float17']"),
    ({"tolerances": {"float16": 1e-3}}, "settings(tolerances={'float16': 0.001}): give "
                                        "{dtype: (rtol, atol)}"),
    ({"max_exampels": 3}, "settings() got unknown option(s) ['max_exampels']"),
])
def test_invalid_settings_name_the_option(changes, message):
    """Each invalid option raises InvalidArgument naming the option and the fix."""
    with pytest.raises(equiv.InvalidArgument) as info:
        settings(**changes)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("env, profile", [
    ({}, "default"),
    ({"CI": "true"}, "ci"),
    ({"EQUIV_PROFILE": "thorough"}, "thorough"),
    ({"EQUIV_PROFILE": "thorough", "CI": "1"}, "thorough"),
])
def test_environment_selects_the_profile(monkeypatch, env, profile):
    """EQUIV_PROFILE names the profile; CI alone loads ci; neither leaves default."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EQUIV_PROFILE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    settings.load_profile("default")
    _load_environment_profile()
    assert settings.default().profile == profile
    assert settings.default() == settings.get_profile(profile)


def test_precedence_decorator_over_check_over_pytest_option_over_profile(monkeypatch):
    """Each layer overrides the ones below it, field by field."""
    monkeypatch.setenv("EQUIV_PROFILE", "thorough")
    _load_environment_profile()                                        # EQUIV_PROFILE
    assert settings.default().max_examples == 200
    settings._push_session(max_examples=6, seed=11)                   # pytest option
    assert settings.default().max_examples == 6
    assert settings.default().dtypes == ("float32", "float64")  # the rest still thorough's
    plain = make_add()
    assert "max_examples=6" in equiv.check(plain).settings
    assert equiv.check(plain).seed == 11
    assert "max_examples=3" in equiv.check(plain, max_examples=3).settings   # check(...) arg
    decorated = make_add(settings=settings(max_examples=2))                   # decorator
    assert "max_examples=2" in equiv.check(decorated, max_examples=3).settings


def test_session_options_are_validated_and_undone():
    """_push_session validates at once; _pop_session restores the previous state."""
    before = settings.default()
    with pytest.raises(equiv.InvalidArgument):
        settings._push_session(max_examples=-1)
    previous = settings._push_session("ci", max_examples=9)
    assert settings.default().profile == "ci" and settings.default().max_examples == 9
    settings._pop_session(previous)
    assert settings.default() == before


def test_hypothesis_settings_pass_through():
    """Hypothesis's own options (here its example database) reach the run unchanged.

    derandomize is pinned off: the ``ci`` profile (loaded when ``CI`` is set) derandomizes,
    and a derandomized Hypothesis run never writes to its database.
    """
    db = InMemoryExampleDatabase()

    def ref(x):
        return x * 2

    @equiv.equivalent_to(ref)
    def off_by_one(x):
        return x * 2 + 1

    report = equiv.check(off_by_one, settings=settings(
        max_examples=5, seed=1, derandomize=False,
        hypothesis_settings=hypothesis.settings(database=db)),
        raise_on_failure=False)
    assert not report.ok
    assert db.data, "the failing example was not saved to the given Hypothesis database"


def test_tolerances_accept_their_own_stored_form():
    """settings(parent) round-trips: the stored (dtype, rtol, atol) triples are accepted."""
    s = settings(tolerances={"float64": (1e-9, 0)})
    assert settings(s).tolerances == s.tolerances == (("float64", 1e-9, 0.0),)
    with pytest.raises(equiv.InvalidArgument, match=r"settings\(tolerances=5\)"):
        settings(tolerances=5)


def test_decorator_settings_win_even_when_they_equal_the_class_default():
    """settings(modes=("eager",)) on a spec beats a profile that adds compile modes."""
    import equiv
    from equiv import equivalent_to

    equiv.settings.register_profile("with-compile", modes=("eager", "compile[eager]"),
                                    max_examples=3)
    try:
        equiv.settings.load_profile("with-compile")

        @equivalent_to(lambda x: x * 2, settings=equiv.settings(modes=("eager",)))
        def pinned(x):
            return x * 2

        @equivalent_to(lambda x: x * 2)
        def unpinned(x):
            return x * 2

        assert equiv.check(pinned).modes == ("eager",)
        assert equiv.check(unpinned).modes == ("eager", "compile[eager]")
        assert equiv.check(pinned).settings.startswith("profile=with-compile max_examples=3")
    finally:
        equiv.settings.load_profile("default")
        del equiv.settings._profiles["with-compile"]
