"""Immutable settings with named profiles (modelled on ``hypothesis.settings``)."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar

from equiv._catalog import CHECK_NAMES
from equiv._options import string_tuple
from equiv.errors import InvalidArgument

#: every check, in run and report order (the catalog's)
ALL_CHECKS: tuple[str, ...] = CHECK_NAMES

_DTYPES = ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8",
           "int16", "int32", "int64", "uint8", "bool")

#: the cotangent seed of explicit examples (``examples=``): above the drawn seeds
#: (0 .. 2**31 - 1), so the runner knows them (the costly checks run on every one)
EXPLICIT_SEED = 2**31


def _dtype_name(d: Any) -> str:
    name = d if isinstance(d, str) else str(d)
    return name.removeprefix("torch.")


def _dtype_names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise InvalidArgument(
            f"settings(dtypes={value!r}): give a tuple of dtypes, e.g. ('float32', 'float64')."
        )
    names = tuple(_dtype_name(d) for d in value)
    unknown = [n for n in names if n not in _DTYPES]
    if not names:
        raise InvalidArgument(
            f"settings(dtypes={value!r}) names no dtype: give at least one, e.g. ('float32',).")
    if unknown:
        raise InvalidArgument(
            f"settings(dtypes={value!r}) names unknown dtype(s) {unknown}; known: {list(_DTYPES)}."
        )
    return names


def _tolerance_triples(value: Any) -> tuple[tuple[str, float, float], ...]:
    if hasattr(value, "items"):
        items = list(value.items())
    elif isinstance(value, (tuple, list)) and all(
            isinstance(t, (tuple, list)) and len(t) == 3 for t in value):
        items = [(t[0], tuple(t[1:])) for t in value]
    else:
        items = [(value, None)]
    out = []
    for dtype, tol in items:
        name = _dtype_name(dtype)
        ok = (name in _DTYPES and isinstance(tol, (tuple, list)) and len(tol) == 2
              and all(isinstance(t, (int, float)) and not isinstance(t, bool)
                    and math.isfinite(t) and t >= 0 for t in tol))
        if not ok:
            raise InvalidArgument(
                f"settings(tolerances={value!r}): give {{dtype: (rtol, atol)}} with known dtype "
                f"names and numbers >= 0, e.g. {{'float16': (1e-3, 1e-5)}}; bad entry "
                f"{dtype!r}: {tol!r}."
            )
        out.append((name, float(tol[0]), float(tol[1])))
    return tuple(sorted(out))


#: the modes torch may be unable to run an implementation under (skipped, with torch's reason)
SKIPPABLE: tuple[str, ...] = ("functionalize", "vmap", "jvp")


def skippable(value: Any, where: str) -> tuple[str, ...]:
    """``allow_skip=`` validated: a tuple of names from :data:`SKIPPABLE`."""
    names = string_tuple(value)
    if names is None or not all(n in SKIPPABLE for n in names):
        raise InvalidArgument(
            f"{where}(allow_skip={value!r}): give a tuple of the modes whose skip you accept "
            f"when torch cannot run the implementation under them, from {list(SKIPPABLE)}, "
            "e.g. allow_skip=('vmap',).")
    return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class settings:
    """What a run explores. Immutable: derive with ``settings(parent, max_examples=...)``.

    Precedence when running: options given to ``equivalent_to`` > arguments of ``check`` >
    the loaded profile (``EQUIV_PROFILE``, or ``ci`` when the ``CI`` variable is set) > ``default``.
    Hypothesis's own options (``database``, ``phases``, health checks...) pass through
    ``hypothesis_settings``.
    """

    max_examples: int = 60
    derandomize: bool = False
    seed: int | None = None
    modes: tuple[str, ...] = ("eager",)
    devices: tuple[str, ...] = ("cpu",)
    checks: tuple[str, ...] = ALL_CHECKS
    backward_repeats: int = 2
    hypothesis_settings: Any = None
    #: dtypes that inputs derived from a signature are drawn in, by name ("float32", "float64",
    #: "bfloat16", ...); an explicit ``inputs=`` strategy chooses its own.
    dtypes: tuple[str, ...] = ("float32", "float64")
    #: per-dtype (rtol, atol) overriding torch.testing.assert_close's table; give a mapping
    #: ``{"float16": (1e-3, 1e-5)}``, stored as sorted ``(dtype, rtol, atol)`` triples.
    #: A spec's own rtol/atol still win.
    tolerances: tuple[tuple[str, float, float], ...] = ()
    #: seconds one example may take (both sides, all checks) before the run stops with a
    #: "timeout" outcome naming the spec; None: no limit (Hypothesis's own ``deadline``, given
    #: through ``hypothesis_settings``, is honoured either way)
    timeout: float | None = None
    #: transforms whose skip is accepted when torch cannot run the implementation under them
    #: (a classic ``autograd.Function`` under ``vmap``...): ``("vmap", "jvp", "functionalize")``
    #: or some of them; a skip of any other requested mode is not a pass
    allow_skip: tuple[str, ...] = ()
    #: the share of examples the costly checks (catalog rows marked costly: the schedules, the
    #: no-grad path, state across calls, output stability, double backward) and the default
    #: memory bound run on: the first valid example and one in ``round(1 / costly_share)``
    #: after it; explicit ``examples=`` and, once an example has failed, every later one (so
    #: a failure found there shrinks and replays like any other); 1.0 runs them on every one
    costly_share: float = 0.25
    #: every spec's implementation must be deterministic: two calls on fresh, equal inputs
    #: give bitwise-equal outputs, mutated arguments and gradients (the ``determinism`` check)
    deterministic: bool = False

    _profiles: ClassVar[dict[str, "settings"]] = {}
    _current: ClassVar[str] = "default"
    #: ``$EQUIV_PROFILE`` (else ``ci`` when ``$CI`` is set) not applied yet: it is resolved on
    #: first use, after the targets (which may register that profile) are imported
    _environment_pending: ClassVar[bool] = True
    #: options of the running pytest session (--equiv-max-examples...), applied over the profile
    _session_overrides: ClassVar[dict[str, Any]] = {}

    def __init__(self, parent: "settings | None" = None, **changes: Any) -> None:
        if parent is not None and not isinstance(parent, settings):
            raise InvalidArgument(
                f"settings(parent={parent!r:.60}): the parent must be an equiv.settings object.")
        # like hypothesis.settings(): no parent means the loaded profile's values (only the
        # options given here count as explicit)
        if parent is None:
            type(self)._environment(strict=False)
        base = parent if parent is not None else type(self)._profiles.get(type(self)._current)
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - fields)
        if unknown:
            raise InvalidArgument(
                f"settings() got unknown option(s) {unknown}; valid options are {sorted(fields)}."
            )
        for f in dataclasses.fields(self):
            if f.name in changes:
                value = changes[f.name]
            elif base is not None:
                value = getattr(base, f.name)
            else:
                value = f.default
            object.__setattr__(self, f.name, value)
        # which options were given here or by an explicit parent (a decorator's settings win
        # for exactly these, over the profile and check()'s arguments)
        explicit = frozenset(changes) | (getattr(parent, "_explicit", frozenset()))
        object.__setattr__(self, "_explicit", explicit)
        self._validate()
        self._validate_more()

    def _validate_more(self) -> None:
        """Validate and normalise dtypes and tolerances. (Schedules and the memory contract
        are the spec's: ``equivalent_to(schedules=..., max_memory_ratio=...)``; the ``checks``
        setting switches the ``schedule`` and ``memory`` checks on or off.)"""
        object.__setattr__(self, "dtypes", _dtype_names(self.dtypes))
        object.__setattr__(self, "tolerances", _tolerance_triples(self.tolerances))
        object.__setattr__(self, "allow_skip", skippable(self.allow_skip, "settings"))

    @property
    def costly_period(self) -> int:
        """The costly checks run on one drawn example in this many (``round(1 / share)``)."""
        return max(round(1 / self.costly_share), 1)

    def tolerance(self, dtype: Any) -> tuple[float, float] | None:
        """The (rtol, atol) configured for ``dtype`` (a name or torch dtype), or None for
        torch.testing.assert_close's default."""
        name = _dtype_name(dtype)
        for d, rtol, atol in self.tolerances:
            if d == name:
                return rtol, atol
        return None

    def _validate(self) -> None:
        if (not isinstance(self.max_examples, int) or isinstance(self.max_examples, bool)
                or self.max_examples < 1):
            raise InvalidArgument(
                f"settings(max_examples={self.max_examples!r}): give a positive integer."
            )
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or isinstance(self.seed, bool)):
            raise InvalidArgument(f"settings(seed={self.seed!r}): give an integer or None.")
        if not isinstance(self.deterministic, bool):
            raise InvalidArgument(
                f"settings(deterministic={self.deterministic!r}): give True or False.")
        if not isinstance(self.derandomize, bool):
            raise InvalidArgument(
                f"settings(derandomize={self.derandomize!r}): give True or False.")
        c = self.costly_share
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1:
            raise InvalidArgument(
                f"settings(costly_share={c!r}): give the share of examples the costly checks "
                "run on, a number in (0, 1], e.g. 0.25 (1 runs them on every example).")
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not math.isfinite(t) or t <= 0):
            raise InvalidArgument(
                f"settings(timeout={t!r}): give the seconds one example may take, a finite "
                "number > 0, or None for no limit.")
        if self.hypothesis_settings is not None:
            import hypothesis

            if not isinstance(self.hypothesis_settings, hypothesis.settings):
                raise InvalidArgument(
                    f"settings(hypothesis_settings={self.hypothesis_settings!r:.60}): give a "
                    "hypothesis.settings object, e.g. hypothesis.settings(database=None).")
        for name in ("modes", "devices", "checks"):
            value = getattr(self, name)
            # modes also take equiv.compiled(...) objects (equiv.modes.Mode)
            ok = (lambda v: isinstance(v, str) or hasattr(v, "kind")) if name == "modes" else (
                lambda v: isinstance(v, str))
            if isinstance(value, str) or not all(ok(v) for v in value):
                example = {"modes": "('eager',)", "devices": "('cpu',)",
                           "checks": "('forward', 'gradients')"}[name]
                raise InvalidArgument(
                    f"settings({name}={value!r}): give a tuple of strings, e.g. {example}."
                )
            object.__setattr__(self, name, tuple(value))
        unknown = [c for c in self.checks if c not in ALL_CHECKS]
        if unknown:
            raise InvalidArgument(
                f"settings(checks=...) names unknown check(s) {unknown}; known: {list(ALL_CHECKS)}."
            )
        if isinstance(self.backward_repeats, bool) or self.backward_repeats not in (1, 2):
            raise InvalidArgument(
                f"settings(backward_repeats={self.backward_repeats!r}): give 1 (no repeated "
                "backward) or 2 (backward again through the retained graph)."
            )

    # -- profiles ---------------------------------------------------------------------------
    @classmethod
    def register_profile(cls, name: str, parent: "settings | None" = None, **changes: Any) -> None:
        """Store a named profile built from ``parent`` (default: the ``default`` profile)."""
        cls._profiles[name] = settings(parent or cls._profiles.get("default"), **changes)

    @classmethod
    def get_profile(cls, name: str) -> "settings":
        try:
            return cls._profiles[name]
        except KeyError:
            raise InvalidArgument(
                f"no equiv settings profile named {name!r}; registered: {sorted(cls._profiles)}."
            ) from None

    @classmethod
    def load_profile(cls, name: str) -> None:
        """Make ``name`` the profile that runs start from (over ``$EQUIV_PROFILE``)."""
        cls.get_profile(name)
        cls._current = name
        cls._environment_pending = False

    @classmethod
    def _environment(cls, strict: bool = True) -> None:
        """Load the profile ``$EQUIV_PROFILE`` names (else ``ci`` when ``$CI`` is set), once.
        A name no profile is registered under stays pending when not ``strict`` (a target
        imported later may register it), else is an InvalidArgument naming the variable."""
        if not cls._environment_pending:
            return
        name = os.environ.get("EQUIV_PROFILE") or ("ci" if os.environ.get("CI") else "")
        if name and name not in cls._profiles:
            if not strict:
                return
            raise InvalidArgument(
                f"EQUIV_PROFILE={name!r} names no equiv settings profile; registered: "
                f"{sorted(cls._profiles)}. Pick one of those, unset EQUIV_PROFILE, or register "
                f"it with equiv.settings.register_profile({name!r}, ...) in a module the run "
                "imports (a target, or conftest.py).")
        cls._environment_pending = False
        if name:
            cls._current = name

    @classmethod
    def default(cls) -> "settings":
        """The currently loaded profile, with the running pytest session's options over it."""
        cls._environment()
        base = cls._profiles[cls._current]
        return settings(base, **cls._session_overrides) if cls._session_overrides else base

    @classmethod
    def _push_session(cls, profile: str | None = None, **overrides: Any) -> tuple[str, dict]:
        """Internal (pytest plugin, equiv command): load ``profile`` and apply ``overrides``
        over it; returns the previous state for :meth:`_pop_session`."""
        cls._environment(strict=profile is None)
        previous = (cls._current, dict(cls._session_overrides))
        if profile is not None:
            cls.load_profile(profile)
        settings(cls._profiles[cls._current], **overrides)  # validate now, not at first use
        cls._session_overrides = dict(overrides)
        return previous

    @classmethod
    def _pop_session(cls, previous: tuple[str, dict]) -> None:
        cls._current, cls._session_overrides = previous[0], dict(previous[1])

    def _hypothesis_deadline(self) -> Any:
        """The Hypothesis ``deadline`` a run uses: the one set in ``hypothesis_settings`` (or in
        the loaded Hypothesis profile) when it differs from Hypothesis's built-in 200 ms default
        (which compilation alone would exceed), else None. ``timeout`` is equiv's own limit."""
        import hypothesis

        hs = self.hypothesis_settings if self.hypothesis_settings is not None else (
            hypothesis.settings.default)
        builtin = hypothesis.settings.get_profile("default").deadline
        return None if hs.deadline == builtin else hs.deadline

    @property
    def profile(self) -> str:
        return type(self)._current

    def summary(self) -> str:
        return (
            f"profile={self.profile} max_examples={self.max_examples} "
            f"modes={','.join(map(str, self.modes))} devices={','.join(self.devices)}"
        )


# -- profile defaults for execution modes ------------------------------------------------------
# default: eager and compile[aot_eager]; thorough: every mode.
DEFAULT_MODES: tuple[str, ...] = ("eager", "compile[aot_eager]")
THOROUGH_MODES = ("eager", "compile[aot_eager]", "compile[inductor]", "functionalize", "vmap",
                  "jvp")

settings._profiles["default"] = settings(modes=DEFAULT_MODES)
settings.register_profile("ci", derandomize=True)
settings.register_profile("thorough", max_examples=200, modes=THOROUGH_MODES, costly_share=1.0)


def _load_environment_profile() -> None:
    """Apply ``$EQUIV_PROFILE`` (else ``ci`` when ``$CI`` is set) now; InvalidArgument when no
    profile has that name. Runs resolve it on first use (:meth:`settings.default`)."""
    settings._environment_pending = True
    settings._environment()


# ci runs more examples, each within a generous time limit (a hanging kernel must not hang CI);
# thorough also draws float64
CI_TIMEOUT = 300.0
settings._profiles["ci"] = settings(settings._profiles["ci"], max_examples=100,
                                    timeout=CI_TIMEOUT)
# thorough asks for every mode: where torch cannot run a transform, the skip is accepted
settings._profiles["thorough"] = settings(settings._profiles["thorough"],
                                          dtypes=("float32", "float64"), allow_skip=SKIPPABLE)
