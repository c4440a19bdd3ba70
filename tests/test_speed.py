"""The speed features: costly checks on a drawn share of the examples (still shrinking and
reported), and cheap cotangents for big tensors."""

from __future__ import annotations

import hypothesis
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv._catalog import CATALOG
from equiv.checks import no_grad, output_stability, state_across_calls
from equiv.examples import Template
from equiv.execution.calls import CHEAP_COTANGENT_ABOVE, cotangent
from equiv.execution.contract_runs import (UPDATE_PATHS, calls_across_updates, judge_run,
                                           no_grad_run, shuffled_call)
from equiv.execution.record import Sink

from conftest import execution


def _cfg(**options) -> equiv.settings:
    options = {"max_examples": 40, **options}
    return equiv.settings(seed=0, modes=("eager",),
                          hypothesis_settings=hypothesis.settings(database=None), **options)


def test_the_costly_rows():
    assert {r.name for r in CATALOG if r.costly} == {
        "no-grad", "double-backward", "output-stability", "state-across-calls", "schedule"}


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, True, "half", float("nan")])
def test_costly_share_is_validated(bad):
    with pytest.raises(equiv.InvalidArgument, match=r"settings\(costly_share="):
        equiv.settings(costly_share=bad)


def _costly_count(text: str) -> tuple[int, int]:
    line = next(l for l in text.splitlines() if "costly checks" in l)
    ran, of = line.split(" ran on ")[1].split(" examples")[0].split(" of ")
    return int(ran), int(of)


@pytest.mark.parametrize("share", [0.25, 0.5])
def test_the_costly_checks_run_on_the_first_example_and_one_in_period_after(share):
    """Hypothesis draws seed 0 for its first example and the simplest extension of many
    others: the share run does not depend on the seeds it favours."""
    @equivalent_to(torch.relu)
    def relu(x):
        return torch.relu(x)

    assert equiv.settings(costly_share=share).costly_period == round(1 / share)
    ran, of = _costly_count(equiv.check(relu, settings=_cfg(max_examples=60,
                                                            costly_share=share)).render())
    period = round(1 / share)
    assert ran == -(-of // period), (ran, of)


def test_explicit_examples_run_the_costly_checks():
    """Every explicit example is checked by every check, costly ones included: a no-grad path
    wrong on five elements only shows on the middle explicit example (the first one run gets
    the costly checks anyway, the generated ones after them do not, one in ten)."""
    def doubled(x):
        return x * 3 if x.numel() == 5 and not torch.is_grad_enabled() else x * 2

    def grad_arange(n):
        return (torch.arange(n, dtype=torch.float64).requires_grad_(),)

    @equivalent_to(lambda x: x * 2, examples=[grad_arange(3), grad_arange(5),
                                                    grad_arange(4)])
    def double(x):
        return doubled(x)

    report = equiv.check(double, settings=_cfg(max_examples=3, costly_share=0.1),
                         raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "no-grad")
    assert "x=f64[5]" in f.example, f.example


class _Stale(torch.autograd.Function):
    """Saves its input by reference outside save_for_backward: a later in-place write to the
    input changes the gradient silently (only the schedules see it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.x = x
        return x * x

    @staticmethod
    def backward(ctx, g):
        return 2 * ctx.x * g


def test_a_schedule_bug_is_still_caught_and_shrunk_at_the_default_share():
    @equivalent_to(lambda x: x * x)
    def square(x):
        return _Stale.apply(x)

    report = equiv.check(square, settings=_cfg(), raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "schedule")
    assert "mutate-after-forward[x]" in f.headline
    assert "x=f32[" in f.example or "x=f64[" in f.example
    assert [r.status for r in report.runs] == ["FAIL"]  # shrunk and replayed: not flaky
    note = next(n for n in report.notes if "costly checks" in n)
    assert "on every example after the first failure" in note


def test_the_report_says_on_how_many_examples_the_costly_checks_ran():
    @equivalent_to(torch.relu, mutates={"x": "out"})
    def relu_(x):
        return x.clamp_(min=0)

    text = equiv.check(relu_, settings=_cfg()).render()
    line = next(l for l in text.splitlines() if "costly checks" in l)
    ran, of = (int(w) for w in line.split(" ran on ")[1].split(" examples")[0].split(" of "))
    assert 0 < ran < of and "schedule" in line and "settings(costly_share=0.25)" in line
    every = equiv.check(relu_, settings=_cfg(costly_share=1.0)).render()
    assert "costly checks" not in every


def test_cheap_cotangents_differ_everywhere_and_between_draws():
    like = torch.empty(CHEAP_COTANGENT_ABOVE * 3 + 7, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    first, second = cotangent(like, gen), cotangent(like, gen)
    assert first.shape == like.shape and first.dtype == like.dtype
    assert first.unique().numel() > 0.999 * like.numel()
    assert not torch.isclose(first, second).any()
    again = cotangent(like, torch.Generator().manual_seed(1))
    assert torch.equal(first, again)  # seeded: a finding replays with the same cotangent
    assert 0.8 < first.std().item() < 1.5


def test_a_backward_wrong_on_one_element_of_a_big_tensor_is_caught():
    """The cheap cotangent still reaches every element: a backward that zeroes one element's
    gradient in a 100x100 tensor fails."""
    class OneOff(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            out = g * 3
            out.view(-1)[4321] = 0.0
            return out

    @equivalent_to(lambda x: x * 3, inputs=hypothesis.strategies.tuples(
        equiv.strategies.tensors(shape=(100, 100), requires_grad=True)))
    def triple(x):
        return OneOff.apply(x)

    report = equiv.check(triple, settings=_cfg(max_examples=5), raise_on_failure=False)
    assert any(f.check == "gradients" for f in report.findings), report.render()


@hypothesis.settings(max_examples=60, database=None, deadline=None)
@hypothesis.given(hypothesis.strategies.data())
def test_the_fast_close_test_never_passes_what_assert_close_rejects(data):
    """compare_leaf's fast path for big float tensors agrees with torch.testing.assert_close
    (whether it says close or not close), explained or only judged:
    differences around the tolerance, NaN, infinities, a non-contiguous side; in torch and, from
    _NUMPY_EQUAL_MIN elements on, in NumPy."""
    from equiv._compat import _NUMPY_EQUAL_MIN
    from equiv._explain import verdict_only
    from equiv.compare import _FAST_CLOSE_MIN, _close_fast, compare_leaf

    dtype = data.draw(hypothesis.strategies.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(data.draw(hypothesis.strategies.integers(0, 99)))
    size = data.draw(hypothesis.strategies.sampled_from([_FAST_CLOSE_MIN, _NUMPY_EQUAL_MIN]))
    e = torch.randn(size, generator=gen, dtype=dtype)
    rtol, atol = (1.3e-6, 1e-5) if dtype == torch.float32 else (1e-7, 1e-7)
    scale = data.draw(hypothesis.strategies.sampled_from([0.0, 0.5, 0.99, 1.0, 1.01, 2.0]))
    a = e + scale * (atol + rtol * e.abs()) * torch.sign(torch.randn(e.shape, generator=gen,
                                                                     dtype=dtype))
    i = data.draw(hypothesis.strategies.integers(0, e.numel() - 1))
    special = data.draw(hypothesis.strategies.sampled_from([None, "nan", "inf", "-inf"]))
    if special:
        a[i] = float(special)
        if data.draw(hypothesis.strategies.booleans()):
            e[i] = float(special)
    if data.draw(hypothesis.strategies.booleans()):
        a, e = a.view(64, -1).t(), e.view(64, -1).t()
    try:
        torch.testing.assert_close(a, e, equal_nan=True, check_stride=False)
        close = True
    except AssertionError:
        close = False
    fast = _close_fast(a, e, None, None)
    assert fast is None or fast == close  # True and False decide; None leaves it to torch
    assert (compare_leaf(a, e, rtol=None, atol=None) is None) == close
    with verdict_only():  # the verdict without assert_close's message
        assert (compare_leaf(a, e, rtol=None, atol=None) is None) == close


def test_term_magnitudes_of_expanded_and_overlapping_views_match_a_scatter_of_every_term():
    """Summing along stride-0 dims before scattering gives the same ``sum |term|`` per storage
    element as scattering every view element."""
    import inspect

    from equiv.examples import Args, Template
    from equiv.execution.verdict import term_magnitude

    base = torch.randn(7, dtype=torch.float64, requires_grad=True)
    x = base[:5].expand(3, 4, 5)          # stride 0 along dims 0 and 1
    y = base.as_strided((2, 3), (1, 2), 1)  # overlapping, no stride 0
    template = Template(inspect.signature(lambda x, y: None), Args(x, y))
    group = template.groups[0]
    side = template.instantiate()
    outs = [side.tensors[0].sin() * 2, side.tensors[1].cos()]
    cots = [torch.randn(o.shape, dtype=torch.float64) for o in outs]
    got = term_magnitude(template, group, side, outs, cots)
    grads = torch.autograd.grad(outs, [side.tensors[j] for j in group.slots], cots,
                                retain_graph=True)
    want = torch.zeros(group.values.numel(), dtype=torch.float64)
    for j, g in zip(group.slots, grads):
        s = template.slots[j]
        idx = torch.arange(want.numel()).as_strided(s.size, s.stride, s.offset).reshape(-1)
        want.index_add_(0, idx, g.abs().reshape(-1))
    torch.testing.assert_close(got, want)
    assert got[:5].min() > 0 and got[5:].min() > 0


def test_the_reference_vjp_of_torch_formulas_takes_the_cotangent_values_uncopied():
    """A reference of torch's own formulas gets the cotangent's values (no copy); its gradient
    is never that tensor itself, even for an identity; a custom Function reference gets a
    copy."""
    from equiv.execution.graph import builtin_only

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for ref, builtin in ((lambda x: x.clone(), True), (lambda x: _Stale.apply(x), False)):
        @equivalent_to(ref)
        def impl(x):
            return x.clone()

        ex = execution(impl, x, seed=1)
        grads, err = ex.ref_grads(1)
        values = ex.cotangents()[0][0]
        assert err is None and ex._ref_builtin is builtin
        assert builtin_only([r for _, _, r in ex.pairing().pairs]) is builtin
        assert grads[0].data_ptr() != values.data_ptr()
        torch.testing.assert_close(grads[0], values * (2 * x.detach() if not builtin else 1))


def test_outputs_are_snapshot_only_where_the_costly_checks_run():
    @equivalent_to(torch.relu)
    def relu(x):
        return torch.relu(x)

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert execution(relu, x, costly=True).snapshotted
    ex = execution(relu, x, costly=False)
    assert not ex.snapshotted and ex.out_snapshot is None


def test_the_expected_state_copies_only_what_the_reference_wrote():
    """The mutation check's expected state: a view of the drawn values for an argument the
    reference leaves alone, a copy holding the final values for a mutated one; the drawn
    values themselves never change."""
    from equiv.execution.state import expected_state

    @equivalent_to(lambda p, g: p - g, mutates={"p": "out"})
    def sub_(p, g):
        return p.sub_(g)

    p, g = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    ex = execution(sub_, p, g)
    drawn = [grp.values.clone() for grp in ex.template.groups]
    side, _ = expected_state(ex)
    p_group, g_group = ex.template.groups
    assert side.tensors[1].data_ptr() == g_group.values.data_ptr()
    assert side.tensors[0].data_ptr() != p_group.values.data_ptr()
    torch.testing.assert_close(side.tensors[0], p - g)
    for grp, before in zip(ex.template.groups, drawn):
        assert torch.equal(grp.values, before)



def test_output_stability_and_state_across_calls_share_one_call_on_new_values():
    """The costly checks' extra calls: output-stability's second call on new values is the
    first of state-across-calls' calls, so a clean costly example calls the implementation
    1 (core) + 2 (no-grad) + 2 + one per update path (state across calls: the shared call on
    new values, a call, then a call after each way of updating the arguments) times outside
    the schedules."""
    calls = []

    @equivalent_to(lambda x: x * 2)
    def double(x):
        calls.append(1)
        return x * 2

    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ex = execution(double, x)
    sink = Sink(ex.spec, ex.cfg, "eager", "cpu")
    for module in (no_grad, output_stability, state_across_calls):
        module.run(ex, sink)
    assert not sink.findings and len(calls) == 1 + 2 + 2 + len(UPDATE_PATHS)


def test_a_side_holding_the_reversed_values_reverses_each_storage():
    """instantiate(shuffled=True) reverses each storage into new memory (a dense tensor by
    flipping its dims, in one copy): the values and strides of the reversed storage."""
    base = torch.arange(12.0, dtype=torch.float64).reshape(3, 4)
    x, y = base.t(), torch.arange(5.0, dtype=torch.float64)[1::2]  # transposed; a sliced view
    ex = execution(lambda_pair, x, y)
    side = ex.template.instantiate(shuffled=True, grad=False)
    for slot, t in zip(ex.template.slots, side.tensors):
        g = ex.template.groups[slot.group]
        want = g.values.flip(0).as_strided(slot.size, slot.stride, slot.offset)
        assert torch.equal(t, want) and t.stride() == slot.stride
        assert t.untyped_storage().data_ptr() != g.values.untyped_storage().data_ptr()
    assert side.tensors[0]._base is None  # a new tensor, not a view of a reversed copy


@equivalent_to(lambda x, y: x.sum() + y.sum())
def lambda_pair(x, y):
    return x.sum() + y.sum()


def test_judge_run_copies_only_the_mutated_arguments():
    """A contract run's target state views the drawn values of an argument nobody writes."""
    copies = []
    real = Template.instantiate

    def spy(self, **options):
        copies.append(options.get("fresh"))
        return real(self, **options)

    @equivalent_to(lambda p, g: p - g, mutates={"p": "out"})
    def sub_(p, g):
        return p.sub_(g)

    p, g = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    ex = execution(sub_, p, g)
    run = no_grad_run(ex, "inputs")
    Template.instantiate = spy
    try:
        assert judge_run(ex, run, ex.expected, ex.finals) == []
    finally:
        Template.instantiate = real
    assert copies == [{0}]


def test_a_mutated_arguments_gradient_leaf_views_the_drawn_values():
    """A mutated argument's leaf is only read (the call gets a copy of it): it views the
    drawn values instead of copying them, the call writes its own copy, and the gradient of
    the original input still reaches the leaf; the drawn values never change."""
    @equivalent_to(lambda x, w: (x * w).relu(), mutates={"x": "out"})
    def mul_relu_(x, w):
        return x.mul_(w).clamp_(min=0)

    x, w = torch.randn(2, 6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    xt = torch.randn(3, 6, dtype=torch.float64)[1:]  # a view into a larger storage (not simple)
    for arg in (x, xt):
        ex = execution(mul_relu_, arg.requires_grad_(), w.requires_grad_())
        drawn = [g.values.clone() for g in ex.template.groups]
        side = ex.template.instantiate()
        x_group, w_group = ex.template.groups
        leaf, passed = side.leaves[0], side.tensors[0]
        assert leaf.untyped_storage().data_ptr() == x_group.values.untyped_storage().data_ptr()
        assert passed.untyped_storage().data_ptr() != x_group.values.untyped_storage().data_ptr()
        assert side.leaves[1].data_ptr() != w_group.values.data_ptr()  # not mutated: a copy
        out = side.call(ex.impl_fn)
        grad, = torch.autograd.grad(out.sum(), leaf)
        assert grad.shape == leaf.shape and not torch.equal(grad, torch.zeros_like(grad))
        for g, before in zip(ex.template.groups, drawn):
            assert torch.equal(g.values, before)


def test_the_unshuffled_update_reads_views_of_the_drawn_values():
    """state-across-calls writes new values into the side's tensors: the example's own values
    are read from views (no copy), only ``.data =`` (which hands over the storage) copies."""
    fresh = []
    real = Template.instantiate

    def spy(self, **options):
        fresh.append((options.get("shuffled", False), options.get("fresh")))
        return real(self, **options)

    @equivalent_to(lambda x: x * 2, mutates={"x": "out"})
    def double_(x):
        return x.mul_(2)

    ex = execution(double_, torch.randn(4, dtype=torch.float64, requires_grad=True))
    shuffled_call(ex)
    Template.instantiate = spy
    steps = []
    try:
        for s in calls_across_updates(ex):  # judged before the next update overwrites it
            steps.append(s.how)
            assert judge_run(ex, s.run, s.expected, s.finals, shuffled=s.shuffled) == []
    finally:
        Template.instantiate = real
    assert steps == list(UPDATE_PATHS)
    assert [f for f in fresh if f[1] != {0}] == [(False, None), (True, ()), (False, ()),
                                                 (True, None)]  # less judge_run's targets


def test_an_optimizer_step_on_a_mutated_parameter_leaves_the_drawn_values_alone():
    """A schedule's SGD step writes the gradient leaves: a mutated parameter's leaf then gets
    its own storage (a view of the drawn values would write them), and the drawn values stay."""
    from equiv import Schedule
    from equiv.execution.script import Script

    @equivalent_to(lambda p, g: p * g, mutates={"p": "out"}, parameters=("p",))
    def mul_(p, g):
        return p.mul_(g)

    p = torch.randn(4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, dtype=torch.float64, requires_grad=True)
    ex = execution(mul_, p, g)
    drawn = [grp.values.clone() for grp in ex.template.groups]
    script = Script(ex)
    schedule = Schedule(("forward", "backward", "step", "forward", "backward"))
    result = script.execute(schedule, ex.impl_fn, script.cotangents(2))
    assert result.error is None and len(result.grads) == 2
    for grp, before in zip(ex.template.groups, drawn):
        assert torch.equal(grp.values, before)


def test_measuring_the_retained_bytes_keeps_no_output_alive():
    """The default memory bound's forward (``equiv.memory.retained``) frees its graph: relu
    saves its own output, and a saved-tensor hook that kept that output would make a cycle
    through C++ the garbage collector cannot free (a copy of the example leaked per run)."""
    import gc
    import weakref

    from equiv.memory import retained

    outs = []

    @equivalent_to(torch.relu)
    def relu(x):
        out = torch.relu(x)
        outs.append(weakref.ref(out))
        return out

    ex = execution(relu, torch.randn(64, dtype=torch.float64, requires_grad=True))
    stats = retained(relu, ex.side())
    assert stats is not None and stats.retained_bytes == 64 * 8  # the saved output
    gc.collect()
    assert outs[-1]() is None


def test_the_shared_call_on_new_values_is_freed_once_its_readers_ran(monkeypatch):
    """output-stability and state-across-calls share one call of the implementation on new
    values (a copy of the example); the rows after them (the schedules, the memory bound) run
    without it."""
    from equiv.checks import memory, schedule

    seen = {}
    for module in (output_stability, state_across_calls, schedule, memory):
        def spy(ex, sink, real=module.run, name=module.NAME):
            real(ex, sink)
            seen.setdefault(name, "shuffled-call" in ex.cache)
        monkeypatch.setattr(module, "run", spy)

    @equivalent_to(lambda x: x * 2)
    def double(x):
        return x * 2

    report = equiv.check(double, modes=("eager",), seed=0, max_examples=1, settings=equiv.settings(
        hypothesis_settings=hypothesis.settings(database=None)))
    assert report.ok
    assert seen == {"output-stability": True, "state-across-calls": True, "schedule": False,
                    "memory": False}


def _doubling_spec(seen: list[int]):
    import gc

    @equivalent_to(lambda x: x * 2)
    def double(x):
        seen.append(gc.get_freeze_count())
        return x * 2

    return double


def test_a_run_keeps_the_objects_alive_before_it_out_of_the_collectors_reach():
    """check() freezes the heap it starts with (``gc.freeze()``): a full collection during the
    run scans only what the run allocated (at ~2e5 objects a full collection costs ~0.1 s, as
    much as a whole check() of 40 small examples); afterwards every object is collectable
    again. A caller that froze objects itself keeps its own freeze, untouched."""
    import gc

    assert gc.get_freeze_count() == 0
    seen: list[int] = []
    cfg = equiv.settings(hypothesis_settings=hypothesis.settings(database=None))
    equiv.check(_doubling_spec(seen), modes=("eager",), seed=0, max_examples=3, settings=cfg)
    assert seen and min(seen) > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen, seen = gc.get_freeze_count(), []
        equiv.check(_doubling_spec(seen), modes=("eager",), seed=0, max_examples=3,
                    settings=cfg)
        # frozen objects that die leave the count: never more than the caller froze, never 0
        assert all(0 < c <= frozen for c in seen + [gc.get_freeze_count()])
    finally:
        gc.unfreeze()


def _equal_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    from equiv._compat import _NUMPY_EQUAL_MIN

    n = _NUMPY_EQUAL_MIN
    x = torch.randn(n)
    nan, zeros = x.clone(), torch.zeros(n)
    nan[7] = float("nan")
    one_off = x.clone()
    one_off[n - 1] += 1
    c = torch.randn(n, dtype=torch.complex64)
    t = torch.randn(64, n // 64).t()
    return [("equal", x, x.clone()), ("one element off", x, one_off),
            ("NaN against itself", nan, nan.clone()), ("0.0 against -0.0", zeros, -zeros),
            ("transposed, both", t, t.clone()), ("transposed against contiguous", t,
                                                  t.contiguous()),
            ("expanded", x[:64].expand(n // 64, 64), x[:64].expand(n // 64, 64).clone()),
            ("float64", x.double(), x.double().clone()), ("float16", x.half(), x.half()),
            ("bool", x > 0, (x > 0).clone()), ("int64", x.long(), x.long() + 1),
            ("conjugate view", c.conj(), c.conj().resolve_conj()), ("complex", c, c.clone()),
            ("bfloat16", x.bfloat16(), x.bfloat16()), ("small", x[:10], x[:10].clone()),
            ("other shape", x, x.view(2, -1)), ("requires grad", x.clone().requires_grad_(), x)]


@pytest.mark.parametrize("case", range(len(_equal_cases())))
def test_equal_answers_as_torch_equal(case):
    """equiv's equality of large CPU tensors (NumPy's vectorised ==) answers as torch.equal:
    NaN differs from itself, 0.0 equals -0.0, views, conjugate bits, dtypes NumPy lacks."""
    from equiv._compat import equal

    _, a, b = _equal_cases()[case]
    assert equal(a, b) == torch.equal(a, b)
    assert equal(b, a) == torch.equal(b, a)


def test_equal_takes_numpy_for_large_cpu_tensors_of_one_layout(monkeypatch):
    """torch.equal's CPU kernel compares one element at a time: a large pair of one layout
    never reaches it."""
    import equiv._compat as compat

    def refuse(a, b):
        raise AssertionError("torch.equal called")

    monkeypatch.setattr(compat, "_TORCH_EQUAL", refuse)
    x = torch.randn(64, compat._NUMPY_EQUAL_MIN // 64)
    assert compat.equal(x, x.clone()) and compat.equal(x.t(), x.t().clone())
    with pytest.raises(AssertionError, match="torch.equal called"):
        compat.equal(x[:1], x[:1].clone())  # small: torch's own call is as fast


def test_the_smoothness_probes_of_one_call_draw_their_cotangents_once(monkeypatch):
    """smooth_at's three probes share one draw of the fixed-seed cotangents, and a probe
    given them returns what one drawing its own does."""
    from equiv.strategies import _derived

    def ref(x, w):
        return (x * w).tanh(), x.sum()

    args = (torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64))
    planted = {0: [3], 1: [3]}
    drawn = []
    real = _derived._probe_cotangents
    monkeypatch.setattr(_derived, "_probe_cotangents", lambda r: drawn.append(1) or real(r))
    assert _derived.smooth_at(ref, args, {}, planted)
    assert len(drawn) == 1
    cots: dict = {}
    for step in (0.0, 1e-3):
        shared = _derived._probe(ref, args, {}, planted, step, cots)
        own = _derived._probe(ref, args, {}, planted, step)
        assert all(torch.equal(a, b) for a, b in zip(shared, own))


def test_the_costly_checks_run_with_the_records_gradients_released():
    """After the last check that reads them (mark-dirty), the record drops both sides' gradient
    tensors: the implementation's backwards may not run again (asking is loud), the
    reference's VJP is taken again, bitwise the same, and its error is still known."""
    from equiv.pipeline import _run_rows

    @equivalent_to(lambda x: torch.tanh(x) * 2)
    def tanh2(x):
        return torch.tanh(x) * 2

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ex = execution(tanh2, x)
    ref_before = [g.clone() for g in ex.ref_grads(1)[0]]
    sink = Sink(ex.spec, ex.cfg, "eager", "cpu")
    _run_rows(ex.cfg, ex, sink, "eager")
    assert not sink.findings and {"gradients", "schedule"} <= sink.ran
    assert all(b.grads is None for b in ex._backwards) and ex._ref_grads == {}
    with pytest.raises(RuntimeError, match="gradients were released"):
        ex.backward(1)
    assert ex.ref_grad_error(1) is None and ex._ref_grads == {}
    assert all(torch.equal(a, b) for a, b in zip(ex.ref_grads(1)[0], ref_before))
