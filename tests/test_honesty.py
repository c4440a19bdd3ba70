"""Honest verdicts: equiv never passes what it did not check, and never crashes on what users
write. One test per numbered case of the verdicts table (docs/reference.md "Verdicts"): the
repro, then the honest outcome asserted by content, and the reverse twin where one exists.
Tests marked xfail(strict) state the outcome the execution core must produce."""

from __future__ import annotations

import datetime
import functools
import io
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import hypothesis
import hypothesis.strategies as st
import pytest
import torch

import equiv
import equiv.pytest
from equiv import equivalent_to
from equiv.cli import main
from equiv.strategies import tensors
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["--modes", "eager", "--max-examples", "4", "--seed", "7"]
CUDA = torch.cuda.is_available()

pytest_plugins = ["pytester"]


def engine(what: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=f"needs the engine: {what}")


@pytest.fixture(autouse=True)
def _default_profile(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EQUIV_PROFILE", raising=False)
    previous = equiv.settings._push_session("default")
    yield
    equiv.settings._pop_session(previous)


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def rows(out: str) -> dict[str, list[list[str]]]:
    """The summary table as {spec: [[mode, device, verdict, examples, findings], ...]}."""
    table: dict[str, list[list[str]]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("  ") if c.strip()]
        if len(cells) == 6 and cells[0] != "spec" and not set(cells[0]) <= {"-"}:
            table.setdefault(cells[0], []).append(cells[1:])
    return table


def write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return str(path)


def ref1(x):
    return x * 2


# -- 1. name collisions -------------------------------------------------------------------------
FACTORY = '''
    import torch
    from equiv import equivalent_to

    def ref(x):
        return x * 2

    def make(factor):
        @equivalent_to(ref)
        def impl(x):
            return x * factor
        return impl

    good = make(2)
    bad = make(3)           # same qualname: make.<locals>.impl
    lam_good = equivalent_to(ref)(lambda x: x + x)
    lam_bad = equivalent_to(ref)(lambda x: x * 5)
'''


def test_factory_specs_and_lambdas_with_one_qualname_all_run(tmp_path):
    path = write(tmp_path, "collide_factory.py", FACTORY)
    code, out, _ = run("check", path, *QUICK)
    table = rows(out)
    assert code == 1
    assert [r[2] for r in table["collide_factory.make.<locals>.impl"]] == ["pass"]
    assert [r[2] for r in table["collide_factory.make.<locals>.impl#2"]] == ["FAIL"]
    assert [r[2] for r in table["collide_factory.<lambda>"]] == ["pass"]
    assert [r[2] for r in table["collide_factory.<lambda>#2"]] == ["FAIL"]
    assert "2 pass, 2 FAIL" in out
    _, listed, _ = run("list", path)
    assert listed.count("  reference: collide_factory.ref") == 4
    module = sys.modules["collide_factory"]
    names = [s.name for s in equiv.pytest.tests_for(module).specs]
    assert names == ["collide_factory.make.<locals>.impl", "collide_factory.make.<locals>.impl#2",
                     "collide_factory.<lambda>", "collide_factory.<lambda>#2"]


def test_a_single_spec_keeps_its_plain_name_and_redecorating_replaces():
    def impl(x):
        return x * 2

    equivalent_to(ref1)(impl)
    equivalent_to(ref1)(impl)  # the same function again: one spec, no #2
    names = [n for n in equiv.registry() if n.endswith("redecorating_replaces.<locals>.impl")
             or "#" in n]
    assert names == [impl.__equiv_spec__.name] and "#" not in names[0]


def test_a_duplicate_explicit_name_is_invalid_naming_both():
    @equivalent_to(ref1, name="double")
    def first(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument) as info:
        @equivalent_to(ref1, name="double")
        def second(x):
            return x + x
    text = str(info.value)
    assert "name='double'" in text and "first" in text and "second" in text


def test_a_module_imported_again_replaces_its_specs(tmp_path):
    path = write(tmp_path, "reimported_kernels.py", FACTORY)
    from equiv._loader import load_target

    first = [s.name for s in load_target(path)]
    del sys.modules["reimported_kernels"]
    again = [s.name for s in load_target(path)]
    assert first == again and len(again) == 4
    assert sum(n.startswith("reimported_kernels.") for n in equiv.registry()) == 4


# -- 2. SystemExit ------------------------------------------------------------------------------
def test_system_exit_at_import_is_exit_2_naming_the_module(tmp_path):
    path = write(tmp_path, "exits_on_import.py", "import sys\nsys.exit(0)\n")
    code, out, err = run("check", path, *QUICK)
    assert code == 2 and out == ""
    assert err.startswith(f"equiv: could not import {path}:\n")
    assert "SystemExit: 0" in err


def test_system_exit_from_an_implementation_fails_that_spec_only(tmp_path):
    path = write(tmp_path, "exits_in_kernel.py", '''
        import sys
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        @equivalent_to(ref)
        def quits(x):
            sys.exit(0)

        @equivalent_to(ref)
        def fine(x):
            return x + x
    ''')
    code, out, _ = run("check", path, *QUICK)
    table = rows(out)
    # user code raising SystemExit inside a check is an error-parity finding (the reference
    # returned), not an exit of equiv and not a usage error: FAIL, exit 1
    assert code == 1
    assert table["exits_in_kernel.quits"][0][2] == "FAIL"
    assert table["exits_in_kernel.fine"][0][2] == "pass"
    assert "ErrorMismatch" in out and "SystemExit" in out
    assert "1 pass, 1 FAIL" in out


def test_system_exit_from_an_implementation_is_an_error_parity_finding():
    @equivalent_to(ref1)
    def quits(x):
        raise SystemExit(3)

    with pytest.raises(equiv.ErrorMismatch) as info:
        equiv.check(quits, settings=FAST, modes=("eager",))
    f = info.value.report.findings[0]
    assert f.check == "error-parity" and "SystemExit" in f.headline


# -- 3. empty or inapplicable selections ------------------------------------------------------
@pytest.mark.parametrize("options, argument", [
    ({"checks": ()}, "checks="), ({"modes": ()}, "modes="),
    ({"checks": ("memory",)}, "memory"), ({"checks": ("opcheck",)}, "opcheck")])
def test_empty_or_inapplicable_selections_do_not_pass(options, argument):
    @equivalent_to(ref1)
    def double(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match="nothing") as info:
        equiv.check(double, settings=FAST, **options)
    assert argument in str(info.value)


def test_a_selection_that_applies_still_passes_and_catches():
    @equivalent_to(ref1)
    def double(x):
        return x * 2

    @equivalent_to(ref1)
    def triple(x):
        return x * 3

    assert equiv.check(double, settings=FAST, modes=("eager",), checks=("forward",)).ok
    with pytest.raises(equiv.OutputMismatch):
        equiv.check(triple, settings=FAST, modes=("eager",), checks=("forward",))


# -- 4. not compiled / skipped modes are not a pass in check() ------------------------------
@torch.compiler.disable
def _eager_double(x):
    return x * 2


def test_check_does_not_pass_a_compile_mode_that_compiled_nothing():
    # torch 2.13 compiles a function that is itself @torch.compiler.disable'd when it is
    # torch.compile'd directly; a disabled call inside captures no graph
    @equivalent_to(ref1)
    def double(x):
        return _eager_double(x)

    report = equiv.check(double, settings=equiv.settings(FAST, max_examples=3),
                         modes=("compile[aot_eager]",), raise_on_failure=False)
    assert not report.ok
    assert "not compiled" in report.render()
    assert [f.check for f in report.findings] == ["not-compiled"]
    assert "@torch.compiler.disable" in report.findings[0].fix
    with pytest.raises(equiv.EquivalenceFailure, match="was not compiled"):
        equiv.check(double, settings=equiv.settings(FAST, max_examples=3),
                    modes=("compile[aot_eager]",))


def test_a_mode_whose_graph_broke_at_every_op_names_the_break_as_the_fix():
    """fake_quantize has no fake-tensor kernel: Dynamo breaks the graph there and captures
    nothing. Not a pass; the fix names the break, not a compiler.disable that is not there."""
    @equivalent_to(lambda x: torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127))
    def fake_quantize(x):
        return torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127)

    report = equiv.check(fake_quantize, settings=equiv.settings(FAST, max_examples=3),
                         modes=("compile[aot_eager]",), raise_on_failure=False)
    (f,) = report.findings
    assert f.check == "not-compiled", report.render()
    assert "compiler.disable" not in f.fix, f.fix
    assert "every graph broke (Operator does not support running with fake tensors)" in f.fix


# -- 5. devices -------------------------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="needs a machine without CUDA")
def test_cli_with_only_unavailable_devices_is_exit_2_like_check(tmp_path):
    path = write(tmp_path, "devices_good.py", '''
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        @equivalent_to(ref)
        def double(x):
            return x + x
    ''')
    code, out, _ = run("check", path, "--modes", "eager", "--devices", "cuda")
    assert code == 2
    assert rows(out)["devices_good.double"][0][2] == "ERROR"
    assert "every requested device was skipped (device 'cuda' is not available here" in out
    with pytest.raises(equiv.InvalidArgument, match="every requested device was skipped"):
        equiv.check(sys.modules["devices_good"].double, devices=("cuda",))
    # the twin: one available device ran, the other is a visible skip, exit 0
    code, out, _ = run("check", path, *QUICK, "--devices", "cpu,cuda")
    assert code == 0
    assert [r[2] for r in rows(out)["devices_good.double"]] == ["pass", "skipped"]


# -- 6. mutates naming a non-tensor parameter ---------------------------------------------------
def test_mutates_naming_a_float_annotated_parameter_is_invalid():
    def ref(x, alpha: float):
        return x * alpha

    with pytest.raises(equiv.InvalidArgument) as info:
        @equivalent_to(ref, mutates={"alpha": "out"})
        def scale(x, alpha: float):
            return x * alpha
    assert "'alpha', annotated float" in str(info.value)


def test_mutates_naming_a_tensor_parameter_is_accepted():
    def ref(x: torch.Tensor, alpha: float):
        return x * alpha

    @equivalent_to(ref, mutates={"x": "out"})
    def scale_(x: torch.Tensor, alpha: float):
        return x.mul_(alpha)

    assert scale_.__equiv_spec__.mutates == {"x": "out"}


def test_mutates_naming_an_unannotated_non_tensor_is_invalid_at_run_time():
    def ref(x, alpha):
        return x * alpha, alpha

    @equivalent_to(ref, mutates={"alpha": 1},
                   inputs=st.tuples(tensors(shape=(3,)), st.floats(1, 2)))
    def scale(x, alpha):
        return x * alpha

    with pytest.raises(equiv.InvalidArgument, match="'alpha'.*not a tensor"):
        equiv.check(scale, settings=FAST, modes=("eager",))


# -- 7. gradients that could not be compared --------------------------------------------------
class _Times123(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 123


def _numpy_double(x):
    return torch.from_numpy(x.detach().numpy() * 2)


def _numpy_double_f32_only(x):
    if x.dtype != torch.float32:  # finite differences run the reference in float64
        raise TypeError(f"only float32 is supported, got {x.dtype}")
    return torch.from_numpy(x.detach().numpy() * 2)


F32 = st.tuples(tensors(shape=(3,), dtype=torch.float32, requires_grad=True))


def test_a_non_differentiable_reference_compares_gradients_by_finite_differences():
    """Since finite differences, a NumPy reference no longer leaves gradients uncompared: the
    wrong backward is a GradientMismatch naming them."""
    @equivalent_to(_numpy_double)
    def double(x):
        return _Times123.apply(x)

    report = equiv.check(double, settings=FAST, modes=("eager",), raise_on_failure=False)
    assert not report.ok
    (f,) = [f for f in report.findings if f.check == "gradients"]
    assert "finite differences" in f.headline and f.kind == "GradientMismatch"


def test_gradients_compared_nowhere_are_not_a_pass_unless_grads_false():
    @equivalent_to(_numpy_double_f32_only, inputs=F32)
    def double(x):
        return _Times123.apply(x)

    report = equiv.check(double, settings=FAST, modes=("eager",), raise_on_failure=False)
    assert not report.ok
    (f,) = report.findings
    assert f.check == "not-checked" and "gradients were compared on no example" in f.headline
    assert "grads=False" in f.fix
    text = report.render()
    assert "gradients not compared: the reference is not differentiable" in text
    assert "mode eager on cpu: not checked" in text
    with pytest.raises(equiv.EquivalenceFailure):
        equiv.check(double, settings=FAST, modes=("eager",))

    @equivalent_to(_numpy_double_f32_only, inputs=F32, grads=False)
    def declared(x):
        return _Times123.apply(x)

    report = equiv.check(declared, settings=FAST, modes=("eager",))
    assert report.ok and "gradients" not in report.checks
    assert any("grads=False" in n for n in report.notes)


def test_grads_false_with_only_gradient_checks_is_invalid():
    @equivalent_to(ref1, grads=False)
    def double(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match="nothing.*grads=False|grads=False.*nothing"):
        equiv.check(double, settings=FAST, checks=("gradients",))
    with pytest.raises(equiv.InvalidArgument, match="grads=1"):
        equivalent_to(ref1, grads=1)


def test_a_differentiable_reference_catches_the_wrong_backward():
    @equivalent_to(ref1)
    def double(x):
        return _Times123.apply(x)

    with pytest.raises(equiv.GradientMismatch) as info:
        equiv.check(double, settings=FAST, modes=("eager",))
    assert info.value.report.findings[0].check == "gradients"


# -- 8. partial and callable-object implementations ---------------------------------------------
class Doubler:
    def __call__(self, x):
        return x * 2


def test_partial_and_callable_object_specs_are_collected_with_deterministic_names():
    mod = ModuleType("honesty_callables")
    sys.modules[mod.__name__] = mod
    try:
        exec(textwrap.dedent('''
            import functools
            from equiv import equivalent_to
            from tests.test_honesty import Doubler, ref1

            def scale(x, factor):
                return x * factor

            half = equivalent_to(ref1)(functools.partial(scale, factor=2))
            obj = equivalent_to(ref1)(Doubler())
        '''), vars(mod))
        from equiv._loader import specs_in_module

        names = [s.name for s in specs_in_module(mod)]
        assert names == ["functools.partial(honesty_callables.scale)",
                         "tests.test_honesty.Doubler()"]
        assert all("0x" not in n for n in names)
        assert equiv.check(mod.half, settings=FAST, modes=("eager",)).ok
    finally:
        del sys.modules[mod.__name__]


# -- 9. outputs and implementations the comparison does not know -------------------------------
def test_string_leaves_compare_by_equality():
    def ref(x):
        return x * 2, "tag"

    @equivalent_to(ref)
    def good(x):
        return x + x, "tag"

    @equivalent_to(ref)
    def bad(x):
        return x + x, "other"

    assert equiv.check(good, settings=FAST, modes=("eager",)).ok
    with pytest.raises(equiv.OutputMismatch, match=r"\[1\]"):
        equiv.check(bad, settings=FAST, modes=("eager",))


def test_an_async_implementation_is_invalid():
    with pytest.raises(equiv.InvalidArgument, match="async"):
        @equivalent_to(ref1)
        async def double(x):
            return x * 2

        equiv.check(double, settings=FAST, modes=("eager",))


def test_a_generator_implementation_and_an_async_reference_are_invalid():
    with pytest.raises(equiv.InvalidArgument, match="generator function"):
        @equivalent_to(ref1)
        def double(x):
            yield x * 2

    async def aref(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match="the reference .* async"):
        equivalent_to(aref)(lambda x: x * 2)


class _ReturnsCoroutine:
    def __call__(self, x):
        async def later():
            return x * 2
        return later()


def test_a_callable_returning_a_coroutine_is_invalid_at_run_time():
    obj = equivalent_to(ref1)(_ReturnsCoroutine())
    with pytest.raises(equiv.InvalidArgument, match="returned a coroutine"):
        equiv.check(obj, settings=FAST, modes=("eager",))


def test_a_sparse_output_is_invalid_naming_the_layout():
    def ref(x):
        return x.detach().to_sparse()

    @equivalent_to(ref)
    def sparse(x):
        return x.detach().to_sparse()

    with pytest.raises(equiv.InvalidArgument, match="layout torch.sparse_coo at output"):
        equiv.check(sparse, settings=FAST, modes=("eager",))


def test_object_leaves_compare_by_type_and_equality():
    from equiv.compare import compare_trees

    assert compare_trees({"k": "a", "n": None}, {"n": None, "k": "a"}, rtol=None, atol=None) == []
    (m,) = compare_trees(("a", 1), ("b", 1), rtol=None, atol=None)
    assert m.path == "output[0]" and "compared with ==" in m.message
    (m,) = compare_trees([1.0], ["1.0"], rtol=None, atol=None)
    assert "str '1.0'" in m.message


# -- 10. inputs= of the wrong arity ------------------------------------------------------------
def _add(x, y):
    return x + y


def test_inputs_of_the_wrong_arity_is_invalid_naming_inputs_and_the_arity():
    @equivalent_to(_add, inputs=st.tuples(tensors(shape=(3,))))
    def add(x, y):
        return x + y

    with pytest.raises(equiv.InvalidArgument) as info:
        equiv.check(add, settings=FAST, modes=("eager",))
    text = str(info.value)
    assert "equivalent_to(inputs=...)" in text and "tuples of 2 argument(s)" in text
    assert "(x, y)" in text


def test_one_bad_spec_in_a_run_is_reported_and_the_others_run(tmp_path):
    path = write(tmp_path, "arity_mixed.py", '''
        import hypothesis.strategies as st
        from equiv import equivalent_to
        from equiv.strategies import tensors

        def ref(x, y):
            return x + y

        @equivalent_to(ref, inputs=st.tuples(tensors(shape=(3,))))
        def one_arg(x, y):
            return x + y

        @equivalent_to(ref, inputs=st.tuples(tensors(shape=(3,)), tensors(shape=(3,))))
        def two_args(x, y):
            return y + x
    ''')
    code, out, _ = run("check", path, *QUICK)
    table = rows(out)
    assert code == 2
    assert table["arity_mixed.one_arg"][0][2] == "ERROR"
    assert table["arity_mixed.two_args"][0][2] == "pass"
    assert "tuples of 2 argument(s)" in out


# -- 11. numbers that make a contract vacuous ---------------------------------------------------
@pytest.mark.parametrize("options, argument", [
    ({"rtol": math.nan, "atol": 0.0}, "rtol=nan"), ({"rtol": 0.0, "atol": math.nan}, "atol=nan"),
    ({"rtol": True, "atol": 0.0}, "rtol=True"), ({"rtol": -1e-3, "atol": 0.0}, "rtol=-0.001"),
    ({"rtol": math.inf, "atol": 0.0}, "rtol=inf"),
    ({"max_memory_ratio": math.nan}, "max_memory_ratio=nan"),
    ({"max_memory_ratio": -2.0}, "max_memory_ratio=-2.0"),
    ({"max_retained_bytes": True}, "max_retained_bytes=True"),
    ({"name": 123}, "name=123"), ({"name": ""}, "name=''"),
])
def test_vacuous_numbers_and_names_are_invalid_at_decoration(options, argument):
    with pytest.raises(equiv.InvalidArgument) as info:
        equivalent_to(ref1, **options)(lambda x: x * 2)
    assert f"equivalent_to({argument})" in str(info.value)


@pytest.mark.parametrize("options, argument", [
    ({"max_examples": True}, "max_examples=True"), ({"max_examples": -3}, "max_examples=-3"),
    ({"seed": True}, "seed=True"), ({"backward_repeats": True}, "backward_repeats=True"),
    ({"derandomize": 1}, "derandomize=1"), ({"timeout": math.nan}, "timeout=nan"),
    ({"timeout": 0}, "timeout=0"), ({"tolerances": {"float32": (math.nan, 0)}}, "tolerances="),
    ({"hypothesis_settings": {"deadline": None}}, "hypothesis_settings="),
])
def test_vacuous_settings_are_invalid_naming_the_option(options, argument):
    with pytest.raises(equiv.InvalidArgument) as info:
        equiv.settings(**options)
    assert f"settings({argument}" in str(info.value)


def test_valid_numbers_are_accepted_and_stored_as_floats():
    spec = equivalent_to(ref1, rtol=0, atol=1e-6, max_memory_ratio=1, max_retained_bytes=0,
                         name="ok-name")(lambda x: x * 2).__equiv_spec__
    assert (spec.rtol, spec.atol, spec.max_memory_ratio, spec.name) == (0.0, 1e-6, 1.0, "ok-name")
    assert equiv.settings(timeout=2.5, max_examples=1).timeout == 2.5


# -- 12. structure and locations ------------------------------------------------------------------
def test_dicts_with_the_same_keys_in_another_order_match():
    def ref(x):
        return {"a": x * 2, "b": x + 1}

    @equivalent_to(ref)
    def swapped(x):
        return {"b": x + 1, "a": x * 2}

    assert equiv.check(swapped, settings=FAST, modes=("eager",)).ok


def _ref_tuple1(x):
    return (x * 2,)


def test_mutates_with_a_negative_index_into_a_one_tuple_passes():
    @equivalent_to(_ref_tuple1, mutates={"x": -1})
    def double_(x):
        x.mul_(2)

    assert equiv.check(double_, settings=FAST, modes=("eager",)).ok


def test_mutates_with_index_zero_into_a_one_tuple_passes_and_a_wrong_value_fails():
    @equivalent_to(_ref_tuple1, mutates={"x": 0})
    def double_(x):
        x.mul_(2)

    @equivalent_to(_ref_tuple1, mutates={"x": 0})
    def triple_(x):
        x.mul_(3)

    assert equiv.check(double_, settings=FAST, modes=("eager",)).ok
    with pytest.raises(equiv.EquivalenceFailure) as info:
        equiv.check(triple_, settings=FAST, modes=("eager",))
    assert info.value.report.findings[0].check == "mutation"


# -- 13. global torch state ----------------------------------------------------------------------
def test_global_state_set_by_an_implementation_does_not_leak():
    @equivalent_to(ref1)
    def leaky(x):
        torch.set_default_dtype(torch.float64)
        return x * 2

    try:
        equiv.check(leaky, settings=FAST, modes=("eager",), raise_on_failure=False)
        assert torch.get_default_dtype() == torch.float32
    finally:
        torch.set_default_dtype(torch.float32)


def test_every_kind_of_global_state_is_restored_and_the_next_spec_passes():
    import torch._dynamo

    threads = torch.get_num_threads()
    before = torch._dynamo.config.recompile_limit

    @equivalent_to(ref1)
    def meddles(x):
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        torch.set_anomaly_enabled(True)
        torch._dynamo.config.recompile_limit = 1
        raise SystemExit(0)

    with pytest.raises(equiv.ErrorMismatch):
        equiv.check(meddles, settings=FAST, modes=("eager",))
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads and not torch.is_anomaly_enabled()
    assert torch._dynamo.config.recompile_limit == before

    @equivalent_to(ref1)
    def fine(x):
        return x + x

    assert equiv.check(fine, settings=FAST, modes=("eager", "compile[aot_eager]")).ok


def test_check_under_no_grad_still_compares_gradients():
    @equivalent_to(ref1)
    def double(x):
        return _Times123.apply(x)

    with torch.no_grad(), pytest.raises(equiv.GradientMismatch):
        equiv.check(double, settings=FAST, modes=("eager",))
    assert torch.is_grad_enabled()


# -- 14. hostile global configuration ----------------------------------------------------------
def test_check_under_inference_mode_runs():
    @equivalent_to(ref1)
    def double(x):
        return x + x

    with torch.inference_mode():
        assert equiv.check(double, settings=FAST, modes=("eager",)).ok


def test_compile_mode_with_suppress_errors():
    @equivalent_to(ref1)
    def double(x):
        return x + x

    import torch._dynamo

    with torch._dynamo.config.patch(suppress_errors=True):
        report = equiv.check(double, settings=equiv.settings(FAST, max_examples=3),
                             modes=("compile[aot_eager]",), raise_on_failure=False)
    assert report.ok


# -- 15. a lazy module attribute ---------------------------------------------------------------
class _LazyProxy:
    def __getattr__(self, name):
        raise RuntimeError(f"lazy module not loaded: {name}")


def test_a_lazy_proxy_whose_getattr_raises_is_not_a_test_nor_a_spec():
    from _equiv_pytestplugin import _is_equiv_tests
    from equiv._loader import specs_in_module

    assert _is_equiv_tests(_LazyProxy()) is False
    assert _is_equiv_tests(equiv.pytest.tests_for(equivalent_to(ref1)(lambda x: x * 2)))
    mod = ModuleType("lazy_holder")
    mod.np = _LazyProxy()
    assert specs_in_module(mod) == []


# -- 16. time limits and Ctrl-C -------------------------------------------------------------------
def test_a_users_hypothesis_deadline_is_honoured_and_the_builtin_default_is_not_imposed():
    given = equiv.settings(hypothesis_settings=hypothesis.settings(
        deadline=datetime.timedelta(milliseconds=50)))
    assert given._hypothesis_deadline() == datetime.timedelta(milliseconds=50)
    assert equiv.settings(hypothesis_settings=hypothesis.settings(
        database=None))._hypothesis_deadline() is None


def test_a_hanging_implementation_times_out_naming_the_spec():
    from equiv._results import run_one

    def ref(x):
        return x * 2

    @equivalent_to(ref, settings=equiv.settings(FAST, timeout=0.5))
    def hangs(x):
        while True:
            time.sleep(0.01)

    start = time.monotonic()
    result = run_one(hangs.__equiv_spec__, "eager", "cpu")
    assert time.monotonic() - start < 10
    assert (result.verdict, result.kind, result.label) == ("fail", "timeout", "TIMEOUT")
    assert "hangs under eager on cpu: an example ran longer than timeout=0.5s" in result.reason


def test_a_fast_implementation_passes_under_a_timeout():
    from equiv._results import run_one

    @equivalent_to(ref1, settings=equiv.settings(FAST, timeout=30))
    def double(x):
        return x + x

    assert run_one(double.__equiv_spec__, "eager", "cpu").verdict == "pass"


def test_check_reports_a_timeout_finding():
    @equivalent_to(ref1)
    def hangs(x):
        while True:
            time.sleep(0.01)

    from equiv._watchdog import ExampleTimeout, per_example

    try:
        with per_example(5), pytest.raises(equiv.EquivalenceFailure) as info:
            equiv.check(hangs, settings=equiv.settings(FAST, timeout=0.5), modes=("eager",))
    except ExampleTimeout:
        pytest.fail("check() ignored settings(timeout=0.5): the test's own 5 s guard fired")
    assert info.value.report.findings[0].check == "timeout"


def test_ctrl_c_prints_the_partial_summary_and_exits_130(tmp_path):
    path = write(tmp_path, "interrupted_run.py", '''
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        @equivalent_to(ref)
        def a_first(x):
            return x + x

        @equivalent_to(ref)
        def b_pressed(x):
            raise KeyboardInterrupt

        @equivalent_to(ref)
        def c_never(x):
            return x + x
    ''')
    code, out, _ = run("check", path, *QUICK)
    assert code == 130
    table = rows(out)
    assert table["interrupted_run.a_first"][0][2] == "pass"
    assert "interrupted_run.c_never" not in table
    assert "equiv: interrupted after 1 of 3 runs" in out


# -- 17. packages ------------------------------------------------------------------------------
PKG_INIT = "from .gelu import gelu_\n"
PKG_GELU = '''
    import torch
    from equiv import equivalent_to
    from ._ref import gelu_ref

    @equivalent_to(gelu_ref)
    def gelu_(x):
        return torch.nn.functional.gelu(x)
'''
PKG_REF = "import torch\n\ndef gelu_ref(x):\n    return torch.nn.functional.gelu(x)\n"
PKG_SUB = '''
    from equiv import equivalent_to
    from .._ref import gelu_ref
    import torch

    @equivalent_to(gelu_ref)
    def gelu_tanh(x):
        return torch.nn.functional.gelu(x, approximate="tanh")   # bug: another formula
'''


def _package(tmp_path: Path, name: str) -> Path:
    write(tmp_path, f"{name}/__init__.py", PKG_INIT)
    write(tmp_path, f"{name}/gelu.py", PKG_GELU)
    write(tmp_path, f"{name}/_ref.py", PKG_REF)
    write(tmp_path, f"{name}/deep/__init__.py", "")
    write(tmp_path, f"{name}/deep/tanh.py", PKG_SUB)
    return tmp_path / name


def test_a_package_folder_imports_as_its_package_with_submodules(tmp_path):
    folder = _package(tmp_path, "pkg_folder_kernels")
    code, out, err = run("check", str(folder) + "/", *QUICK)
    table = rows(out)
    assert err == "" and code == 1
    assert table["pkg_folder_kernels.gelu.gelu_"][0][2] == "pass"
    assert table["pkg_folder_kernels.deep.tanh.gelu_tanh"][0][2] == "FAIL"


def test_a_dotted_package_recurses_into_submodules(tmp_path, monkeypatch):
    _package(tmp_path, "pkg_dotted_kernels")
    monkeypatch.syspath_prepend(str(tmp_path))
    from equiv._loader import load_target

    names = [s.name for s in load_target("pkg_dotted_kernels")]  # submodules in name order
    assert names == ["pkg_dotted_kernels.deep.tanh.gelu_tanh", "pkg_dotted_kernels.gelu.gelu_"]


def test_console_script_finds_a_module_in_the_current_directory(tmp_path):
    _package(tmp_path, "pkg_cwd_kernels")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("CI", None)
    env.pop("EQUIV_PROFILE", None)
    proc = subprocess.run([sys.executable, "-c", "import sys; from equiv.cli import main; "
                           "sys.path.remove(''); sys.exit(main())" if "" in sys.path else
                           "import sys; from equiv.cli import main; sys.exit(main())",
                           "list", "pkg_cwd_kernels.gelu"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("pkg_cwd_kernels.gelu.gelu_\n")


# -- 18. paths and counts ----------------------------------------------------------------------
def test_a_missing_path_is_one_line_and_exit_2():
    code, out, err = run("check", "no/such/kernels/", *QUICK)
    assert (code, out) == (2, "")
    assert err == "equiv: no such file or folder: no/such/kernels/\n"


@pytest.mark.parametrize("option", ["--json", "--html"])
def test_an_unwritable_report_path_is_exit_2_before_the_run(tmp_path, option):
    path = write(tmp_path, "writes_reports.py", '''
        from equiv import equivalent_to

        def ref(x):
            return x * 2

        @equivalent_to(ref)
        def double(x):
            return x + x
    ''')
    target = tmp_path / "no_such_dir" / "report.out"
    code, out, err = run("check", path, *QUICK, option, str(target))
    assert code == 2 and out == ""
    assert err.startswith(f"equiv: {option} {target}: cannot write there")
    assert "nothing was run" in err
    ok = tmp_path / "report.out"
    assert run("check", path, *QUICK, option, str(ok))[0] == 0 and ok.stat().st_size > 0


def test_the_examples_column_counts_valid_examples_only(tmp_path):
    path = write(tmp_path, "rejects_some.py", '''
        from equiv import equivalent_to

        def ref(x):
            if x.numel() % 2:
                raise ValueError("odd sizes are not supported")
            return x * 2

        @equivalent_to(ref)
        def double(x):
            if x.numel() % 2:
                raise ValueError("odd sizes are not supported")
            return x + x
    ''')
    report = tmp_path / "r.json"
    code, out, _ = run("check", path, "--modes", "eager", "--max-examples", "20", "--seed", "3",
                       "--json", str(report))
    import json

    row = json.loads(report.read_text())["results"][0]
    assert code == 0 and row["invalid_examples"] > 0
    shown = int(rows(out)["rejects_some.double"][0][3])
    assert shown == row["examples_run"] - row["invalid_examples"]


# -- 19. same cause, same verdict ---------------------------------------------------------------
class _Classic(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_a_classic_function_under_functionalize_is_skipped_not_failed():
    """Same cause as vmap/jvp: skipped with torch's reason, never a finding about the kernel;
    the skip is a visible non-pass (a 'not-checked' run-level finding) unless allowed."""
    spec_fn = equivalent_to(ref1)(_Classic)
    report = equiv.check(spec_fn, settings=FAST, modes=("functionalize",),
                         raise_on_failure=False)
    (run_,) = report.runs
    assert run_.status == "skipped" and "setup_context" in run_.reason
    assert [f.check for f in report.findings] == ["not-checked"]
    assert "allow_skip=('functionalize',)" in report.findings[0].fix
    for mode in ("vmap", "jvp"):  # the same verdict as the other transforms
        other = equiv.check(spec_fn, settings=FAST, modes=(mode,), raise_on_failure=False)
        assert other.runs[0].status == "skipped"
        assert [f.check for f in other.findings] == ["not-checked"]


class _Modern(_Times123):
    """A Function with setup_context (functorch-ready): vmap runs it, functionalize cannot."""

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_a_setup_context_function_under_functionalize_is_skipped_not_failed():
    """torch has no functionalize rule for a custom Function ("NYI: Functionalize rule for
    custom_function_call"): skipped with that reason, not an error-parity finding."""
    report = equiv.check(equivalent_to(ref1)(_Modern), settings=FAST, modes=("functionalize",),
                         raise_on_failure=False)
    (run_,) = report.runs
    assert run_.status == "skipped" and "custom_function_call" in run_.reason, report.render()
    assert [f.check for f in report.findings] == ["not-checked"]


def test_an_allowed_skip_passes_and_a_supported_transform_still_catches():
    allowed = equivalent_to(ref1, allow_skip=("functionalize", "vmap"))(_Classic)
    report = equiv.check(allowed, settings=FAST, modes=("eager", "functionalize", "vmap"))
    assert report.ok and report.findings == ()
    assert [r.status for r in report.runs] == ["passed", "skipped", "skipped"]
    assert "setup_context" in report.runs[1].reason
    with pytest.raises(equiv.InvalidArgument, match="every requested mode was skipped"):
        equiv.check(allowed, settings=FAST, modes=("functionalize",))  # nothing ran at all
    # (decorating the same class again replaces its spec)
    via_settings = equiv.check(equivalent_to(ref1)(_Classic), modes=("eager", "functionalize"),
                               settings=equiv.settings(FAST, allow_skip=("functionalize",)))
    assert via_settings.ok

    @equivalent_to(ref1, allow_skip=("functionalize",))
    def triple(x):
        return x * 3

    with pytest.raises(equiv.OutputMismatch):
        equiv.check(triple, settings=FAST, modes=("functionalize",))
    with pytest.raises(equiv.InvalidArgument, match="allow_skip"):
        equivalent_to(ref1, allow_skip=("eager",))
    with pytest.raises(equiv.InvalidArgument, match="allow_skip"):
        equiv.settings(allow_skip=("compile",))


def test_the_thorough_profile_allows_unsupported_transforms():
    assert set(equiv.settings.get_profile("thorough").allow_skip) == {
        "functionalize", "vmap", "jvp"}


# -- settings inherit the loaded profile (like hypothesis.settings) ------------------------------
def test_settings_without_a_parent_inherit_the_loaded_profile():
    equiv.settings.register_profile("honesty-small", max_examples=3, backward_repeats=1)
    previous = equiv.settings._push_session("honesty-small")
    try:
        s = equiv.settings(seed=5)
        assert (s.max_examples, s.backward_repeats, s.seed) == (3, 1, 5)
        assert s._explicit == frozenset({"seed"})

        @equivalent_to(ref1)
        def double(x):
            return x + x

        report = equiv.check(double, settings=s, modes=("eager",))
        assert "max_examples=3" in report.settings and report.seed == 5
    finally:
        equiv.settings._pop_session(previous)
        del equiv.settings._profiles["honesty-small"]  # other tests list the profiles
    assert equiv.settings().max_examples == equiv.settings.get_profile("default").max_examples


# -- pytest: collection of everything above, the same on every xdist worker ----------------------
def test_pytest_collects_every_spec_the_same_on_every_worker(pytester):
    pytester.makepyfile(collide_factory=textwrap.dedent(FACTORY) + textwrap.dedent('''
        import functools

        class Doubler:
            def __call__(self, x):
                return x * 2

        obj = equivalent_to(ref)(Doubler())
        part = equivalent_to(ref)(functools.partial(lambda x, k: x * k, k=2))
    '''))
    pytester.makepyfile(test_lazy=textwrap.dedent('''
        class Lazy:
            def __getattr__(self, name):
                raise RuntimeError("lazy module not loaded")

        np = Lazy()

        def test_plain():
            pass
    '''))
    _package(pytester.path, "pkg_plugin_kernels")
    result = pytester.runpytest_subprocess(
        "-p", "xdist", "-n", "2", "--equiv-module=collide_factory",
        "--equiv-module=pkg_plugin_kernels", "--equiv-modes=eager", "--equiv-devices=cpu",
        "--equiv-max-examples=3", "--equiv-seed=1", "-q", "-rf", "-W", "ignore")
    text = result.stdout.str()
    assert "Different tests were collected" not in text
    outcomes = result.parseoutcomes()
    # factory pair, lambda pair, callable object, partial, two package specs; the lazy test
    assert outcomes.get("passed", 0) + outcomes.get("failed", 0) == 9, text
    for failed in ("impl#2[eager-cpu]", "<lambda>#2[eager-cpu]", "gelu_tanh[eager-cpu]"):
        assert failed in text
    assert outcomes.get("failed") == 3
