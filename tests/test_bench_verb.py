"""``equiv.bench`` and ``equiv bench``: speedups as ratios (a 30x slower implementation, a
faster one), a failing spec reported and not timed, the table, JSON and the HTML plot (in
headless Chromium when one is installed). Sizes are tiny and measurements short."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import _bench, equivalent_to
from equiv.strategies import tensors
from tests.test_report_files import BROWSER, _chromium

QUICK = dict(sizes=(1000,), min_time=0.02)


def vec():
    return st.tuples(tensors(shape=(100,), dtype=torch.float32, requires_grad=True))


def double_ref(x):
    return x * 2


def thirty_times(x):
    y = x * 2
    for _ in range(29):  # the same result, 30 kernels instead of one
        y = (y + x) - x
    return y


def slow_ref(x):
    y = x * 2
    for _ in range(29):
        y = (y + x) - x
    return y


def test_a_30x_slower_implementation_reports_a_speedup_below_half():
    slow = equivalent_to(double_ref, inputs=vec())(thirty_times)
    result = equiv.bench(slow, **QUICK)
    assert result.equivalent and [r.size for r in result.rows] == [1000]
    row = result.rows[0]
    assert row.speedup < 0.5, _bench.table([result])
    assert row.speedup_fwd_bwd is not None and row.speedup_fwd_bwd < 0.5
    assert row.impl_peak_bytes and row.ref_peak_bytes


def test_a_faster_implementation_reports_a_higher_speedup():
    fast = equivalent_to(slow_ref, inputs=vec())(lambda x: x * 2)
    slow = equivalent_to(double_ref, inputs=vec(), name="slow")(thirty_times)
    fast_row, slow_row = equiv.bench(fast, **QUICK).rows[0], equiv.bench(slow, **QUICK).rows[0]
    assert fast_row.speedup > 1 > 0.5 > slow_row.speedup


def test_a_failing_spec_says_so_and_times_nothing():
    wrong = equivalent_to(double_ref, inputs=vec())(lambda x: x * 3)
    result = equiv.bench(wrong, **QUICK)
    assert not result.equivalent and result.rows == []
    assert "not equivalent (forward)" in result.reason
    assert "not equivalent, not timed" in _bench.table([result])


def test_sizes_scale_the_batched_arguments_only():
    args = equiv.Args(torch.ones(4, 8), torch.ones(4), torch.ones(4, 2), w=torch.ones(3, 3))
    scaled = _bench._scaled(args, 3200)  # a weight of the batch's length (4,) stays whole
    assert [tuple(t.shape) for t in _bench._tensors(scaled)] == [(400, 8), (4,), (400, 2),
                                                                 (3, 3)]
    with pytest.raises(equiv.InvalidArgument, match="sizes="):
        equiv.bench(equivalent_to(double_ref, inputs=vec())(thirty_times), sizes=(0,))


def test_equiv_bench_prints_the_table_and_writes_json_and_html(tmp_path, capsys):
    from equiv.cli import main

    out_json, out_html = tmp_path / "bench.json", tmp_path / "bench.html"
    code = main(["bench", "examples/activations.py", "--sizes", "1e3,4e3", "--min-time",
                 "0.01", "--json", str(out_json), "--html", str(out_html)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert text.splitlines()[0].split()[:5] == ["spec", "size", "impl", "ms", "ref"]
    doc = json.loads(out_json.read_text())
    first = doc["results"][0]
    assert first["equivalent"] and first["sizes"][0]["size"] >= 1000
    row = first["sizes"][0]
    assert row["speedup"] == pytest.approx(row["ref_ms"] / row["impl_ms"])
    page = out_html.read_text()
    assert "<svg class='plot'" in page and "<polyline" in page and "<script" not in page
    if BROWSER is not None:
        dom = _chromium(["--dump-dom", out_html.as_uri()], tmp_path / "profile").stdout
        assert "time (ms) against size" in dom and "polyline" in dom


def four_rows_ref(x):
    if x.shape[0] != 4:
        raise ValueError("takes exactly 4 rows")
    return x * 2


def test_an_example_the_scaling_breaks_is_not_timed_and_says_why():
    def four_rows(x):
        if x.shape[0] != 4:
            raise ValueError("takes exactly 4 rows")
        return x + x

    inputs = st.tuples(tensors(shape=(4, 3), dtype=torch.float32, requires_grad=True))
    impl = equivalent_to(four_rows_ref, inputs=inputs)(four_rows)
    result = equiv.bench(impl, **QUICK)
    assert not result.equivalent and result.rows == []
    assert result.reason.startswith("could not scale: the reference raised ValueError")
    assert "not timed: could not scale" in _bench.table([result])
