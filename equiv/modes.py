"""Execution modes and devices: how a side is executed, and an honest account of what ran.

A *mode* wraps how the implementation (and, for attribution, the reference) is called:

- ``eager`` -- as written.
- ``compile[eager]``, ``compile[aot_eager]``, ``compile[inductor]`` -- ``torch.compile`` with that
  backend; every core check (forward, mutation, aliasing, gradients, repeated backward, output
  stability, error parity) goes through the compiled callable. ``compile[aot_eager,fullgraph]``
  demands one graph. :func:`compiled` builds a mode from any backend, a callable included.
- ``functionalize`` -- ``torch.func.functionalize(impl)`` (mutations removed and applied back);
  forward, mutation, aliasing, stability and error parity are compared (functionalize does not
  compose with autograd on mutated inputs, so gradients are not).
- ``vmap`` -- ``torch.func.vmap`` of impl against ``vmap`` of ref, batch dimension first and last.
- ``jvp`` -- forward-mode AD: ``torch.func.jvp`` of impl against ``jvp`` of ref (outputs and
  final values of mutated arguments, one random tangent).
- ``autocast[bfloat16]``, ``autocast[float16]`` -- both sides' forwards under
  ``torch.autocast(device_type, dtype)`` (the device type of the first tensor argument), their
  backwards outside it, as a training step runs them; judged by the low-precision rules of
  :mod:`equiv.numerics` (the float64 oracle is not autocast). Opt-in: not in any profile.

Honesty: compilations and graph breaks are counted per (spec, mode) by a counting backend
wrapper and Dynamo's graph-break counter; the recompile limit is raised per run and hitting it is
an exception (``fail_on_recompile_limit_hit``), so a silent fallback to eager is impossible: it
is reported as "not compiled". Dynamo is imported only when a compile mode first runs.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import dataclasses
import logging
import re
from typing import Any, Callable, Iterator

import torch

from equiv._compat import tree_flatten
from equiv.errors import InvalidArgument

__all__ = ["Mode", "compiled", "parse_mode", "MODE_NAMES"]

#: the stable mode names (reports, pytest ids, options)
MODE_NAMES: tuple[str, ...] = (
    "eager", "compile[eager]", "compile[aot_eager]", "compile[inductor]", "functionalize",
    "vmap", "jvp", "autocast[bfloat16]", "autocast[float16]",
)

_KINDS = ("eager", "compile", "functionalize", "vmap", "jvp", "autocast")
#: the low-precision dtypes an autocast mode runs in
AUTOCAST_DTYPES = ("bfloat16", "float16")

#: checks each non-compile transform can run through the core (the rest are not applicable)
_FUNCTIONALIZE_CHECKS = ("error-parity", "forward", "mutation", "aliasing", "output-stability")

DEFAULT_RECOMPILE_LIMIT = 64


@dataclasses.dataclass(frozen=True)
class Mode:
    """How a side is executed. Build compile modes with :func:`compiled`."""

    kind: str
    backend: Any = None  # a backend name or a callable ``(gm, example_inputs) -> callable``
    fullgraph: bool = False
    dynamic: bool | None = None
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT
    name: str = ""
    #: autocast modes: the low-precision dtype's name
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidArgument(f"Mode(kind={self.kind!r}): one of {list(_KINDS)}.")
        if (self.kind == "autocast") != (self.dtype in AUTOCAST_DTYPES):
            raise InvalidArgument(
                f"Mode(kind={self.kind!r}, dtype={self.dtype!r}): an autocast mode takes a dtype "
                f"from {list(AUTOCAST_DTYPES)}, the other kinds none.")
        if not self.name:
            object.__setattr__(self, "name", self._default_name())

    def _default_name(self) -> str:
        if self.kind == "autocast":
            return f"autocast[{self.dtype}]"
        if self.kind != "compile":
            return self.kind
        b = self.backend if isinstance(self.backend, str) else getattr(
            self.backend, "__name__", type(self.backend).__name__)
        opts = [b] + (["fullgraph"] if self.fullgraph else []) + (
            [f"dynamic={self.dynamic}"] if self.dynamic is not None else [])
        return f"compile[{','.join(opts)}]"

    @property
    def is_compile(self) -> bool:
        return self.kind == "compile"

    def __str__(self) -> str:
        return self.name


def compiled(backend: Any = "aot_eager", *, fullgraph: bool = False, dynamic: bool | None = None,
             recompile_limit: int = DEFAULT_RECOMPILE_LIMIT, name: str | None = None) -> Mode:
    """A ``torch.compile`` mode: ``check(f, modes=("eager", equiv.compiled("aot_eager",
    fullgraph=True)))``. ``backend`` is a backend name or a callable backend. ``recompile_limit``
    is Dynamo's per-function limit for this run; hitting it reports the mode as "not compiled"
    (never a silent eager fallback)."""
    if not (isinstance(backend, str) or callable(backend)):
        raise InvalidArgument(
            f"compiled(backend={backend!r:.60}): give a backend name ('eager', 'aot_eager', "
            "'inductor') or a callable backend (gm, example_inputs) -> callable."
        )
    if not isinstance(recompile_limit, int) or recompile_limit < 1:
        raise InvalidArgument(f"compiled(recompile_limit={recompile_limit!r}): give an int >= 1.")
    if dynamic not in (None, True, False):
        raise InvalidArgument(f"compiled(dynamic={dynamic!r}): give None, True or False.")
    return Mode("compile", backend, bool(fullgraph), dynamic, recompile_limit, name or "")


_COMPILE_RE = re.compile(r"^compile\[([A-Za-z0-9_]+)((?:,[a-z_=A-Za-z0-9]+)*)\]$")


def parse_mode(mode: "str | Mode") -> Mode:
    """A :class:`Mode` from a stable name (``"compile[aot_eager]"``,
    ``"compile[inductor,fullgraph]"``, ``"vmap"``...) or a Mode."""
    if isinstance(mode, Mode):
        return mode
    if not isinstance(mode, str):
        raise InvalidArgument(f"modes=...: give mode names or equiv.compiled(...), got {mode!r}.")
    if mode in ("eager", "functionalize", "vmap", "jvp"):
        return Mode(mode)
    if mode.startswith("autocast[") and mode.endswith("]") and mode[9:-1] in AUTOCAST_DTYPES:
        return Mode("autocast", dtype=mode[9:-1])
    m = _COMPILE_RE.match(mode)
    if m:
        opts = [o for o in m.group(2).split(",") if o]
        fullgraph, dynamic = False, None
        for o in opts:
            if o == "fullgraph":
                fullgraph = True
            elif o in ("dynamic", "dynamic=True"):
                dynamic = True
            elif o == "dynamic=False":
                dynamic = False
            else:
                raise InvalidArgument(
                    f"unknown option {o!r} in mode {mode!r}; options: fullgraph, dynamic=True, "
                    "dynamic=False.")
        return compiled(m.group(1), fullgraph=fullgraph, dynamic=dynamic, name=mode)
    raise InvalidArgument(
        f"unknown mode {mode!r}; available modes: {list(MODE_NAMES)} (options: "
        "'compile[aot_eager,fullgraph]'), or equiv.compiled(backend, ...)."
    )


def autocasting(fn: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    """``fn`` called under ``torch.autocast`` in ``dtype`` on the device type of its first
    tensor argument (CPU when it has none)."""
    def out(*args: Any, **kwargs: Any) -> Any:
        flat = tree_flatten((args, kwargs))[0]
        first = next((a for a in flat if isinstance(a, torch.Tensor)), None)
        device = first.device.type if first is not None else "cpu"
        with torch.autocast(device_type=device, dtype=dtype):
            return fn(*args, **kwargs)
    return out


# -- errors ---------------------------------------------------------------------------------
def normalise_error(exc: BaseException) -> BaseException:
    """The user-level error inside Dynamo's wrappers (``TorchRuntimeError``,
    ``BackendCompilerFailed``...), so that error parity compares like with like. ``Unsupported``
    (Dynamo cannot trace the code) is kept: it is a mode-specific error."""
    wrappers = _compile_wrappers()
    if not wrappers:
        return exc
    seen = set()
    while isinstance(exc, wrappers) and id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
        if inner is None:
            found = _builtin_error_in_message(exc)
            return found if found is not None else exc
        exc = inner
    return exc


def _compile_wrappers() -> tuple[type[BaseException], ...]:
    from equiv._compat import compile_wrapper_errors

    return compile_wrapper_errors()


def _builtin_error_in_message(exc: BaseException) -> BaseException | None:
    """``TorchRuntimeError`` carries the user's error only as text (fake-tensor propagation):
    rebuild a builtin exception of the named type, chained to the wrapper."""
    m = re.search(r"\b([A-Z][A-Za-z]*(?:Error|Exception)): (.*)", str(exc))
    if not m:
        return None
    cls = getattr(builtins, m.group(1), None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return None
    if isinstance(exc, cls):  # already that type (TorchRuntimeError is a RuntimeError)
        return exc
    new = cls(m.group(2))
    new.__cause__ = exc
    new.__traceback__ = exc.__traceback__
    return new


class NotCompiled(BaseException):
    """Internal: a compile mode stopped compiling (recompile limit). A ``BaseException`` so that
    the checks' ``except Exception`` (user errors) cannot turn it into a finding."""


# -- devices --------------------------------------------------------------------------------
def device_unavailable(device: str) -> str | None:
    """None when ``device`` can run here, else the reason it is skipped."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(
            f"devices=...: {device!r} is not a torch device ({e}); use e.g. ('cpu', 'cuda')."
        ) from None
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available here (torch.cuda.is_available() is False)"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"only {torch.cuda.device_count()} CUDA device(s) here"
        return None
    mod = getattr(torch, dev.type, None)
    if mod is not None and hasattr(mod, "is_available") and mod.is_available():
        return None
    return f"device type {dev.type!r} is not available here"


# -- one (spec, mode, device) run -------------------------------------------------------------
class ModeRun:
    """State of one mode over all examples of one spec: the compiled callables (reused across
    examples), compilation and graph-break counts, and whether it stopped compiling."""

    def __init__(self, mode: Mode, impl: Callable[..., Any], ref: Callable[..., Any]) -> None:
        self.mode = mode
        self._impl, self._ref = impl, ref
        self.compilations = {"impl": 0, "ref": 0}
        self.failed_compiles = {"impl": 0, "ref": 0}  # calls that raised while Dynamo traced
        self.graph_breaks: collections.Counter[str] = collections.Counter()
        #: why Dynamo recompiled the implementation ("frame: failed guard") -> times
        self.recompiles: collections.Counter[str] = collections.Counter()
        self.not_compiled: str | None = None
        self.unsupported: str | None = None
        self.examples = 0
        #: valid examples holding at least one value (a non-empty tensor in or out)
        self.valued = 0
        #: over the valid examples: checks that ran, that compared something, and why a check
        #: could not compare (its first reason)
        self.ran: set[str] = set()
        #: valid examples the costly checks ran on (``settings(costly_share=...)``)
        self.costly_examples = 0
        #: an example of this mode produced findings: every later one runs the costly checks
        #: (so Hypothesis's shrinking and replay of a costly check's finding reproduce it)
        self.failing = False
        self.after_failure = 0  # examples run once one had failed
        self.compared: set[str] = set()
        self.uncompared: dict[str, str] = {}
        self.ref_device: str | None = None  # where the reference runs, when not beside impl
        self.ref_dtype: torch.dtype | None = None
        self._compiled: dict[str, Callable[..., Any]] = {}

    def cover(self, ran: set[str], compared: set[str], uncompared: dict[str, str]) -> None:
        self.ran |= ran
        self.compared |= compared
        for check, why in uncompared.items():
            self.uncompared.setdefault(check, why)

    # -- the callables ----------------------------------------------------------------------
    def impl_fn(self) -> Callable[..., Any]:
        return self._fn("impl", self._impl)

    def ref_fn(self) -> Callable[..., Any]:
        """The reference executed in this mode (for attribution only)."""
        return self._fn("ref", self._ref)

    def _fn(self, side: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if side in self._compiled:
            return self._compiled[side]
        kind = self.mode.kind
        if kind == "compile":
            out = self._compile(side, fn)
        elif kind == "functionalize":
            from torch.func import functionalize

            f = functionalize(fn)

            def out(*args: Any, **kwargs: Any) -> Any:
                with torch.no_grad():
                    return f(*args, **kwargs)
        elif kind == "autocast":
            out = autocasting(fn, getattr(torch, str(self.mode.dtype)))
        else:
            out = fn
        self._compiled[side] = out
        return out

    def _compile(self, side: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        from equiv import _compat

        backend = self.mode.backend
        real = _compat.lookup_backend(backend) if isinstance(backend, str) else backend

        def counting_backend(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
            # a graph of no op (inputs straight to outputs) compiled nothing of the side
            self.compilations[side] += _compat.graph_has_ops(gm)
            return real(gm, example_inputs, **kwargs)

        counting_backend.__name__ = f"equiv_counting_{getattr(real, '__name__', 'backend')}"
        target = fn
        if _compat.compile_disabled(fn):  # torch.compile(f) would trace f's undecorated body
            def target(*args: Any, **kwargs: Any) -> Any:
                return fn(*args, **kwargs)
        compiled_fn = torch.compile(target, backend=counting_backend,
                                    fullgraph=self.mode.fullgraph, dynamic=self.mode.dynamic)
        limit_errors = _compat.recompile_limit_error()

        def call(*args: Any, **kwargs: Any) -> Any:
            before = _compat.graph_break_counter()
            last = (_compat.compile_records() or [None])[-1] if side == "impl" else None
            if self.mode.dynamic is None:  # shapes: one dynamic graph, not static then dynamic
                _compat.mark_sides_dynamic((args, kwargs))
            try:
                return compiled_fn(*args, **kwargs)
            except limit_errors as e:
                if side == "impl":
                    self._count_recompiles(last)
                failed = self.failed_compiles[side]
                self.not_compiled = (
                    f"Dynamo hit the recompile limit ({self.mode.recompile_limit}) for the "
                    f"{'implementation' if side == 'impl' else 'reference'} after "
                    f"{self.compilations[side]} compilations"
                    + (f" and {failed} failed compilation attempts (calls that raised while "
                       "Dynamo traced, e.g. on inputs the reference rejects)" if failed else "")
                    + f" and would have run it in eager from then on "
                    f"({str(e).splitlines()[0][:120]})"
                    + (f"; last recompile: {next(reversed(self.recompiles))}"
                       if side == "impl" and self.recompiles else "")
                )
                raise NotCompiled(self.not_compiled) from None
            except Exception as e:
                if isinstance(e, _dynamo_errors()):
                    self.failed_compiles[side] += 1
                raise
            finally:
                if side == "impl":
                    self._count_recompiles(last)
                    after = _compat.graph_break_counter()
                    for reason, n in after.items():
                        if n > before.get(reason, 0):
                            self.graph_breaks[_first_line(reason)] += n - before.get(reason, 0)

        return call

    def _count_recompiles(self, last: Any) -> None:
        """Count the implementation's recompilations recorded since ``last``, by reason."""
        from equiv import _compat

        for record in _compat.records_after(_compat.compile_records(), last):
            reason = _compat.recompile_reason(record)
            if reason is not None:
                self.recompiles[reason] += 1

    # -- the context every call of this mode runs in ------------------------------------------
    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        if not self.mode.is_compile:
            yield
            return
        from equiv import _compat

        _compat.dynamo().reset()  # compiled state never leaks between specs or modes
        with contextlib.ExitStack() as stack:
            # a conftest's suppress_errors=True would hide compile errors as eager fallbacks
            # (and Dynamo refuses it beside fail_on_recompile_limit_hit): off for the run
            stack.enter_context(_compat.dynamo().config.patch(suppress_errors=False))
            stack.enter_context(_compat.dynamo_config_patch(self.mode.recompile_limit))
            stack.enter_context(_compat.functorch_config_patch())
            stack.enter_context(_quiet_compile_logs())
            yield

    # -- the account -----------------------------------------------------------------------
    def status(self, failed: bool) -> str:
        if self.not_compiled is not None:
            return "not compiled"
        if self.unsupported is not None:
            return "skipped"
        if failed:
            return "FAIL"
        if self.examples == 0:
            return "skipped"
        if self.mode.is_compile and self.compilations["impl"] == 0:
            return "not compiled"
        return "passed"

    def reason(self) -> str:
        if self.not_compiled is not None:
            return self.not_compiled
        if self.unsupported is not None:
            return self.unsupported
        if self.mode.is_compile and self.examples and self.compilations["impl"] == 0:
            return ("Dynamo captured no graph of the implementation (everything ran in eager)"
                    + (f"; graph breaks: {'; '.join(self.graph_breaks)}"
                       if self.graph_breaks else ""))
        return ""

    def info(self) -> str:
        if not self.mode.is_compile:
            return ""
        n_breaks = sum(self.graph_breaks.values())
        text = (f"{self.compilations['impl']} compilation"
                f"{'s' if self.compilations['impl'] != 1 else ''} of the implementation, "
                f"{n_breaks} graph break{'s' if n_breaks != 1 else ''}")
        if self.graph_breaks:
            text += " (" + "; ".join(f"{r} x{n}" if n > 1 else r
                                     for r, n in self.graph_breaks.items()) + ")"
        n_re = sum(self.recompiles.values())
        if n_re:
            text += (f", {n_re} recompilation{'s' if n_re != 1 else ''} ("
                     + "; ".join(f"{r} x{n}" if n > 1 else r
                                 for r, n in self.recompiles.items()) + ")")
        return text


def _dynamo_errors() -> tuple[type[BaseException], ...]:
    import sys

    mod = sys.modules.get("torch._dynamo.exc")
    return (mod.TorchDynamoException,) if mod is not None and hasattr(
        mod, "TorchDynamoException") else ()


def _first_line(reason: str) -> str:
    return reason.strip().splitlines()[0][:160] if reason.strip() else "(no reason given)"


@contextlib.contextmanager
def _quiet_compile_logs() -> Iterator[None]:
    """Dynamo logs graph breaks and fake-tensor failures as warnings/errors; equiv reports them
    itself, so they are silenced for the duration of the run."""
    names = ("torch._dynamo", "torch._subclasses.fake_tensor", "torch._inductor",
             "torch._functorch")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)
