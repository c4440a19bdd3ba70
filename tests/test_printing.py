"""The printed example: alias topology and layout in the summary, and runnable code that
rebuilds the same structure (sizes, strides, storage offsets, shared storages, same objects)."""

from __future__ import annotations

import inspect

import hypothesis
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import equiv
import equiv.strategies as es
from equiv.examples import Args, Template


def f(a, b, c, d):
    pass


def rebuild(template: Template) -> list[torch.Tensor]:
    """exec() the printed code; return the tensors the call received."""
    got: list = []
    namespace = {"f": lambda *args: got.extend(args)}
    exec(template.code("f"), namespace)
    return got


def storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_summary_names_layouts_and_aliases():
    base = torch.arange(10.0)
    x = torch.arange(6.0).reshape(2, 3).t()
    e = torch.ones(3, 1).expand(3, 4)
    t = Template(inspect.signature(f), Args(base[:5], base[2:7], x, e))
    text = t.describe("f")
    assert "a=f32[5] cpu" in text
    assert "b=f32[5] cpu (overlaps a (3 shared elements), storage offset 2)" in text
    assert "c=f32[3,2] cpu (transposed, strides (1, 3))" in text
    assert "d=f32[3,4] cpu (expanded, strides (1, 0), in a storage of 3 elements)" in text
    same = Template(inspect.signature(f), Args(base, base, base[7:9], base[1:3]))
    text = same.describe("f")
    assert "b=<same tensor as a>" in text
    assert "c=f32[2] cpu (view of a, storage offset 7)" in text
    grad = Template(inspect.signature(f), Args(*[t.requires_grad_() for t in
                                                 (torch.ones(2), torch.ones(2, 2).t(),
                                                  torch.ones(3), torch.ones(1))]), mutated=["c"])
    text = grad.describe("f")
    assert "a=f32[2] cpu grad," in text  # passed as a leaf
    assert "b=f32[2,2] cpu grad (transposed, strides (1, 2))" in text
    assert "c=f32[3] cpu grad (non-leaf)" in text  # written in place: a copy of a leaf


def test_disjoint_views_are_named():
    base = torch.arange(8.0)
    t = Template(inspect.signature(f), Args(base[:3], base[4:7], base[0:1], base[7:8]))
    assert "b=f32[3] cpu (disjoint view of a's storage, storage offset 4)" in t.describe("f")


def test_an_empty_tensor_prints_as_a_plain_tensor():
    t = Template(inspect.signature(f), Args(torch.empty(0, requires_grad=True),
                                            torch.empty(0, 3), torch.ones(3)[3:],
                                            torch.empty(2, 0).t()))
    text, code = t.describe("f"), t.code("f")
    assert "a=f32[0] cpu grad, b=f32[0,3] cpu, " in text, text  # no storage to show
    assert "c=f32[0] cpu (storage offset 3, in a storage of 3 elements)" in text, text
    assert "a = torch.empty((0,), dtype=torch.float32, requires_grad=True)" in code, code
    assert "b = torch.empty((0, 3), dtype=torch.float32)" in code, code
    got = rebuild(t)
    assert [tuple(x.shape) for x in got] == [(0,), (0, 3), (0,), (0, 2)]


@hypothesis.settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(st.data())
def test_printed_code_rebuilds_the_structure(data):
    """For drawn alias patterns and layouts, exec() of the printed code passes tensors with the
    same sizes, strides, offsets, dtypes, values, grad flags, storage sharing and identity."""
    pattern = data.draw(st.sampled_from(es.ALIAS_PATTERNS))
    dtype = data.draw(st.sampled_from(es.FLOATING + es.HALF + (torch.int64,)))
    rg = data.draw(st.booleans())
    a, b = data.draw(es.aliased_arguments(2, pattern=pattern, dtype=dtype, requires_grad=rg))
    c = data.draw(es.tensors(shape=es.shapes(max_side=3), dtype=dtype, layout=es.layouts(),
                             special=("nan", "inf", "-inf", "-0.0")))
    d = c if data.draw(st.booleans()) else torch.zeros(())
    original = [a, b, c, d]
    template = Template(inspect.signature(f), Args(*original), mutated=["a"])
    got = rebuild(template)
    assert len(got) == 4
    for o, g in zip(original, got):
        assert g.shape == o.shape and g.dtype == o.dtype
        assert g.stride() == o.stride(), (template.code("f"))
        assert g.storage_offset() == o.storage_offset()
        assert g.requires_grad == o.requires_grad
        assert torch.equal(g.detach().isnan(), o.detach().isnan())
        ok = g.detach().isnan() | (g.detach() == o.detach())
        assert bool(ok.all())
    for i in range(4):
        for j in range(i + 1, 4):
            same_storage = (storage_id(original[i]) == storage_id(original[j])
                            and original[i].numel() > 0 and original[j].numel() > 0)
            if same_storage:
                assert storage_id(got[i]) == storage_id(got[j])
            assert (got[i] is got[j]) == (original[i] is original[j])


def test_written_grad_argument_prints_a_non_leaf():
    """A mutated argument that requires grad is rebuilt as a non-leaf copy, so the in-place
    call in the printed code runs."""
    x = torch.tensor([1.0, -2.0], requires_grad=True)

    def g(x):
        pass

    t = Template(inspect.signature(g), Args(x), mutated=["x"])
    code = t.code("relu_")
    got: list = []
    exec(code, {"relu_": lambda x: got.append(x.clamp_(min=0))})
    assert not got[0].is_leaf and got[0].tolist() == [1.0, 0.0]


def test_a_compiled_modes_timeline_says_it_is_an_eager_replay():
    """The recorder replays the implementation eagerly: under a compile mode the report says
    the compiled graph's own steps are not in the timeline."""
    event = {"step": 1, "phase": "forward", "kind": "save", "storage": "S1", "tensor": "x",
             "version_before": 0, "version_after": 0, "tracked": True, "grad_fn": "MulBackward0",
             "nbytes": 8, "shape": [2]}
    eager = equiv.Finding(check="gradients", headline="h", timeline=(event,)).render()
    compiled = equiv.Finding(check="gradients", headline="h", mode="compile[aot_eager]",
                             timeline=(event,)).render()
    assert "Timeline (implementation, replayed under the recorder):" in eager
    assert ("Timeline (implementation replayed in eager mode under the recorder: the steps of "
            "the compile[aot_eager] graph are not recorded):") in compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_values_over_4096_elements_are_loaded_from_a_named_file(dtype, tmp_path):
    """Past 4096 elements the code loads the exact values from a .pt file it names, written
    into the report's folder; views, offsets and the same tensor in two slots survive."""
    from equiv import _values

    def g(x, y, z):
        return x

    base = torch.randn(90, 60, dtype=torch.float64).to(dtype)
    if dtype.is_floating_point:
        base[0, 0], base[0, 1] = float("nan"), -0.0
    x, y = base.t(), base[1:, 3:]
    with _values.example_directory(str(tmp_path)):
        code = Template(inspect.signature(g), Args(x, y, x)).code("g")
    files = list(tmp_path.glob("equiv-example-*.pt"))
    assert len(files) == 1 and f"torch.load({str(files[0])!r})" in code, code
    assert "randn" not in code and "elided" not in code
    scope: dict = {"g": lambda *a: scope.__setitem__("got", a)}
    exec(code, scope)
    gx, gy, gz = scope["got"]
    assert gz is gx and storage_id(gx) == storage_id(gy)
    for got, want in ((gx, x), (gy, y)):
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
        assert torch.equal(_bits(got), _bits(want))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().view(-1)
    return t if t.dtype == torch.bool else t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64,
                                   torch.bool])
def test_values_over_64_elements_are_rebuilt_exactly(dtype):
    """65 to 4096 elements: the code carries the exact bytes (NaN, -0.0 and all)."""
    def f(x):
        return x

    x = torch.randn(7, 11, dtype=torch.float64).to(dtype)
    if dtype.is_floating_point:
        x[0, 0], x[0, 1] = float("nan"), -0.0
    code = Template(inspect.signature(f), Args(x.t())).code("f")
    assert "elided" not in code
    scope: dict = {"f": lambda x: scope.__setitem__("got", x)}
    exec(code, scope)
    got = scope["got"]
    assert got.dtype == dtype and got.shape == x.t().shape and got.stride() == x.t().stride()
    def bits(t):
        t = t.contiguous().view(-1)
        return t if t.dtype == torch.bool else t.view(torch.uint8)
    assert torch.equal(bits(got), bits(x.t()))


def _rowsum_ref(x):
    return x.sum(-1)


@equiv.equivalent_to(_rowsum_ref, variants=(), examples=[(torch.arange(5000.0).reshape(50, 100),)])
def rowsum_large(x):
    """Wrong where a value exceeds 4900 (only the example's own values show it)."""
    return x.sum(-1) + bool((x > 4900).any()) * 1.0


def test_check_writes_the_big_example_where_its_code_loads_it(tmp_path):
    """equiv.check without a report: the .pt file goes to the folder in effect (here a given
    one; by default <tempdir>/equiv-examples) and the printed code, run, raises the finding."""
    from equiv import _values

    with _values.example_directory(str(tmp_path)):
        report = equiv.check(rowsum_large, modes=("eager",), max_examples=1,
                             raise_on_failure=False)
    code = report.findings[0].example_code
    saved = list(tmp_path.glob("equiv-example-*.pt"))
    assert len(saved) == 1 and f"torch.load({str(saved[0])!r})" in code, code
    with pytest.raises(equiv.OutputMismatch, match="differs from the reference"):
        exec(code, {})
    assert _values.directory().endswith("equiv-examples")


def test_fold_notes_keeps_kinds_apart_and_counts_the_rest():
    """Notes differing in listed elements or numbers fold into the first; a dtype's name
    (digits inside a word) keeps two notes apart."""
    from equiv.report import fold_notes

    notes = ["gradient w.r.t. 'x': at x[0] (from above) the reference is not differentiable",
             "x: float32 differences within rounding level",
             "gradient w.r.t. 'x': at x[1, 2] (from below), x[3, 0] (from above) and 5 more "
             "elements the reference is not differentiable",
             "x: float16 differences within rounding level",
             "gradient w.r.t. 'w': at w[2] (from above) the reference is not differentiable",
             "gradient w.r.t. 'x': at x[4] (from above) the reference is not differentiable"]
    assert fold_notes(notes) == [
        notes[0] + " (and 2 more like it from other examples)", notes[1], notes[3], notes[4]]
    assert fold_notes(["a", "a"]) == ["a (and 1 more like it from other examples)"]
