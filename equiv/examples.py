"""Alias- and stride-preserving copies of one example for each side, and its printing.

An *example* is one drawn argument tuple. Its tensors are grouped by the storage they live in;
each side gets fresh storages with the same groups, so the same tensor passed in two slots stays
one tensor in two slots and views of one base stay views of one cloned base with identical sizes,
strides and storage offsets. The user's tensors are only read.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable, Iterable, Sequence

import torch

from equiv import _values
from equiv._args import Args, as_args
from equiv._compat import (keystr, numpy_view, tree_flatten, tree_flatten_with_path, tree_map,
                           tree_unflatten)

__all__ = ["Args", "Side", "Template", "as_args", "tensor_summary"]

_IMMUTABLE = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device,
              torch.layout, torch.memory_format)


@dataclasses.dataclass
class Slot:
    """One tensor leaf of the example."""

    path: str  # 'x', 'params[0]'
    group: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    same_as: int | None = None  # an earlier slot holding the very same tensor object


@dataclasses.dataclass
class Group:
    """Tensors of the example that live in one storage."""

    index: int
    values: torch.Tensor  # flat, detached copy of the whole storage
    slots: list[int]
    requires_grad: bool
    simple: bool  # one tensor that is exactly its whole storage: passed as a leaf of its shape
    mutated: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype


_COMPLEX_OF = {torch.float64: torch.complex128, torch.float32: torch.complex64}


def _storage_values(t: torch.Tensor) -> torch.Tensor:
    n = t.untyped_storage().nbytes() // t.element_size()
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    flat.set_(t.untyped_storage(), 0, (n,), (1,))
    return flat.detach().clone()


def _is_simple(t: torch.Tensor) -> bool:
    n = t.untyped_storage().nbytes() // max(t.element_size(), 1)
    return (
        t.storage_offset() == 0
        and t.numel() == n
        and _non_overlapping_and_dense(tuple(t.shape), tuple(t.stride()))
    )


def _non_overlapping_and_dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """True when some permutation of the dims is contiguous (no gaps, no overlap)."""
    dims = sorted((st, sz) for sz, st in zip(size, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


class Template:
    """The structure of one example: argument names, storage groups, non-tensor values."""

    def __init__(self, signature: inspect.Signature, example: Args, mutated: Iterable[str] = ()):
        try:
            bound = signature.bind(*example.args, **example.kwargs)
        except TypeError as e:
            raise TypeError(f"the example does not fit the implementation's signature: {e}") from e
        self.signature = signature
        self.names: list[str] = list(bound.arguments)
        values = [bound.arguments[n] for n in self.names]
        flat, self._spec = tree_flatten_with_path(values, is_leaf=lambda x: x is None)
        self._leaves: list[Any] = []
        self.slots: list[Slot] = []
        self.groups: list[Group] = []
        self._slot_of_leaf: dict[int, int] = {}
        keys: dict[Any, int] = {}
        objects: dict[int, int] = {}
        mutated = set(mutated)
        with torch.no_grad():
            for i, (path, leaf) in enumerate(flat):
                name = self.names[path[0].idx] + keystr(path[1:])
                if isinstance(leaf, torch.Tensor):
                    if leaf.layout != torch.strided:
                        raise TypeError(
                            f"argument {name!r} has layout {leaf.layout}; equiv supports strided "
                            "tensors only."
                        )
                    st = leaf.untyped_storage()
                    key = (leaf.device, st.data_ptr(), leaf.dtype) if st.nbytes() else ("empty", i)
                    if key not in keys:
                        keys[key] = len(self.groups)
                        self.groups.append(Group(len(self.groups), _storage_values(leaf), [], False,
                                                 False))
                    g = self.groups[keys[key]]
                    slot = Slot(name, g.index, tuple(leaf.shape), tuple(leaf.stride()),
                                leaf.storage_offset(), leaf.dtype, leaf.device,
                                bool(leaf.requires_grad))
                    slot.same_as = objects.setdefault(id(leaf), len(self.slots))
                    if slot.same_as == len(self.slots):
                        slot.same_as = None
                    self._slot_of_leaf[i] = len(self.slots)
                    g.slots.append(len(self.slots))
                    g.requires_grad |= slot.requires_grad
                    g.mutated |= name.split("[")[0] in mutated
                    self.slots.append(slot)
                    self._leaves.append(None)
                else:
                    self._leaves.append(leaf)
        for g in self.groups:
            first = flat_leaf(flat, self, g.slots[0])
            one_object = all(self.slots[j].same_as == g.slots[0] for j in g.slots[1:])
            g.simple = one_object and _is_simple(first)
            if not (g.dtype.is_floating_point or g.dtype.is_complex):
                g.requires_grad = False

    # -- building sides -------------------------------------------------------------------
    def instantiate(self, *, grad: bool = True, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None, shuffled: bool = False,
                    fresh: Iterable[int] | None = None, leaves_written: bool = False) -> "Side":
        """Fresh tensors with this example's structure (leaves for gradients when ``grad``).

        ``shuffled`` reverses each storage's values: same structure and value set, other values.
        ``dtype`` converts the floating-point storages (a float64 reference, for instance), and
        complex ones to the complex dtype of that precision (complex128 for float64).
        ``fresh``: the indices of the groups that get new storage; the others are read-only
        views of the example's stored values (nothing may write to them), which costs no copy.
        A mutated group's gradient leaf is such a view whenever its values are the stored ones:
        the call is handed a copy of it (``Side.tensors``), and nothing writes to the leaf;
        ``leaves_written``: the caller writes the leaves (an optimizer step), each gets its own
        storage.
        """
        leaves: list[torch.Tensor | None] = []
        group_args: list[torch.Tensor] = []
        copied = None if fresh is None else set(fresh)
        for g in self.groups:
            values = self._converted(g, device, dtype)
            rg = grad and g.requires_grad
            view = copied is not None and g.index not in copied and not rg
            if g.simple:
                s = self.slots[g.slots[0]]
                # clone() and flip() keep the strides of a non-overlapping dense tensor and
                # return a new tensor (no view), version 0; reversing the whole storage of such
                # a tensor is flipping every dim
                leaf = values.as_strided(s.size, s.stride, 0)
                if shuffled:
                    leaf = leaf.flip(tuple(range(leaf.dim()))).requires_grad_(rg)
                elif rg and g.mutated and not leaves_written:  # the call gets ``work``, a copy
                    leaf = leaf.detach().requires_grad_()
                else:
                    leaf = leaf if view else leaf.clone().requires_grad_(rg)
                work = leaf.clone() if (rg and g.mutated) else leaf
            else:
                if shuffled:
                    values = values.flip(0)
                # a converted or reversed storage is already new: no second copy
                owned = values is not g.values
                if rg and g.mutated and not owned and not leaves_written:  # as above
                    leaf = values.detach().requires_grad_()
                else:
                    leaf = values if view else (values if owned else values.clone()
                                                ).requires_grad_(rg)
                work = leaf.clone() if (rg and g.mutated) else leaf
            leaves.append(leaf if rg else None)
            group_args.append(work)
        out: list[Any] = []
        made: dict[int, torch.Tensor] = {}
        for i, leaf in enumerate(self._leaves):
            if i in self._slot_of_leaf:
                j = self._slot_of_leaf[i]
                s = self.slots[j]
                g = self.groups[s.group]
                work = group_args[s.group]
                if s.same_as is not None:
                    made[j] = made[s.same_as]
                else:
                    made[j] = work if g.simple else work.as_strided(s.size, s.stride, s.offset)
                out.append(made[j])
            elif isinstance(leaf, _IMMUTABLE):
                out.append(leaf)
            else:
                out.append(copy.deepcopy(leaf))
        values = tree_unflatten(out, self._spec)
        arguments = dict(zip(self.names, values))
        bound = inspect.BoundArguments(self.signature, arguments)  # type: ignore[arg-type]
        tensors = [out[i] for i in sorted(self._slot_of_leaf)]
        return Side(bound, leaves, tensors, self)

    @staticmethod
    def _converted(g: Group, device: Any, dtype: torch.dtype | None) -> torch.Tensor:
        """``g``'s stored values on ``device`` in ``dtype`` (floating and complex storages
        only; complex to the complex dtype of that precision); the stored tensor itself when
        nothing changes."""
        values = g.values if device is None else g.values.to(device)
        if dtype is not None and values.dtype.is_floating_point:
            values = values.to(dtype)
        elif dtype is not None and values.dtype.is_complex and dtype in _COMPLEX_OF:
            values = values.to(_COMPLEX_OF[dtype])
        return values

    # -- after a call ---------------------------------------------------------------------
    def gaps(self, g: Group, device: torch.device | None = None) -> torch.Tensor | None:
        """A bool mask over ``g``'s storage, true where no argument's view reaches (the
        elements between and around views into a larger storage); None when there are none
        (always for a simple group)."""
        if g.simple:
            return None
        mask = torch.ones(g.values.numel(), dtype=torch.bool,
                          device=g.values.device if device is None else device)
        for j in g.slots:
            s = self.slots[j]
            if 0 in s.size:
                continue
            # a stride-0 dim repeats its first slice: that slice covers the same elements
            size = tuple(1 if st == 0 else d for d, st in zip(s.size, s.stride))
            mask.as_strided(size, s.stride, s.offset).fill_(False)
        flags = numpy_view(mask)  # NumPy's any costs a fraction of torch's on CPU
        return mask if bool(mask.any() if flags is None else flags.any()) else None

    def changed_arguments(self, side: "Side",
                          exempt: Iterable[str] = ()) -> list[tuple[str, str, str]]:
        """``(name, before, after)`` for each argument of ``side`` whose structure (containers,
        dict keys, which tensor sits where) or non-tensor values differ from the example's, as
        a call that writes into them leaves them; arguments in ``exempt`` are skipped."""
        marks = [_Mark(self._slot_of_leaf[i], tensor_summary(self.slots[self._slot_of_leaf[i]]))
                 if i in self._slot_of_leaf else leaf for i, leaf in enumerate(self._leaves)]
        expected = tree_unflatten(marks, self._spec)
        skip = set(exempt)
        out = []
        for name, want in zip(self.names, expected):
            if name in skip:
                continue
            have = side.bound.arguments[name]
            if not self._same_argument(want, have, side):
                out.append((name, _shown(want), _shown(_summarised(have))))
        return out

    def _same_argument(self, want: Any, have: Any, side: "Side") -> bool:
        """``have`` (one argument of ``side``) still has the structure and non-tensor values of
        ``want`` (its template value, tensors marked by :class:`_Mark`), and the same tensors."""
        def flat(x: Any) -> tuple[list[Any], Any]:
            return tree_flatten(x, is_leaf=lambda v: v is None)
        w_leaves, w_spec = flat(want)
        h_leaves, h_spec = flat(have)
        if w_spec != h_spec:
            return False
        for w, h in zip(w_leaves, h_leaves):
            if isinstance(w, _Mark):
                if h is not side.tensors[w.slot]:  # another value where the example's tensor was
                    return False
            elif not _same_value(w, h):
                return False
        return True

    # -- printing -------------------------------------------------------------------------
    def describe(self, name: str) -> str:
        """``relu_(x=f32[2,3] cpu grad, y=<same tensor as x>)``: dtype, shape, device, grad, and
        the layout (transposed, expanded, strides, storage offset) and alias topology (same
        tensor, view of, overlaps, disjoint view of one storage) of every tensor argument."""
        parts = []
        seen_exact: dict[tuple, str] = {}
        group_first: dict[int, Slot] = {}
        for i, leaf in enumerate(self._leaves):
            if i in self._slot_of_leaf:
                s = self.slots[self._slot_of_leaf[i]]
                key = (s.group, s.size, s.stride, s.offset)
                if key in seen_exact:
                    parts.append(f"{s.path}=<same tensor as {seen_exact[key]}>")
                    continue
                seen_exact[key] = s.path
                text = f"{s.path}={tensor_summary(s)}"
                g = self.groups[s.group]
                layout = _layout_words(s, g)
                first = group_first.setdefault(s.group, s)
                if first is not s:
                    layout = [_relation(s, first, g)] + layout
                if s.requires_grad and g.requires_grad and (g.mutated or not g.simple):
                    # what the implementation receives: a view or copy of a fresh leaf
                    layout.append("non-leaf")
                if layout:
                    text += " (" + ", ".join(layout) + ")"
                parts.append(text)
        nontensors = self._nontensor_arguments()
        parts.extend(f"{k}={v!r}" for k, v in nontensors)
        return f"{name}({', '.join(parts)})"

    def _nontensor_arguments(self) -> list[tuple[str, Any]]:
        out = []
        tensor_args = {self.slots[j].path.split("[")[0] for j in range(len(self.slots))}
        values = tree_unflatten(list(self._leaves), self._spec)
        for n, v in zip(self.names, values):
            if n not in tensor_args:
                out.append((n, v))
        return out

    def code(self, call: str, imports: Sequence[str] = (), check: bool = False,
             stash: _values.Stash | None = None) -> str:
        """Runnable Python that rebuilds the example's structure and values and calls ``call``
        (after the ``imports`` lines that bring it in); with ``check``, runs every eager check
        on it instead (``equiv.assert_equivalent``, which raises the finding's failure).

        A storage over ``EXACT_INLINE`` elements is loaded from a ``.pt`` file that the code
        names: it is added to ``stash`` (the caller writes it), or written now without one.
        """
        own = stash is None
        stash = _values.Stash() if stash is None else stash
        lines = ["import torch", *(["import equiv"] if check else []), *imports]
        direct = {g.index for g in self.groups if g.simple and
                  self.slots[g.slots[0]].stride == _contiguous_strides(self.slots[g.slots[0]].size)}
        for g in self.groups:
            vals = g.values.detach().cpu()
            if g.index in direct:
                vals = vals.reshape(self.slots[g.slots[0]].size)
            rg = ", requires_grad=True" if g.requires_grad else ""
            dev = "" if g.values.device.type == "cpu" else f", device={str(g.values.device)!r}"
            target = (_identifier(self.slots[g.slots[0]].path) if g.index in direct
                      else f"storage{g.index}")
            nonleaf = bool(rg) and g.mutated  # the implementation writes into it: not a leaf
            if nonleaf:
                lines.append(f"# {target} is written in place: pass a non-leaf copy of a leaf")
                final_target, target = target, f"{target}_leaf"
            if vals.numel() == 0:  # torch.tensor([]) would lose the shape
                lines.append(
                    f"{target} = torch.empty({tuple(vals.shape)}, dtype={g.dtype}{dev}{rg})")
            elif vals.numel() <= _values.LITERAL_MAX:
                data = _values.literal(repr(vals.tolist()))
                lines.append(f"{target} = torch.tensor({data}, dtype={g.dtype}{dev}{rg})")
            else:
                if vals.numel() <= EXACT_INLINE and "import base64" not in lines:
                    lines.insert(1, "import base64")
                elif vals.numel() > EXACT_INLINE:
                    lines.append(f"# {target}'s {vals.numel()} values: saved with torch.save")
                lines.append(f"{target} = {stash.expression(vals)}{_placed(dev, rg)}")
            if nonleaf:
                lines.append(f"{final_target} = {target}.clone()")
        if own:
            _values.write(stash.files)
        call_args = []
        for i, leaf in enumerate(self._leaves):
            if i in self._slot_of_leaf:
                s = self.slots[self._slot_of_leaf[i]]
                if s.group in direct or s.same_as is not None:
                    continue
                var = _identifier(s.path)
                lines.append(
                    f"{var} = storage{s.group}.as_strided({s.size}, {s.stride}, {s.offset})"
                )
        values = tree_unflatten(
            [(_Raw(self._variable(self._slot_of_leaf[i]))
              if i in self._slot_of_leaf else leaf) for i, leaf in enumerate(self._leaves)],
            self._spec,
        )
        params = self.signature.parameters
        for n, v in zip(self.names, values):
            kind = params[n].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                call_args.extend(repr(x) for x in v)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                call_args.extend(f"{k}={x!r}" for k, x in v.items())
            elif kind is inspect.Parameter.KEYWORD_ONLY:
                call_args.append(f"{n}={v!r}")
            else:
                call_args.append(repr(v))
        if check:
            lines.append(f"equiv.assert_equivalent({', '.join([call, *call_args])})")
        else:
            lines.append(f"{call}({', '.join(call_args)})")
        return "\n".join(lines)

    def _variable(self, j: int) -> str:
        s = self.slots[j]
        return _identifier(self.slots[s.same_as].path if s.same_as is not None else s.path)

    def group_name(self, g: Group) -> str:
        paths = [self.slots[j].path for j in g.slots]
        unique = list(dict.fromkeys(paths))
        if g.simple or len(unique) == 1 and len(g.slots) == 1:
            return unique[0]
        return "storage shared by " + ", ".join(unique) if len(unique) > 1 else f"storage of {unique[0]}"

    @property
    def dtype(self) -> str:
        dtypes = list(dict.fromkeys(str(s.dtype) for s in self.slots))
        return ", ".join(dtypes) if dtypes else "-"


class _Raw:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _Mark(_Raw):
    """Where slot ``slot``'s tensor sits in an argument (printed as its summary)."""

    def __init__(self, slot: int, text: str) -> None:
        super().__init__(text)
        self.slot = slot


def _same_value(a: Any, b: Any) -> bool:
    """``b`` equals the example's non-tensor value ``a``: the same object, both NaN, or equal
    by an ``__eq__`` of their own; a value equiv cannot compare (no ``__eq__`` but identity,
    an ``__eq__`` that raises or answers no bool) counts as the same."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and a != a and b != b:
        return True
    if type(a).__eq__ is object.__eq__:
        return True
    try:
        same = a == b
    except Exception:  # the user's __eq__: never a crash of equiv
        return True
    return same if isinstance(same, bool) else True


def _summarised(value: Any) -> Any:
    """``value`` with each tensor in it replaced by its summary (``f32[2,3] cpu``)."""
    leaves, spec = tree_flatten(value, is_leaf=lambda v: v is None)
    return tree_unflatten([_Raw(tensor_summary(v)) if isinstance(v, torch.Tensor) else v
                           for v in leaves], spec)


def _shown(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (a user's ``__repr__`` that raises: "?")."""
    try:
        text = repr(value)
    except Exception:
        return "<unprintable>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


#: storages up to this many elements over 64 are printed as their exact bytes (base64)
EXACT_INLINE = _values.EXACT_INLINE


def _placed(dev: str, rg: str) -> str:
    """The method calls that move a rebuilt tensor to ``dev`` and make it require grad."""
    out = f".to({dev[2:].split('=', 1)[1]})" if dev else ""
    return out + (".requires_grad_()" if rg else "")


def _elements(s: Slot) -> set[int]:
    """Storage positions a slot reads (exact up to 2**16 elements, else its address range)."""
    n = 1
    for d in s.size:
        n *= d
    if n == 0:
        return set()
    if n > 2**16:
        span = sum((d - 1) * st for d, st in zip(s.size, s.stride))
        return set(range(s.offset, s.offset + span + 1))
    idx = torch.zeros(s.size, dtype=torch.int64)
    pos = torch.full((), s.offset, dtype=torch.int64)
    for dim, (d, st) in enumerate(zip(s.size, s.stride)):
        shape = [1] * len(s.size)
        shape[dim] = d
        idx = idx + (torch.arange(d) * st).reshape(shape)
    return set((idx + pos).reshape(-1).tolist())


def _relation(s: Slot, first: Slot, g: "Group") -> str:
    """How slot ``s`` shares storage with ``first``, the group's first slot."""
    mine, theirs = _elements(s), _elements(first)
    whole = set(range(g.values.numel()))
    if theirs == whole and mine <= theirs:
        return f"view of {first.path}"
    if mine & theirs:
        return f"overlaps {first.path} ({len(mine & theirs)} shared elements)"
    return f"disjoint view of {first.path}'s storage"


def _identifier(path: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in path).strip("_")
    return out or "arg"


def flat_leaf(flat: list, template: Template, slot_index: int) -> torch.Tensor:
    for i, (_, leaf) in enumerate(flat):
        if template._slot_of_leaf.get(i) == slot_index:
            return leaf
    raise LookupError(slot_index)


_DTYPE_SHORT = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64",
    torch.complex64: "c64", torch.complex128: "c128", torch.int8: "i8", torch.int16: "i16",
    torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "bool",
}


def dtype_short(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def tensor_summary(s: Slot | torch.Tensor) -> str:
    """``f32[2,3] cpu grad``: dtype, shape, device, requires_grad."""
    if isinstance(s, torch.Tensor):
        size, dtype, device, rg = tuple(s.shape), s.dtype, s.device, s.requires_grad
    else:
        size, dtype, device, rg = s.size, s.dtype, s.device, s.requires_grad
    text = f"{dtype_short(dtype)}[{','.join(map(str, size))}] {device.type}"
    return text + (" grad" if rg else "")


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(size):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _layout_words(s: Slot, g: Group) -> list[str]:
    words = []
    big = [(d, st) for d, st in zip(s.size, s.stride) if d > 1]
    if any(st == 0 for _, st in big):
        words.append(f"expanded, strides {s.stride}")
    elif s.stride != _contiguous_strides(s.size) and big:
        dense = _non_overlapping_and_dense(s.size, s.stride)
        if dense and len(big) >= 2:
            order = sorted(range(len(s.size)), key=lambda i: -s.stride[i])
            kind = ("transposed" if len(big) == 2 and [d for d, _ in big] and
                    big[0][1] < big[1][1] else "permuted")
            words.append(f"{kind}, strides {s.stride}" if kind == "transposed" else
                         f"permuted (memory order of dims {tuple(order)}), strides {s.stride}")
        else:
            words.append(f"strides {s.stride}")
    if s.offset:
        words.append(f"storage offset {s.offset}")
    if not g.simple and len(g.slots) == 1:
        words.append(f"in a storage of {g.values.numel()} elements")
    return words


class Side:
    """One side's copy of an example: bound arguments, gradient leaves, tensor slots."""

    def __init__(self, bound: inspect.BoundArguments, leaves: list[torch.Tensor | None],
                 tensors: list[torch.Tensor], template: Template) -> None:
        self.bound = bound
        self.leaves = leaves  # one per storage group; None where no gradient is taken
        self.tensors = tensors  # one per slot
        self.template = template

    def call(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.bound.args, **self.bound.kwargs)

    def argument(self, name: str) -> Any:
        return self.bound.arguments[name]

    def versions(self) -> list[int]:
        return [t._version for t in self.tensors]

    def storage(self, g: Group) -> torch.Tensor:
        """This side's whole storage of group ``g``, flat and detached (a view, no copy)."""
        return self.tensors[g.slots[0]].detach().as_strided((g.values.numel(),), (1,), 0)

    def detached(self) -> "Side":
        """This side's arguments again as detached aliases (the same memory, no gradient
        history; one tensor passed twice stays one tensor), for reruns that only read them: no
        copy. Non-tensor values are shared as they are."""
        memo: dict[int, torch.Tensor] = {}

        def alias(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) not in memo:
                memo[id(v)] = v.detach()
            return memo[id(v)]

        arguments = {k: tree_map(alias, v, is_leaf=lambda x: x is None)
                     for k, v in self.bound.arguments.items()}
        bound = inspect.BoundArguments(self.bound.signature, arguments)  # type: ignore[arg-type]
        return Side(bound, [None] * len(self.leaves), [alias(t) for t in self.tensors],
                    self.template)

    def snapshot(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [t.detach().clone() for t in self.tensors]
