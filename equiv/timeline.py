"""The timeline recorder: what happened to each storage between forward and backward.

One :class:`Recorder` run records, in order:

- ``save``    a tensor saved for backward (pack hook), or stashed as a ``ctx`` attribute of a
  custom ``autograd.Function`` (invisible to pack hooks and to autograd's version check);
- ``view``    an alias created by an aten view op (``detach`` is how ``.data`` appears);
- ``write``   every aten write, with whether the version counter moved (``tracked``);
- ``read``    backward unpacking a saved value, with its version and content at save vs now;
- ``release`` a storage freed;
- ``step``    an optimizer step (announced by the schedule driver).

Storages are named ``S1, S2, ...`` and tensors by argument names, so the text is deterministic.

Each event is a plain JSON-able dict with the keys ``step`` (1, 2, ...), ``phase`` (``forward``,
``after forward``, ``backward #k``, ``step``, ``release``), ``kind``, ``storage`` (``S1``),
``tensor`` (``'x'``, ``'detach(x)'``, ``'alias of 'x''``, ``'<intermediate f32[2,3]>'``), ``op``,
``version_before``, ``version_after``, ``tracked`` (bool; for writes: did the version counters of
the saved values on that storage move), ``grad_fn`` and ``detail``; plus, by kind: save
``nbytes``, ``shape``; read ``changed``, ``saved_step`` (the step of its save); write
``arg_bumped``, ``saved_watched``, ``saved_bumped`` (steps of the saves on that storage, and of
those whose counter moved).
Recording installs ``saved_tensors_hooks``, which switches off autograd's own version check:
never decide an expected-error outcome under a recorder, only explain one.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import torch

from equiv._compat import TorchDispatchMode
from equiv.examples import dtype_short

_equal = torch.equal  # bound at import: a spec replacing torch.equal cannot change it

__all__ = ["Recorder", "render", "likely_cause"]

FIX = ("Fix: save a clone, use torch.autograd.graph.allow_mutation_on_saved_tensors(), or "
       "restructure functionally.")


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equal to itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    as_int = _INT_OF_SIZE.get(a.element_size(), torch.uint8)
    return bool(_equal(a.view(as_int), b.view(as_int)))


def _summary(t: torch.Tensor) -> str:
    return f"{dtype_short(t.dtype)}[{','.join(map(str, t.shape))}]"


def _quote(name: str) -> str:
    return name if name.startswith(("<", "alias of")) else repr(name)


def _geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), tuple(t.shape), tuple(t.stride()),
            t.storage_offset(), t.dtype)


class _Saved:
    """One value saved for backward (by a pack hook or as a ctx attribute)."""

    def __init__(self, index: int, tensor: torch.Tensor, event: dict[str, Any]) -> None:
        self.index = index
        self.alias = tensor.detach()  # shares storage and version counter, no grad_fn
        self.version = tensor._version
        with torch.no_grad():
            self.snapshot = tensor.detach().clone()
        self.event = event


class _Mode(TorchDispatchMode):
    def __init__(self, recorder: "Recorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rec = self.recorder
        if rec._busy:
            return func(*args, **kwargs)
        rec._resolve()
        schema = getattr(func, "_schema", None)
        if schema is None:
            return func(*args, **kwargs)
        written: list[torch.Tensor] = []
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                val = args[i] if i < len(args) else kwargs.get(a.name)
                vals = val if isinstance(val, (list, tuple)) else (val,)  # _foreach_*_ ops
                written += [v for v in vals if isinstance(v, torch.Tensor)]
        pending = [rec._write_begin(func, t) for t in written]
        out = func(*args, **kwargs)
        rec._pending.extend(pending)
        if (not written and any(r.alias_info is not None for r in schema.returns)
                and not (rec._phase.startswith("backward")
                         and func.overloadpacket.__name__ == "detach")):
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            outs = out if isinstance(out, (list, tuple)) else (out,)
            for o in outs:
                if first is not None and isinstance(o, torch.Tensor):
                    rec._view(func, first, o)
        return out


class Recorder:
    """Record the timeline of one schedule run. Use as a context manager::

        rec = Recorder()
        rec.name(x, "x")
        with rec:
            y = impl(x)
            rec.after_forward([y])
            rec.phase("backward #1")
            torch.autograd.grad(y, x, cot)
        print(render(rec.events))
    """

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._phase = "forward"
        self._storages: dict[Any, str] = {}
        self._finalizers: list[weakref.finalize] = []
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        # weak: the graph owns each _Saved (packed value / pre-hook), so storages can be released
        self._saved: list[weakref.ref[_Saved]] = []
        self._pending: list[tuple[dict[str, Any], Any, int, list[tuple[_Saved, int]]]] = []
        self._busy = False
        self._active = False
        self._mentioned: set[str] = set()
        self._hooks: Any = None
        self._mode: _Mode | None = None

    # -- driver API ---------------------------------------------------------------------------
    def name(self, t: Any, name: str) -> None:
        """Call tensor ``t`` by ``name`` in the timeline."""
        if isinstance(t, torch.Tensor):
            self._set_name(t, name)
            self._storage(t)
            for s in self._live_saves():  # a saved output is named once the driver knows it
                if s.event["tensor"].startswith("<") and s.event.get("_id") == id(t):
                    s.event["tensor"] = name

    def _live_saves(self) -> list[_Saved]:
        return [s for s in (r() for r in self._saved) if s is not None]

    def _set_name(self, t: torch.Tensor, name: str) -> None:
        entry = self._names.get(id(t))
        if entry is None or entry[0]() is not t:  # ids of dead tensors are reused
            self._names[id(t)] = (weakref.ref(t), name)

    def phase(self, label: str) -> None:
        """Start a new phase (``forward``, ``after forward``, ``backward #1``, ...)."""
        self._resolve()
        self._phase = label

    def step(self, label: str) -> None:
        """An optimizer step (the optimizer's own writes are recorded as writes)."""
        self._resolve()
        self._add("step", op=label)

    def after_forward(self, outputs: Iterable[Any]) -> None:
        """Find tensors stashed as ``ctx`` attributes of custom Functions reachable from
        ``outputs`` (pack hooks cannot see them) and watch their reads in backward."""
        self._resolve()
        self._busy = True
        try:
            for node in _nodes(outputs):
                self._name_node(node)
            watched: dict[int, list[_Saved]] = {}
            nodes: dict[int, Any] = {}
            for node, attr, t in ctx_tensors(outputs):
                nodes[id(node)] = node
                watched.setdefault(id(node), []).append(self._save(t, type(node).__name__,
                                                                   via=f"ctx.{attr}"))
            for key, saves in watched.items():
                nodes[key].register_prehook(self._prehook(saves))
        finally:
            self._busy = False

    def _name_node(self, node: Any) -> None:
        """Give saves made by ``node`` its name (pack hooks run before the node exists)."""
        for v in node_saved_tensors(node):
            key = _geometry(v)
            for s in self._live_saves():
                if s.event["grad_fn"] is None and _geometry(s.alias) == key:
                    s.event["grad_fn"] = type(node).__name__
                    break

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        self._active = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None and self._hooks is not None
        self._mode.__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._resolve()
        self._active = False
        for f in self._finalizers:
            f.detach()
        for e in self.events:
            e.pop("_id", None)

    # -- internals ---------------------------------------------------------------------------
    def _storage(self, t: torch.Tensor) -> str:
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr(), st.nbytes())
        name = self._storages.get(key)
        if name is None:
            name = f"S{len(self._storages) + 1}"
            while name in self._storages.values():
                name = f"S{int(name[1:]) + 1}"
            self._storages[key] = name
            if st.nbytes():
                try:
                    self._finalizers.append(weakref.finalize(st, self._release, key, name))
                except TypeError:  # storage not weak-referenceable in this torch
                    pass
        return name

    def _release(self, key: Any, name: str) -> None:
        if self._storages.get(key) == name:
            del self._storages[key]
        if self._active and name in self._mentioned:
            self._add("release", storage=name)

    def _tensor_name(self, t: torch.Tensor) -> str:
        entry = self._names.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        storage = self._storage(t)
        same = [n for ref, n in self._names.values()
                if ref() is not None and self._storage(ref()) == storage]
        if same:
            return f"alias of {same[0]!r}"
        return f"<intermediate {_summary(t)}>"

    def _add(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"step": len(self.events) + 1, "phase": self._phase, "kind": kind,
                 "storage": None, "tensor": None, "op": None, "version_before": None,
                 "version_after": None, "tracked": None, "grad_fn": None, "detail": None}
        event.update(fields)
        if kind != "release" and event["storage"]:
            self._mentioned.add(event["storage"])
        self.events.append(event)
        return event

    def _save(self, t: torch.Tensor, grad_fn: str | None, via: str | None = None) -> _Saved:
        name = self._tensor_name(t)
        event = self._add("save", storage=self._storage(t), tensor=name, grad_fn=grad_fn,
                          version_before=t._version, version_after=t._version,
                          tracked=via is None, detail=via, _id=id(t),
                          nbytes=t.untyped_storage().nbytes(), shape=list(t.shape))
        saved = _Saved(len(self._saved), t, event)
        self._saved.append(weakref.ref(saved))
        return saved

    def _pack(self, t: torch.Tensor) -> Any:
        if self._busy:
            return t
        self._resolve()
        self._busy = True
        try:
            return self._save(t, None)  # the node is named in after_forward()
        finally:
            self._busy = False

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        if not self._busy:
            self._read(packed)
        return packed.alias

    def _read(self, saved: _Saved) -> None:
        self._resolve()
        self._busy = True
        try:
            changed = not _bits_equal(saved.alias, saved.snapshot)
            detail = "content as saved"
            if changed:
                detail = "content CHANGED since save"
                if saved.snapshot.shape == saved.alias.shape and saved.snapshot.is_floating_point():
                    delta = (saved.alias.detach() - saved.snapshot).abs().max().item()
                    detail += f" (max |change| {delta:.4g})"
            self._add("read", storage=saved.event["storage"], tensor=saved.event["tensor"],
                      grad_fn=saved.event["grad_fn"], version_before=saved.version,
                      version_after=saved.alias._version, tracked=saved.event["tracked"],
                      detail=detail,
                      changed=changed, saved_step=saved.event["step"])
        finally:
            self._busy = False

    def _prehook(self, watched: list[_Saved]) -> Any:
        def hook(grad_outputs: Any) -> None:
            for s in watched:
                self._read(s)
        return hook

    def _view(self, func: Any, base: torch.Tensor, out: torch.Tensor) -> None:
        self._busy = True
        try:
            base_name = self._tensor_name(base)
            op = func.overloadpacket.__name__
            detail = ".data or .detach(): own version counter" if op == "detach" else None
            self._set_name(out, f"{op}({base_name})")
            self._add("view", storage=self._storage(out), tensor=f"{op}({base_name})",
                      op=op, detail=detail)
        finally:
            self._busy = False

    def _write_begin(self, func: Any, t: torch.Tensor) -> Any:
        self._busy = True
        try:
            storage = self._storage(t)
            event = self._add("write", storage=storage, tensor=self._tensor_name(t),
                              op=func.overloadpacket.__name__, version_before=t._version)
            watchers = [(s, s.alias._version) for s in self._live_saves()
                        if s.event["storage"] == storage]
            return (event, weakref.ref(t), t._version, watchers)
        finally:
            self._busy = False

    def _resolve(self) -> None:
        """Version bumps happen after dispatch returns: settle earlier writes now."""
        pending, self._pending = self._pending, []
        for event, ref, before, watchers in pending:
            t = ref()
            after = t._version if t is not None else before
            event["version_after"] = after
            event["arg_bumped"] = after != before
            moved = [s.alias._version != v for s, v in watchers]
            event["saved_watched"] = [s.event["step"] for s, _ in watchers]
            event["saved_bumped"] = [s.event["step"] for (s, _), m in zip(watchers, moved) if m]
            # a tensor freed before dispatch returned (an out= temporary) shows no version:
            # unknown (None), never "untracked"
            event["tracked"] = (all(moved) if moved else None if t is None
                                else after != before)


def _nodes(outputs: Iterable[Any]) -> list[Any]:
    """Autograd nodes reachable from ``outputs``, in a deterministic order."""
    seen: set[int] = set()
    order = []
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        stack.extend(n for n, _ in reversed(node.next_functions))
    return order


def node_saved_tensors(node: Any) -> list[torch.Tensor]:
    """Tensors ``node`` saved for backward (unpacking them runs any unpack hook)."""
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        try:
            values: list[Any] = list(node.saved_tensors)
        except RuntimeError:  # already freed
            values = []
    else:
        values = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    v = getattr(node, attr)
                except RuntimeError:
                    continue
                values.extend(v if isinstance(v, (list, tuple)) else (v,))
    return [v for v in values if isinstance(v, torch.Tensor)]


def saved_by(outputs: Iterable[Any]) -> dict[tuple[Any, ...], str]:
    """{tensor geometry: name of the first node that saved it} over the graph of ``outputs``."""
    out: dict[tuple[Any, ...], str] = {}
    for node in _nodes(outputs):
        for t in node_saved_tensors(node):
            out.setdefault(_geometry(t), type(node).__name__)
    return out


def ctx_tensors(outputs: Iterable[Any]) -> list[tuple[Any, str, torch.Tensor]]:
    """(node, attribute, tensor) for tensors stashed as ``ctx`` attributes of custom Functions
    (the grad_fn object of a custom Function IS its ctx), invisible to pack hooks."""
    found = []
    for node in _nodes(outputs):
        if not isinstance(node, torch.autograd.function.BackwardCFunction):
            continue
        for attr, value in sorted(vars(node).items()):
            values = value if isinstance(value, (list, tuple)) else (value,)
            for k, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    found.append((node, attr + (f"[{k}]" if value is not v else ""), v))
    return found


# -- reading a timeline -------------------------------------------------------------------------
def render(events: Sequence[dict[str, Any]], max_events: int | None = None) -> str:
    """Deterministic text, one event a line (the first ``max_events`` when given)."""
    lines = []
    shown = events if max_events is None else events[:max_events]
    for e in shown:
        kind = e["kind"]
        head = f"{e['step']:>3}  {e['phase']:<14} {kind:<8}"
        if kind == "save":
            via = (f"as {e['detail']} (no version check)" if e.get("detail")
                   else "saved for backward")
            text = (f"{e['tensor']} {e['storage']} v{e['version_before']} by {e['grad_fn']}, "
                    f"{via}; keeps {e.get('nbytes', 0):,} B of storage alive")
        elif kind == "view":
            text = f"{e['tensor']} on {e['storage']}" + (f" ({e['detail']})" if e["detail"] else "")
        elif kind == "write":
            if e["tracked"]:
                tracked = "version bumped"
            elif e["tracked"] is None:
                tracked = "version not observed: the tensor was freed at once"
            elif e.get("arg_bumped"):
                tracked = "its version bumped, a saved alias's NOT: separate counter"
            else:
                tracked = "version NOT bumped: untracked"
            text = (f"{e['op']} on {e['tensor']} {e['storage']} "
                    f"v{e['version_before']}->v{e['version_after']} ({tracked})")
        elif kind == "read":
            text = (f"{e['tensor']} {e['storage']} by {e['grad_fn']}: "
                    f"saved v{e['version_before']}, "
                    f"now v{e['version_after']}, {e['detail']}")
        elif kind == "release":
            text = f"{e['storage']} freed"
        else:
            text = str(e.get("op") or "")
        lines.append(f"{head} {text}")
    if len(shown) < len(events):
        lines.append(f"... {len(events) - len(shown)} more events (Finding.timeline has them all)")
    return "\n".join(lines)


def _saves(events: Sequence[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in events if e["kind"] == "save"}


def likely_cause(events: Sequence[dict[str, Any]]) -> str | None:
    """One sentence naming the hazard the timeline shows, or None when it shows none."""
    saves = _saves(events)
    for r in events:
        if r["kind"] != "read" or not r.get("changed"):
            continue
        save = saves[r["saved_step"]]
        writes = [w for w in events if w["kind"] == "write" and w["storage"] == save["storage"]
                  and save["step"] < w["step"] < r["step"]]
        where = (f"{save['phase']} step {save['step']}, {save['grad_fn']}, storage "
                 f"{save['storage']} v{save['version_before']}")
        what = f"saved {_quote(save['tensor'])} ({where})"
        if save.get("detail"):
            what = (f"{_quote(save['tensor'])} stashed as {save['detail']} ({where}; "
                    "a ctx attribute "
                    "is invisible to autograd's version check, use ctx.save_for_backward)")
        if not writes:
            return (f"{what} changed before backward read it at step {r['step']} by a write "
                    f"outside the dispatcher -> stale value. {FIX}")
        w = writes[-1]
        bumped = (save["step"] in w["saved_bumped"] if save["step"] in w.get("saved_watched", ())
                  else w["tracked"])
        via = f"on {_quote(w['tensor'])}"
        if w["tensor"].startswith("detach("):
            via = f"via .data ({w['tensor']})"
        if save.get("detail"):
            version = "version bumped, but nothing checks a ctx attribute"
        elif bumped:
            version = "version bumped: autograd raises here when no hooks are installed"
        elif w["tracked"] is None:
            version = "version not observed"
        elif w.get("arg_bumped"):
            version = ("version of the saved value NOT bumped: the write bumped only "
                       f"the counter of {_quote(w['tensor'])}; the saved value shares its storage "
                       "through .data/.detach() with a separate counter")
        else:
            version = "version NOT bumped: untracked write"
        return (f"{what} was overwritten by {w['op']} {via} at step {w['step']} "
                f"({w['phase']}; {version}), then read by {r['phase']} at step {r['step']} "
                f"-> stale value. {FIX}")
    for w in events:
        if (w["kind"] == "write" and w["phase"].startswith("backward")
                and "grad_output" in str(w["tensor"])):
            return (f"backward wrote into {w['tensor']} ({w['storage']}) with {w['op']} at "
                    f"step {w['step']} ({w['phase']}): grad_output belongs to the caller and may "
                    "be shared with other nodes.")
    return None
