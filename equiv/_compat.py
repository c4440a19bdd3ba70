"""Every private torch and Hypothesis import lives here, behind version guards; and the NumPy
views through which equiv compares large CPU tensors (torch's CPU comparison kernels are
slower)."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

import numpy as _np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode  # private path, stable since 1.13

from equiv.errors import InvalidArgument

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_flatten_with_path = pytree.tree_flatten_with_path
keystr = pytree.keystr
tree_map = pytree.tree_map


# -- NumPy views of large CPU tensors: equality and elementwise tests -------------------------
#: bound at import: a spec may replace ``torch.equal`` (equiv puts it back after each call)
_TORCH_EQUAL = torch.equal
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: below this many elements torch.equal's own call is as fast as the handover to NumPy
_NUMPY_EQUAL_MIN = 1 << 14
_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.complex64,
                           torch.complex128, torch.bool, torch.uint8, torch.int8, torch.int16,
                           torch.int32, torch.int64})


def numpy_view(t: torch.Tensor) -> Any:
    """A NumPy array viewing ``t``'s elements (no copy) where elementwise tests are cheaper in
    NumPy: a plain strided CPU tensor of at least ``_NUMPY_EQUAL_MIN`` elements of a dtype
    NumPy has, without a conjugate or negative bit; else None. On CPU torch's comparison and
    reduction kernels cost several times NumPy's (one thread, a million float32 elements:
    ``torch.equal`` ~1.5 ms against ~0.2 ms, ``!=`` ~1.5 against ~0.13 ms, a bool ``any``
    ~1.1 against ~0.03 ms)."""
    if (t.numel() < _NUMPY_EQUAL_MIN or t.device.type != "cpu" or t.dtype not in _NUMPY_DTYPES
            or type(t) not in _PLAIN or t.layout != torch.strided or t.is_conj() or t.is_neg()):
        return None
    try:
        return t.detach().numpy()
    except (RuntimeError, TypeError):  # no data NumPy can read (a wrapper tensor)
        return None


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)``; two large CPU tensors of one dtype, shape and strides compared
    by NumPy's vectorised ``==`` (:func:`numpy_view`), which answers the same (IEEE
    equality: NaN differs from itself, ``0.0`` equals ``-0.0``)."""
    if (a.numel() >= _NUMPY_EQUAL_MIN and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride()):
        x = numpy_view(a)
        y = None if x is None else numpy_view(b)
        if y is not None:
            return bool(_np.array_equal(x, y))
    return _TORCH_EQUAL(a, b)


# -- custom Functions and torch.library custom ops (equiv.checks.function) -------------------
def decompositions() -> dict[Any, Any]:
    """torch's table of aten decompositions (op overload -> Python function), or {}."""
    try:
        from torch._decomp import decomposition_table
    except ImportError:  # pragma: no cover - torch without the decomposition table
        return {}
    return decomposition_table


def custom_function_node_type() -> type:
    """The base class of the autograd nodes of Python ``autograd.Function``s (and of custom ops
    with ``register_autograd``, which torch implements with a generated Function)."""
    from torch.autograd.function import BackwardCFunction

    return BackwardCFunction


def op_types() -> tuple[type, type]:
    """``(OpOverload, OpOverloadPacket)``: what ``torch.ops.ns.op[.overload]`` evaluates to."""
    from torch._ops import OpOverload, OpOverloadPacket

    return OpOverload, OpOverloadPacket


def custom_op_overload(obj: Any) -> Any:
    """The ``OpOverload`` behind a ``torch.library.custom_op`` object, an ``OpOverload`` or an
    ``OpOverloadPacket`` with a ``default`` overload; ``None`` for anything else."""
    overload_t, packet_t = op_types()
    if isinstance(obj, overload_t):
        return obj
    if isinstance(obj, packet_t):
        return getattr(obj, "default", None)
    try:
        from torch._library.custom_ops import CustomOpDef
    except ImportError:  # pragma: no cover - torch without torch.library.custom_op
        return None
    if isinstance(obj, CustomOpDef):
        return obj._opoverload
    return None


def op_schema(overload: Any) -> Any:
    return overload._schema


# -- saved-tensor hooks (equiv.execution.calls restores the stack around user code) ----------
def _top_hooks() -> Any:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # pragma: no cover - torch without the accessor: nothing to compare
        return None
    try:
        return top(False)
    except TypeError:  # pragma: no cover - older signature without ignore_is_tracing
        return top()


def saved_tensors_hooks_top() -> Any:
    """The innermost ``saved_tensors_hooks`` pair in effect (None when there is none)."""
    return _top_hooks()


def restore_saved_tensors_hooks(top: Any) -> None:
    """Pop the ``saved_tensors_hooks`` pushed (entered, never exited) since ``top`` was read;
    when ``top`` is no longer on the stack (code exited a context it had not entered), the
    stack is left as it was found."""
    def same(a: Any, b: Any) -> bool:
        return (a is None) == (b is None) and (a is None or (a[0] is b[0] and a[1] is b[1]))

    popped = []
    autograd = torch._C._autograd
    while not same(now := _top_hooks(), top) and now is not None and len(popped) < 10_000:
        popped.append(now)
        autograd._pop_saved_tensors_default_hooks()
    if not same(_top_hooks(), top):  # not found: put back what was popped
        for pack, unpack in reversed(popped):
            autograd._push_saved_tensors_default_hooks(pack, unpack)


# -- torch.compile internals (imported lazily: ``import equiv`` must not load Dynamo) -----------
def dynamo() -> Any:
    """``torch._dynamo``, imported on first use by a compile mode."""
    import torch._dynamo

    return torch._dynamo


def lookup_backend(name: str) -> Any:
    d = dynamo()
    try:
        return d.lookup_backend(name)
    except d.exc.InvalidBackend:
        raise InvalidArgument(
            f"compile[{name}]: {name!r} is not a torch.compile backend; available here: "
            f"{sorted(d.list_backends())} (or pass a callable: equiv.compiled(my_backend))."
        ) from None


def mark_sides_dynamic(values: Any) -> None:
    """``maybe_mark_dynamic`` every side >= 2 of the tensors in ``values`` (a pytree): the first
    compilation is then the dynamic-shape graph automatic dynamic shapes compile on the second
    shape (sides 0 and 1 stay specialised; a side the program specialises raises nothing)."""
    d = dynamo()
    for t in pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor):
            for dim, side in enumerate(t.shape):
                if side >= 2:
                    d.maybe_mark_dynamic(t, dim)


def compile_disabled(fn: Any) -> bool:
    """Whether ``fn`` is decorated with ``torch.compiler.disable`` (``torch.compile`` of it
    directly would trace the undecorated function underneath)."""
    return bool(getattr(fn, "_torchdynamo_disable", False))


def graph_has_ops(gm: Any) -> bool:
    """Whether an FX graph a backend receives runs anything (not only inputs to outputs)."""
    graph = getattr(gm, "graph", None)
    if graph is None:
        return True
    return any(n.op in ("call_function", "call_method", "call_module") for n in graph.nodes)


def graph_break_counter() -> dict[str, int]:
    """Dynamo's running count of graph breaks by reason (not cleared by ``reset``)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def compile_records() -> list[Any]:
    """Dynamo's records of the frames it compiled in this process, oldest first (a bounded
    queue, not cleared by ``reset``; ``torch._dynamo.utils.get_compilation_metrics``), or []
    where this torch keeps none."""
    from torch._dynamo import utils

    get = getattr(utils, "get_compilation_metrics", None)
    return list(get()) if get is not None else []


def records_after(records: list[Any], last: Any) -> list[Any]:
    """The records of ``records`` newer than ``last`` (an earlier last record, or None)."""
    if last is None:
        return records
    for i in range(len(records) - 1, -1, -1):
        if records[i] is last:
            return records[i + 1:]
    return records  # the queue moved past ``last``: all of it is new


_RESUME_RE = re.compile(r"^torch_dynamo_resume_in_(\w+)_at_(\d+)$")


def recompile_reason(record: Any) -> str | None:
    """``"frame: first failed guard"`` for a record of a recompilation (Dynamo's guard failure
    reason, as ``TORCH_LOGS=recompiles`` prints it), None for a first compilation."""
    reason = getattr(record, "recompile_reason", None)
    if not reason:
        return None
    line = reason.strip().splitlines()[0]
    line = re.sub(r"^\d+/\d+: ", "", line).split("  #")[0]  # the cache entry's id, the comment
    line = " ".join(line.split())[:160]
    name = str(getattr(record, "co_name", "") or "?")
    m = _RESUME_RE.match(name)
    frame = f"{m.group(1)} after its graph break at line {m.group(2)}" if m else name
    return f"{frame}: {line}"


def dynamo_config_patch(recompile_limit: int) -> Any:
    """Raise the recompile limit and make hitting it an exception instead of a silent eager
    fallback (``fail_on_recompile_limit_hit`` exists from torch 2.6; older versions fall back
    to the warning only, and the runner detects the fallback by counting compilations)."""
    config = dynamo().config
    changes: dict[str, Any] = {}
    if hasattr(config, "recompile_limit"):
        changes["recompile_limit"] = recompile_limit
    else:  # torch < 2.6
        changes["cache_size_limit"] = recompile_limit
    if hasattr(config, "accumulated_recompile_limit"):
        changes["accumulated_recompile_limit"] = max(256, 4 * recompile_limit)
    elif hasattr(config, "accumulated_cache_size_limit"):
        changes["accumulated_cache_size_limit"] = max(256, 4 * recompile_limit)
    if hasattr(config, "fail_on_recompile_limit_hit"):
        changes["fail_on_recompile_limit_hit"] = True
    return config.patch(**changes)


def functorch_config_patch() -> Any:
    """Switch off donated buffers so that ``retain_graph=True`` through a compiled backward is
    tested rather than refused (``torch._functorch.config.donated_buffer``, torch >= 2.6)."""
    import contextlib

    import torch._functorch.config as fconfig

    if hasattr(fconfig, "donated_buffer"):
        return fconfig.patch(donated_buffer=False)
    return contextlib.nullcontext()


def recompile_limit_error() -> tuple[type[BaseException], ...]:
    exc = getattr(dynamo().exc, "FailOnRecompileLimitHit", None)
    return (exc,) if exc is not None else ()


def compile_wrapper_errors() -> tuple[type[BaseException], ...]:
    """Dynamo exceptions that wrap a user-level error (unwrapped for error parity)."""
    import sys

    mod = sys.modules.get("torch._dynamo.exc")
    if mod is None:  # Dynamo never ran: nothing can be wrapped
        return ()
    names = ("TorchRuntimeError", "BackendCompilerFailed", "InternalTorchDynamoError")
    return tuple(getattr(mod, n) for n in names if hasattr(mod, n))


try:  # private helper of torch.testing since 1.12
    from torch.testing._comparison import default_tolerances as _default_tolerances
except ImportError:  # moved: callers take assert_close's own path
    _default_tolerances = None


def default_tolerances(dtype: torch.dtype) -> tuple[float, float] | None:
    """``torch.testing.assert_close``'s default (rtol, atol) for ``dtype``, or None where this
    torch does not expose them."""
    if _default_tolerances is None:
        return None
    try:
        rtol, atol = _default_tolerances(dtype)
    except Exception:  # its signature changed: the caller takes assert_close's own path
        return None
    return rtol, atol


# -- selection by name (equiv check -k, equiv list -k) --------------------------------------
def keyword_matcher(expression: str) -> Any:
    """A predicate over spec names with pytest's ``-k`` semantics: ``and``/``or``/``not``,
    parentheses, each identifier a case-insensitive substring of the name. Uses pytest's own
    parser (``_pytest.mark.expression``, private, stable since pytest 6). Raises ``ValueError``
    with the parser's message for a malformed expression."""
    from _pytest.mark.expression import Expression

    try:
        compiled = Expression.compile(expression)
    except SyntaxError as e:
        raise ValueError(f"not a valid -k expression ({e.msg}, at column {e.offset})") from None

    def matches(name: str) -> bool:
        def matcher(sub: str, /, **kwargs: Any) -> bool:
            if kwargs:
                raise ValueError("-k expressions over spec names take no call parameters")
            return sub.lower() in name.lower()

        return compiled.evaluate(matcher)

    return matches


# -- Hypothesis: constants drawn from source code ----------------------------------------------
@contextlib.contextmanager
def no_source_constants() -> Iterator[None]:
    """Within the block, Hypothesis draws no constants found in the source of local modules.

    Hypothesis sometimes draws an integer or float that appears as a literal in a local module
    (any imported module outside site-packages and the standard library, test files aside).
    That pool grows whenever the process imports another such module, so the examples one seed
    draws would depend on what the process imported before the run. equiv's strategies draw
    shapes from tables and values from seeds, so the pool adds only that dependence. Where this
    Hypothesis has no such pool (or names it differently), the block changes nothing."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:
        yield
        return
    pool = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)  # (type, constraints) -> constants
    if pool is None or not hasattr(getattr(cache, "cache", None), "clear"):
        yield
        return
    empty = Constants()
    cache.cache.clear()  # its entries hold constants of the pool before the block
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = pool
        cache.cache.clear()
