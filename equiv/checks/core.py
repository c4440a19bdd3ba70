"""The eager checks on one example: error parity, forward, mutation, aliasing, gradients,
repeated backward and output stability.

Each side gets its own alias-preserving copy of the example (``Template.instantiate``); the
compared function is (returned outputs, final values of mutated arguments); one random cotangent
is used for both sides, then a second, different one through the retained graph.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any, Callable

import torch

from equiv._compat import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten
from equiv._settings import settings as Settings
from equiv.compare import Mismatch, compare_leaf, compare_trees
from equiv.errors import InvalidArgument
from equiv.examples import Args, Side, Template
from equiv.modes import normalise_error
from equiv.report import Finding
from equiv.spec import Spec


@dataclasses.dataclass
class Outcome:
    """What one example produced: findings, or the reason it was rejected as invalid."""

    findings: list[Finding]
    invalid: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    template: Template | None = None


class ReferenceError_(InvalidArgument):
    """The reference broke its contract (it mutated its input, or its result does not fit)."""


def _format_tb(exc: BaseException) -> str:
    tb = exc.__traceback__
    # drop equiv's own frames before the user's code
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("equiv."):
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return "".join(lines[-12:])


def _call(fn: Callable[..., Any], side: Side) -> tuple[Any, BaseException | None]:
    try:
        with torch.enable_grad():
            return side.call(fn), None
    except Exception as e:  # the user's code raised: evidence, never a crash of equiv
        return None, normalise_error(e)


def _is_diff(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.dtype.is_complex)


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return [(keystr(p), v) for p, v in flat]


def _storage_key(t: torch.Tensor) -> tuple[Any, int] | None:
    st = t.untyped_storage()
    if st.nbytes() == 0:
        return None
    return (t.device, st.data_ptr())


class _Run:
    def __init__(self, spec: Spec, cfg: Settings, cot_seed: int, mode: str, device: str,
                 impl_fn: Callable[..., Any] | None = None,
                 ref_fn: Callable[..., Any] | None = None, ref_device: str | None = None,
                 ref_dtype: torch.dtype | None = None) -> None:
        self.spec, self.cfg, self.cot_seed, self.mode, self.device = spec, cfg, cot_seed, mode, device
        # how each side is executed in this mode (equiv.modes); eager: as written
        self.impl_fn = impl_fn if impl_fn is not None else spec.impl
        self.ref_fn = ref_fn if ref_fn is not None else spec.ref
        # the reference may run elsewhere (e.g. float64 on CPU); its results are then compared
        # at the implementation's dtype and device, with that dtype's tolerance
        self.ref_device, self.ref_dtype = ref_device, ref_dtype
        self.cross = ref_device is not None or ref_dtype is not None
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.template: Template | None = None

    # -- findings ---------------------------------------------------------------------------
    def finding(self, check: str, headline: str, *, argument: str | None = None,
                mismatch: Mismatch | None = None, details: str = "", tb: str | None = None,
                fix: str | None = None, likely_cause: str | None = None,
                exact: bool = False) -> None:
        if check not in self.cfg.checks:
            return
        self.findings.append(Finding(
            check=check, headline=headline, spec=self.spec.name,
            implementation=self.spec.implementation, reference=self.spec.reference,
            mode=self.mode, device=self.device,
            dtype=self.template.dtype if self.template else "-",
            argument=argument,
            details=(mismatch.message if mismatch else details),
            max_abs=mismatch.max_abs if mismatch else None,
            max_rel=mismatch.max_rel if mismatch else None,
            index=mismatch.index if mismatch else None,
            rtol=0.0 if exact else self.spec.rtol, atol=0.0 if exact else self.spec.atol,
            traceback=tb, fix=fix,
            likely_cause=likely_cause,
        ))

    # -- the example ------------------------------------------------------------------------
    def run(self, example: Args) -> Outcome:
        spec = self.spec
        template = Template(spec.signature, example, spec.mutates.keys())
        self.template = template
        ref_side = template.instantiate(device=self.ref_device or self.device,
                                        dtype=self.ref_dtype)
        ref_before, ref_versions = ref_side.snapshot(), ref_side.versions()
        ref_result, ref_exc = _call(self.ref_fn, ref_side)
        if ref_exc is None:
            self._check_reference_pure(ref_side, ref_before, ref_versions)
        impl_side = template.instantiate(device=self.device)
        impl_versions = impl_side.versions()
        impl_result, impl_exc = _call(self.impl_fn, impl_side)
        where = "" if self.mode == "eager" else f" under {self.mode}"

        if ref_exc is not None:
            if impl_exc is not None and isinstance(impl_exc, type(ref_exc)):
                return self._outcome(f"the reference raised {type(ref_exc).__name__}: "
                                     f"{str(ref_exc)[:200]}")
            got = ("returned normally" if impl_exc is None
                   else f"raised {type(impl_exc).__name__}: {str(impl_exc)[:300]}")
            self.finding(
                "error-parity",
                f"the reference raised {type(ref_exc).__name__} but the implementation{where} "
                f"{got}.",
                details=f"reference error: {type(ref_exc).__name__}: {str(ref_exc)[:300]}",
                tb=_format_tb(impl_exc) if impl_exc is not None else None,
                fix="reject this input in the implementation the way the reference does, or "
                    "restrict inputs= to inputs the reference accepts.",
            )
            return self._outcome()
        if impl_exc is not None:
            fix = None
            if "leaf Variable that requires grad" in str(impl_exc):
                fix = ("the implementation writes in place into an argument that is not declared: "
                       "declare it with mutates={'<name>': <where its final value is in the "
                       "reference's result>}, or write into a copy.")
            self.finding(
                "error-parity",
                f"the implementation{where} raised {type(impl_exc).__name__} where the "
                "reference returned normally.",
                details=f"{type(impl_exc).__name__}: {str(impl_exc)[:400]}",
                tb=_format_tb(impl_exc), fix=fix,
            )
            return self._outcome()

        expected_out, finals, consumed = self._split(ref_result)
        ref_result_raw = ref_result
        if self.cross:
            expected_out = _cast_like(expected_out, impl_result)
            finals = {a: _cast_like(f, impl_side.argument(a)) for a, f in finals.items()}
            ref_result = expected_out
        out_snapshot = _detached_clone(impl_result)
        self._check_forward(impl_result, expected_out, consumed)
        self._check_mutation(impl_side, impl_versions, finals)
        self._check_aliasing(impl_side, impl_result, ref_side, ref_result_raw)
        self._check_gradients(impl_side, impl_result, ref_side, ref_result, finals, consumed)
        from equiv.checks.function import check_functions  # custom Functions and ops (issue 6)
        check_functions(self, impl_side, impl_result, ref_side, ref_result, finals, consumed)
        self._check_stability(impl_result, out_snapshot)
        from equiv.checks.schedules import run_schedules  # schedules + memory (equiv.timeline)
        run_schedules(self)
        return self._outcome()

    def _outcome(self, invalid: str | None = None) -> Outcome:
        return Outcome(self.findings, invalid, self.notes, self.template)

    # -- reference contract -----------------------------------------------------------------
    def _check_reference_pure(self, side: Side, before: list[torch.Tensor],
                              versions: list[int]) -> None:
        assert self.template is not None
        after = side.versions()
        for j, (slot, t, b) in enumerate(zip(self.template.slots, side.tensors, before)):
            changed = compare_leaf(t.detach(), b, rtol=0, atol=0, exact=True) is not None
            if changed or after[j] != versions[j]:
                raise ReferenceError_(
                    f"the reference {self.spec.reference} modified its argument {slot.path!r} "
                    "(a reference must be pure: it returns new tensors and leaves its inputs "
                    "unchanged). Make it functional, e.g. use x.clamp(min=0) instead of "
                    "x.clamp_(min=0), and declare the implementation's writes with mutates=."
                )

    def _split(self, ref_result: Any) -> tuple[Any, dict[str, Any], bool]:
        """(expected return value, {mutated arg: final value}, whole result consumed?)."""
        finals: dict[str, Any] = {}
        locs = self.spec.mutates
        if not locs:
            return ref_result, finals, False
        if "out" in locs.values():
            (arg,) = locs
            return ref_result, {arg: ref_result}, True
        for arg, loc in locs.items():
            try:
                finals[arg] = ref_result[loc]
            except (TypeError, IndexError, KeyError):
                raise ReferenceError_(
                    f"equivalent_to(mutates={dict(locs)!r}) says the final value of {arg!r} is "
                    f"at [{loc!r}] of the reference's result, but {self.spec.reference} returned "
                    f"{type(ref_result).__name__} {_brief(ref_result)}. Return a tuple (or dict) "
                    "holding each mutated argument's final value."
                ) from None
        if isinstance(ref_result, (tuple, list)):
            consumed = set(locs.values()) == set(range(len(ref_result)))
        elif isinstance(ref_result, dict):
            consumed = set(locs.values()) == set(ref_result)
        else:
            consumed = False
        return ref_result, finals, consumed

    # -- checks -----------------------------------------------------------------------------
    def _check_forward(self, impl_out: Any, expected: Any, consumed: bool) -> None:
        if impl_out is None and consumed:
            return  # an in-place implementation returning nothing: all is in its arguments
        for m in compare_trees(impl_out, expected, rtol=self.spec.rtol, atol=self.spec.atol):
            self.finding("forward", f"{m.path} differs from the reference.", argument=m.path,
                         mismatch=m)

    def _check_mutation(self, impl_side: Side, versions_before: list[int],
                        finals: dict[str, Any]) -> None:
        template = self.template
        assert template is not None
        expected = template.instantiate(grad=False, device=self.device)
        # "must raise or match": finals an expanded argument cannot hold (the implementation
        # returned normally, so its argument must show exactly these values)
        unrepresentable: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for arg, final in finals.items():
                target = expected.argument(arg)
                t_leaves, f_leaves = tree_flatten(target)[0], tree_flatten(final)[0]
                if len(t_leaves) != len(f_leaves):
                    raise ReferenceError_(
                        f"the reference's final value for mutated argument {arg!r} has "
                        f"{len(f_leaves)} leaves but the argument has {len(t_leaves)}."
                    )
                for t, f in zip(t_leaves, f_leaves):
                    if not isinstance(t, torch.Tensor):
                        continue
                    if not isinstance(f, torch.Tensor) or f.shape != t.shape:
                        raise ReferenceError_(
                            f"the reference's final value for mutated argument {arg!r} is "
                            f"{_brief(f)}, which does not fit the argument's shape "
                            f"{tuple(t.shape)}: check mutates= and the reference's result."
                        )
                    try:
                        t.copy_(f.detach().to(t.dtype))
                    except RuntimeError:  # t overlaps itself (stride 0): compare with f itself
                        j = next(j for j, e in enumerate(expected.tensors) if e is t)
                        unrepresentable[j] = f.detach().to(t.dtype)
        after = impl_side.versions()
        for j, slot in enumerate(template.slots):
            group = template.groups[slot.group]
            actual = impl_side.tensors[j].detach()
            exp = unrepresentable.get(j, expected.tensors[j])
            if group.mutated:
                m = compare_leaf(actual, exp, rtol=self.spec.rtol, atol=self.spec.atol,
                                 path=slot.path)
                if m is not None:
                    declared = slot.path.split("[")[0] in self.spec.mutates
                    what = ("the final value of mutated argument" if declared else
                            "argument (sharing storage with a mutated argument)")
                    self.finding("mutation", f"{what} {slot.path!r} differs from the reference.",
                                 argument=slot.path, mismatch=m)
                continue
            m = compare_leaf(actual, exp, rtol=0, atol=0, path=slot.path, exact=True)
            moved = after[j] != versions_before[j]
            if m is not None:
                self.finding(
                    "mutation",
                    f"argument {slot.path!r} was modified, but the contract does not declare it "
                    "as mutated.",
                    argument=slot.path, mismatch=m, exact=True,
                    fix=f"declare the write with mutates={{{slot.path.split('[')[0]!r}: ...}}, "
                        "or write into a copy.",
                )
            elif moved:
                self.finding(
                    "mutation",
                    f"argument {slot.path!r} was written in place (version counter "
                    f"{versions_before[j]} -> {after[j]}) though its values are unchanged and "
                    "the contract does not declare it as mutated.",
                    argument=slot.path,
                    details="a write that leaves values equal (e.g. relu_ on positive inputs) "
                            "still invalidates tensors saved for backward and races with readers.",
                    fix=f"declare it with mutates={{{slot.path.split('[')[0]!r}: ...}} or avoid "
                        "the in-place op.",
                )

    def _allowed_alias_groups(self, path: str) -> set[int]:
        """Storage groups an output at ``path`` may share, by the mutates contract."""
        template = self.template
        assert template is not None
        allowed = set()
        for arg, loc in self.spec.mutates.items():
            prefix = "" if loc == "out" else f"[{loc!r}]"
            if path.startswith(prefix):
                allowed |= {s.group for s in template.slots if s.path.split("[")[0] == arg}
        return allowed

    def _check_aliasing(self, impl_side: Side, impl_out: Any, ref_side: Side,
                        ref_out: Any) -> None:
        template = self.template
        assert template is not None
        impl_groups = _group_keys(impl_side, template)
        ref_groups = _group_keys(ref_side, template)
        impl_leaves = [(p, t) for p, t in _leaves(impl_out) if isinstance(t, torch.Tensor)]
        ref_by_path = dict(_leaves(ref_out))
        for path, t in impl_leaves:
            key = _storage_key(t)
            if key is None or key not in impl_groups:
                continue
            g = impl_groups[key]
            if g in self._allowed_alias_groups(path):
                continue
            r = ref_by_path.get(path)
            if isinstance(r, torch.Tensor) and ref_groups.get(_storage_key(r)) == g:
                continue  # the reference returns a view of the same input: same contract
            names = ", ".join(sorted({template.slots[j].path for j in template.groups[g].slots}))
            self.finding(
                "aliasing",
                f"output{path} shares storage with input {names}, which the contract does not "
                "allow.",
                argument=f"output{path}",
                details="Writes through one would change the other; the reference returns a "
                        "new tensor here.",
                fix=(f"return a new tensor (e.g. .clone()), or, if the implementation writes "
                     f"{names} in place and returns it, declare mutates={{{names!r}: 'out'}}."),
            )
        # outputs aliasing each other where the reference's do not
        seen: dict[Any, str] = {}
        ref_keys = {p: _storage_key(v) for p, v in ref_by_path.items()
                    if isinstance(v, torch.Tensor)}
        for path, t in impl_leaves:
            key = _storage_key(t)
            if key is None or key in impl_groups:
                continue
            if key in seen:
                other = seen[key]
                if ref_keys.get(path) is None or ref_keys.get(path) != ref_keys.get(other):
                    self.finding(
                        "aliasing",
                        f"output{path} and output{other} share storage, but the reference's "
                        "do not.",
                        argument=f"output{path}",
                        fix="return separate tensors (e.g. .clone() one of them).",
                    )
            else:
                seen[key] = path

    def _diff_pairs(self, impl_side: Side, impl_out: Any, ref_out: Any,
                    finals: dict[str, Any], consumed: bool) -> list[tuple[str, Any, Any]]:
        pairs: list[tuple[str, Any, Any]] = []
        if not (impl_out is None and consumed):
            i_leaves, r_leaves = _leaves(impl_out), _leaves(ref_out)
            if [p for p, _ in i_leaves] == [p for p, _ in r_leaves]:
                pairs += [(f"output{p}", i, r) for (p, i), (_, r) in zip(i_leaves, r_leaves)]
        for arg, final in finals.items():
            i_leaves, r_leaves = _leaves(impl_side.argument(arg)), _leaves(final)
            if len(i_leaves) == len(r_leaves):
                pairs += [(f"final value of {arg}{p}", i, r)
                          for (p, i), (_, r) in zip(i_leaves, r_leaves)]
        out = []
        for name, i, r in pairs:
            if not (_is_diff(r) and r.requires_grad and isinstance(i, torch.Tensor)):
                continue
            if not i.requires_grad:
                self.finding(
                    "gradients",
                    f"{name} does not require grad in the implementation, but the reference's "
                    "does: the gradient flow is cut.",
                    argument=name,
                    likely_cause="a write through .data, .detach() or under torch.no_grad() "
                                 "produced this value outside autograd.",
                    fix="compute it with differentiable ops, or wrap the kernel in a "
                        "torch.autograd.Function with a backward.",
                )
                continue
            out.append((name, i, r))
        return out

    def _check_gradients(self, impl_side: Side, impl_out: Any, ref_side: Side, ref_out: Any,
                         finals: dict[str, Any], consumed: bool) -> None:
        n = len(self.findings)
        self._check_gradients_once(impl_side, impl_out, ref_side, ref_out, finals, consumed)
        if len(self.findings) > n:  # replay under the recorder: timeline + likely cause
            from equiv.timeline import explain_findings
            explain_findings(self, n)

    def _check_gradients_once(self, impl_side: Side, impl_out: Any, ref_side: Side, ref_out: Any,
                              finals: dict[str, Any], consumed: bool) -> None:
        if not {"gradients", "repeated-backward"} & set(self.cfg.checks):
            return
        template = self.template
        assert template is not None
        pairs = self._diff_pairs(impl_side, impl_out, ref_out, finals, consumed)
        groups = [g for g in template.groups
                  if impl_side.leaves[g.index] is not None and ref_side.leaves[g.index] is not None]
        if not pairs or not groups:
            return
        gen = torch.Generator().manual_seed(self.cot_seed)
        cot1 = [_cotangent(r, gen) for _, _, r in pairs]
        cot2 = [_cotangent(r, gen) for _, _, r in pairs]
        i_outs, r_outs = [i for _, i, _ in pairs], [r for _, _, r in pairs]
        i_leaves = [impl_side.leaves[g.index] for g in groups]
        r_leaves = [ref_side.leaves[g.index] for g in groups]

        ref1, err = _vjp(r_outs, r_leaves, cot1)
        if err is None and self.cross:
            ref1 = [r.to(device=i.device, dtype=i.dtype) for r, i in zip(ref1, i_leaves)]
        if err is not None:
            self.notes.append(f"reference backward raised {type(err).__name__}: "
                              f"{str(err)[:200]}; gradients not compared")
            return
        given = [c.clone() for c in cot1]
        imp1, err = _vjp(i_outs, i_leaves, given)
        if err is not None:
            self.finding("gradients", f"the implementation's backward raised "
                         f"{type(err).__name__} where the reference's did not.",
                         details=f"{type(err).__name__}: {str(err)[:400]}", tb=_format_tb(err))
            return
        self._cotangent_untouched(pairs, cot1, given, 1)
        names = [template.group_name(g) for g in groups]
        for name, a, e in zip(names, imp1, ref1):
            m = compare_leaf(a, e, rtol=self.spec.rtol, atol=self.spec.atol, path=name)
            if m is not None:
                self.finding("gradients", f"gradient w.r.t. {name!r} differs from the reference "
                             "on backward #1.", argument=name, mismatch=m)
        if self.cfg.backward_repeats < 2 or "repeated-backward" not in self.cfg.checks:
            return
        given = [c.clone() for c in cot1]
        imp1b, err = _vjp(i_outs, i_leaves, given)
        if err is not None:
            self.finding("repeated-backward", "a second backward through the retained graph "
                         f"raised {type(err).__name__} in the implementation.",
                         details=f"{type(err).__name__}: {str(err)[:400]}", tb=_format_tb(err),
                         likely_cause="backward frees or overwrites a value the graph still "
                                      "needs (retain_graph=True was given).")
            return
        self._cotangent_untouched(pairs, cot1, given, 2)
        for name, a, e in zip(names, imp1b, imp1):
            m = compare_leaf(a, e, rtol=self.spec.rtol, atol=self.spec.atol, path=name)
            if m is not None:
                self.finding("repeated-backward",
                             f"gradient w.r.t. {name!r} on backward #2 (same cotangent, retained "
                             "graph) differs from backward #1.", argument=name, mismatch=m,
                             likely_cause="backward #1 modified a value saved for backward "
                                          "(a saved tensor or a reused buffer).")
        ref2, err = _vjp(r_outs, r_leaves, cot2)
        if err is None and self.cross:
            ref2 = [r.to(device=i.device, dtype=i.dtype) for r, i in zip(ref2, i_leaves)]
        given = [c.clone() for c in cot2]
        imp2, err2 = _vjp(i_outs, i_leaves, given)
        if err is None and err2 is None:
            for name, a, e in zip(names, imp2, ref2):
                m = compare_leaf(a, e, rtol=self.spec.rtol, atol=self.spec.atol, path=name)
                if m is not None:
                    self.finding("repeated-backward",
                                 f"gradient w.r.t. {name!r} differs from the reference on "
                                 "backward #3 (a second, different cotangent through the retained "
                                 "graph).", argument=name, mismatch=m)

    def _cotangent_untouched(self, pairs: list, original: list[torch.Tensor],
                             given: list[torch.Tensor], n: int) -> None:
        for (name, _, _), o, g in zip(pairs, original, given):
            m = compare_leaf(g, o, rtol=0, atol=0, path=name, exact=True)
            if m is not None:
                check = "gradients" if n == 1 else "repeated-backward"
                self.finding(check, f"backward #{n} modified the caller's cotangent "
                             f"(grad_output) for {name} in place.", argument=name, mismatch=m,
                             exact=True,
                             fix="do not write into grad_output in backward; use out-of-place "
                                 "ops (grad_output * x, not grad_output.mul_(x)).")

    def _check_stability(self, impl_out: Any, snapshot: Any) -> None:
        if "output-stability" not in self.cfg.checks or self.template is None:
            return
        for m in compare_trees(_detached(impl_out), snapshot, rtol=0, atol=0, exact=True):
            self.finding("output-stability", f"{m.path} returned by the first call changed "
                         "during backward.", argument=m.path, mismatch=m, exact=True,
                         likely_cause="backward writes into a tensor the forward returned.")
            return
        # a second call on other values (same structure): a reused buffer would be overwritten
        second = self.template.instantiate(shuffled=True, device=self.device)
        _, exc = _call(self.impl_fn, second)
        if exc is not None:
            return  # the shuffled values may be invalid input: nothing to conclude
        for m in compare_trees(_detached(impl_out), snapshot, rtol=0, atol=0, exact=True):
            self.finding("output-stability", f"a second call to the implementation changed "
                         f"{m.path} returned by the first call.", argument=m.path, mismatch=m,
                         exact=True,
                         likely_cause="the implementation returns a reused workspace or buffer "
                                      "(e.g. a module-level cache) instead of a new tensor.",
                         fix="return a fresh tensor, or .clone() the workspace before returning.")
            return


def _cast_like(ref: Any, like: Any) -> Any:
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


def _group_keys(side: Side, template: Template) -> dict[Any, int]:
    out = {}
    for slot, t in zip(template.slots, side.tensors):
        key = _storage_key(t)
        if key is not None:
            out[key] = slot.group
    return out


def _detached(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    return tree_unflatten([x.detach() if isinstance(x, torch.Tensor) else x for x in flat], spec)


def _detached_clone(tree: Any) -> Any:
    flat, spec = tree_flatten(tree)
    with torch.no_grad():
        return tree_unflatten(
            [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat], spec)


def _cotangent(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    dtype = like.dtype if like.dtype in (torch.float32, torch.float64, torch.complex64,
                                         torch.complex128) else torch.float32
    return torch.randn(like.shape, generator=gen, dtype=dtype).to(like.dtype).to(like.device)


def _vjp(outs: list[torch.Tensor], leaves: list[torch.Tensor],
         cots: list[torch.Tensor]) -> tuple[list[torch.Tensor], BaseException | None]:
    try:
        grads = torch.autograd.grad(outs, leaves, cots, retain_graph=True, allow_unused=True)
    except Exception as e:  # the user's backward raised
        return [], e
    return [torch.zeros_like(l) if g is None else g.detach() for g, l in zip(grads, leaves)], None


def _brief(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        from equiv.examples import tensor_summary

        return tensor_summary(x)
    if isinstance(x, (tuple, list)):
        return f"of length {len(x)}"
    return repr(x)[:60]


def run_example(spec: Spec, example: Args, cot_seed: int, cfg: Settings, *, mode: str = "eager",
                device: str = "cpu", impl_fn: Callable[..., Any] | None = None,
                ref_fn: Callable[..., Any] | None = None, ref_device: str | None = None,
                ref_dtype: torch.dtype | None = None) -> Outcome:
    """Run every selected check on one example; ``impl_fn``/``ref_fn`` execute each side in
    ``mode`` (default: as written); ``ref_device``/``ref_dtype`` run the reference elsewhere."""
    return _Run(spec, cfg, cot_seed, mode, device, impl_fn, ref_fn, ref_device,
                ref_dtype).run(example)
