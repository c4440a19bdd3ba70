"""Calling user code and the tensor plumbing every run shares: results never raise the user's
errors (they come back as values), leaves of result trees, cotangents and VJPs."""

from __future__ import annotations

import contextlib
import gc
import inspect
import os
import sys
import traceback
import warnings
from typing import Any, Callable, Iterator

import torch

from equiv._compat import (keystr, restore_saved_tensors_hooks, saved_tensors_hooks_top,
                           tree_flatten, tree_flatten_with_path, tree_unflatten)
from equiv.errors import InvalidArgument, user_error
from equiv.examples import Side, tensor_summary
from equiv.modes import normalise_error
from equiv.strategies._tensors import tiled_normal


def format_tb(exc: BaseException) -> str:
    """The user's part of a traceback (equiv's own frames dropped), at most 12 lines."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("equiv."):
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return "".join(lines[-12:])


#: torch functions a spec may replace (``torch.equal = ...``): put back after each call, so the
#: user code of later specs sees what it saw before (equiv's comparisons bind them at import)
_TORCH_FUNCTIONS = ((torch, "equal"), (torch, "allclose"), (torch, "isclose"),
                    (torch.testing, "assert_close"))


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:  # the folder was removed: nothing to return to
        return None


def _process_state() -> dict[str, Any]:
    """Interpreter state user code may leave changed: warnings filters and ``showwarning``,
    the recursion limit, the working directory, entered ``saved_tensors_hooks``."""
    return {"filters": (warnings.filters, list(warnings.filters), warnings.showwarning),
            "recursion": sys.getrecursionlimit(), "cwd": _cwd(),
            "hooks": saved_tensors_hooks_top(),
            "torch": tuple(getattr(m, n) for m, n in _TORCH_FUNCTIONS)}


def _restore_process(saved: dict[str, Any]) -> None:
    filters, copy, show = saved["filters"]
    if warnings.filters is not filters or warnings.filters != copy:
        filters[:] = copy
        warnings.filters = filters
        warnings._filters_mutated()  # type: ignore[attr-defined]
    if warnings.showwarning is not show:
        warnings.showwarning = show
    if sys.getrecursionlimit() != saved["recursion"]:
        sys.setrecursionlimit(saved["recursion"])
    if saved["cwd"] is not None and _cwd() != saved["cwd"]:
        os.chdir(saved["cwd"])
    restore_saved_tensors_hooks(saved["hooks"])
    for (module, name), original in zip(_TORCH_FUNCTIONS, saved["torch"]):
        if getattr(module, name) is not original:
            setattr(module, name, original)


_CPU = torch.device("cpu")


def _default_device() -> torch.device:
    """``torch.get_default_device()``, without its cost (~20 us, twice per user call) in the
    common case: no torch function mode entered and no default device set means CPU."""
    if (torch._C._len_torch_function_stack() == 0
            and getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None) is None):
        return _CPU
    return torch.get_default_device()


def _global_state(config: bool) -> dict[str, Any]:
    state: dict[str, Any] = {
        "process": _process_state(),
        "dtype": torch.get_default_dtype(),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "threads": torch.get_num_threads(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "grad": torch.is_grad_enabled(),
        "device": _default_device(),
    }
    dynamo = sys.modules.get("torch._dynamo.config") if config else None
    if dynamo is not None:
        state["dynamo"] = dynamo.get_config_copy()  # ~0.2 ms: once per example, not per call
    return state


def _restore(saved: dict[str, Any]) -> None:
    _restore_process(saved["process"])
    if torch.get_default_dtype() != saved["dtype"]:
        torch.set_default_dtype(saved["dtype"])
    det, warn_only = saved["deterministic"]
    if (torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled()) != (det, warn_only):
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
    if torch.get_num_threads() != saved["threads"]:
        torch.set_num_threads(saved["threads"])
    if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != saved["anomaly"]:
        torch.set_anomaly_enabled(*saved["anomaly"])
    torch.set_grad_enabled(saved["grad"])
    if _default_device() != saved["device"]:
        torch.set_default_device(saved["device"])
    config = sys.modules.get("torch._dynamo.config")
    if config is not None and "dynamo" in saved:
        now = config.get_config_copy()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated options warn when set
            for key, value in saved["dynamo"].items():
                if now.get(key, value) != value:
                    setattr(config, key, value)


@contextlib.contextmanager
def quiet_anomaly() -> Iterator[None]:
    """While equiv runs both sides: autograd's anomaly-mode warnings ("Error detected in
    ...Backward. Traceback of forward call...", printed when a user turned anomaly mode on and
    a backward raises) stay off stderr: they show equiv's own frames, and the finding carries
    the user's traceback."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Error detected in .*Traceback of forward",
                                category=UserWarning)
        yield


@contextlib.contextmanager
def isolated(config: bool = False) -> Iterator[None]:
    """Global torch state the user's code may set (default dtype and device, deterministic
    algorithms, thread count, anomaly mode, grad mode; with ``config``, the Dynamo config too)
    and interpreter state (warnings filters, recursion limit, working directory, entered
    ``saved_tensors_hooks``, replaced ``torch.equal``-like functions) is restored after the
    block, so one spec never changes how the next one runs. Every call
    of user code restores the cheap state; the runner restores the config around each example
    and each check()."""
    saved = _global_state(config)
    try:
        yield
    finally:
        _restore(saved)


#: the process that started the running check (None outside a check)
_RUN_PID: list[int | None] = [None]


@contextlib.contextmanager
def owned_process() -> Iterator[None]:
    """Within the block, a process forked by user code (``os.fork()`` in an implementation)
    exits quietly as soon as the user's call returns in it: only the process that started the
    run goes on to compare, print and write reports."""
    previous = _RUN_PID[0]
    _RUN_PID[0] = os.getpid() if previous is None else previous
    try:
        yield
    finally:
        _RUN_PID[0] = previous


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block, the objects alive when it starts (the caller's modules, torch's and
    Hypothesis's) are out of the garbage collector's reach (``gc.freeze()``): a full collection
    during the run scans only what the run allocated, not every object of the process (~0.1 s
    per full collection at ~2e5 objects). After the block they are collectable again. A caller
    that froze objects itself keeps its freeze as it was."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def exit_if_forked() -> None:
    """End this process quietly (``os._exit(0)``, no buffered output flushed) when it is a
    child forked by user code during a run."""
    if _RUN_PID[0] is not None and os.getpid() != _RUN_PID[0]:
        os._exit(0)


def call(fn: Callable[..., Any], side: Side) -> tuple[Any, BaseException | None]:
    """``fn`` on ``side``'s arguments under ``enable_grad``: (result, None) or (None, error);
    global torch state is restored afterwards (:func:`isolated`)."""
    try:
        with isolated(), torch.enable_grad():
            result = side.call(fn)
    except BaseException as e:  # the user's code raised: evidence, never a crash of equiv
        exit_if_forked()
        if not user_error(e):
            raise
        return None, normalise_error(e)
    exit_if_forked()
    return synchronous(fn, result), None


def synchronous(fn: Any, result: Any) -> Any:
    """``result``, unless calling ``fn`` gave a coroutine or generator (an ``async def`` or a
    generator function): that is a usage error, not a value to compare."""
    if inspect.isawaitable(result) or inspect.isgenerator(result) or inspect.isasyncgen(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()
        kind = "a generator" if inspect.isgenerator(result) else (
            "an async generator" if inspect.isasyncgen(result) else "a coroutine (async)")
        raise InvalidArgument(
            f"{getattr(fn, '__qualname__', type(fn).__name__)} returned {kind} instead of its "
            "result: equiv calls implementations and references synchronously. Wrap it in a "
            "plain function that returns the value, e.g. lambda x: asyncio.run(f(x)) or "
            "tuple(f(x)).")
    return result


def is_diff(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def leaves(tree: Any) -> list[tuple[str, Any]]:
    """(path, leaf) pairs of a result tree; ``None`` counts as a leaf."""
    flat, _ = tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [(keystr(p), v) for p, v in flat]


def storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (t.device, st.data_ptr())


def detached(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in flat], spec)


def detached_clone(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    with torch.no_grad():
        return tree_unflatten(
            [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat], spec)


def clone_tree(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([x.clone() if isinstance(x, torch.Tensor) else x for x in flat], spec)


#: above this many elements a cotangent is built cheaply
#: (:func:`equiv.strategies._tensors.tiled_normal`: ``randn`` of 1e6 elements costs several
#: clones)
CHEAP_COTANGENT_ABOVE = 4096


def cotangent(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random cotangent (or tangent) shaped like ``like``, drawn from ``gen``."""
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64, torch.complex64,
                                         torch.complex128) else torch.float32
    if like.numel() > CHEAP_COTANGENT_ABOVE and not dtype.is_complex:
        return tiled_normal(tuple(like.shape), gen, dtype, like.device).to(like.dtype)
    return torch.randn(like.shape, generator=gen, dtype=dtype).to(like.dtype).to(like.device)


def vjp(outs: list[torch.Tensor], leaves_: list[torch.Tensor],
        cots: list[torch.Tensor]) -> tuple[list[torch.Tensor], BaseException | None]:
    """Gradients of ``outs`` w.r.t. ``leaves_`` for ``cots`` (graph retained; unused -> zeros)."""
    try:
        with isolated():
            grads = torch.autograd.grad(outs, leaves_, cots, retain_graph=True,
                                        allow_unused=True)
        exit_if_forked()
    except BaseException as e:  # the user's backward raised
        exit_if_forked()
        if not user_error(e):
            raise
        return [], e
    return [torch.zeros_like(l) if g is None else g.detach() for g, l in zip(grads, leaves_)], None


def cast_like(ref: Any, like: Any) -> Any:
    """``ref``'s floating tensors converted to the dtype and device of the matching leaf of
    ``like`` (differentiably); unchanged where the structures differ."""
    r_flat, r_spec = tree_flatten(ref)
    l_flat, l_spec = tree_flatten(like)
    if r_spec != l_spec:
        return ref
    out = []
    for r, l in zip(r_flat, l_flat):
        if (isinstance(r, torch.Tensor) and isinstance(l, torch.Tensor)
                and r.dtype.is_floating_point and l.dtype.is_floating_point):
            r = r.to(device=l.device, dtype=l.dtype)
        out.append(r)
    return tree_unflatten(out, r_spec)


def brief(x: Any) -> str:
    """A one-line summary of a value for messages (``f32[2,3] cpu``, ``of length 2``)."""
    if isinstance(x, torch.Tensor):
        return tensor_summary(x)
    if isinstance(x, (tuple, list)):
        return f"of length {len(x)}"
    return repr(x)[:60]


def defined(outs: list[torch.Tensor], cots: list[torch.Tensor | None],
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The differentiated values with a defined cotangent, and those cotangents: an undefined
    one is left out of the VJP, so autograd hands that output's backward ``None`` (or zeros,
    where the graph materializes them) exactly as for an unused output."""
    kept = [(o, c) for o, c in zip(outs, cots) if c is not None]
    return [o for o, _ in kept], [c for _, c in kept]

