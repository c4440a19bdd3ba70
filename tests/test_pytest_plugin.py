"""The pytest plugin, tested with pytester: items, ids, header, skips, failure text, options,
reports, xdist, and that loading the plugin imports nothing heavy."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytest_plugins = ["pytester"]

KERNELS = textwrap.dedent('''
    import torch
    from equiv import equivalent_to

    def relu_ref(x):
        return torch.relu(x)

    @equivalent_to(relu_ref, mutates={"x": "out"})
    def relu_(x):
        return x.clamp_(min=0)

    def scale_ref(x, w):
        return x * w

    @equivalent_to(scale_ref)
    def scale_stale(x, w):
        """Overwrites w through .data after using it: a stale saved value."""
        y = x * w
        w.data.add_(0.5)
        return y
''')

TEST_MODULE = textwrap.dedent('''
    from equiv.pytest import tests_for
    from kernels import relu_, scale_stale

    test_kernels = tests_for(relu_, scale_stale)
''')

# mechanics tests pin the mode (compile modes have their own tests in test_modes.py)
FAST = ("--equiv-modes=eager", "--equiv-max-examples=3", "--equiv-seed=123", "-p",
        "no:cacheprovider")
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _default_profile(monkeypatch):
    """These tests state the default profile's output: CI=1 or EQUIV_PROFILE in the
    environment (which select other profiles) must not leak in, here or in subprocesses."""
    import equiv

    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EQUIV_PROFILE", raising=False)
    previous = equiv.settings._push_session("default")
    yield
    equiv.settings._pop_session(previous)


@pytest.fixture(scope="module", autouse=True)
def _torch_fully_imported():
    """In-process pytester runs restore sys.modules afterwards; torch registers operator
    libraries when some submodules first load, and must not load them twice. Run both kernels
    once here so every lazily imported torch module is loaded before any snapshot."""
    namespace: dict = {}
    exec(compile(KERNELS, "kernels_warmup.py", "exec"), namespace)
    import equiv
    from equiv.spec import _REGISTRY

    before = dict(_REGISTRY)
    for name in ("relu_", "scale_stale"):
        equiv.check(namespace[name], max_examples=3, seed=1, raise_on_failure=False)
    _REGISTRY.clear()
    _REGISTRY.update(before)


@pytest.fixture
def project(pytester):
    """A tmp project with a correct and a buggy kernel and a test module using tests_for."""
    pytester.makepyfile(kernels=KERNELS, test_kernels=TEST_MODULE)
    pytester.syspathinsert()
    return pytester


def test_one_item_per_spec_mode_device_with_readable_ids(project):
    """Each (spec, mode, device) is one item named spec[mode-device]."""
    result = project.runpytest_inprocess("--co", "-q", "--equiv-devices=cpu,cuda", *FAST)
    result.stdout.fnmatch_lines([
        "test_kernels.py::relu_[[]eager-cpu[]]",
        "test_kernels.py::relu_[[]eager-cuda[]]",
        "test_kernels.py::scale_stale[[]eager-cpu[]]",
        "test_kernels.py::scale_stale[[]eager-cuda[]]",
        "4 tests collected*",
    ])


def test_correct_kernel_passes_buggy_fails_unavailable_device_skips(project):
    """Verdicts: the correct kernel passes, the stale-value kernel fails, no CUDA skips."""
    result = project.runpytest_inprocess("--equiv-devices=cpu,cuda", "-rs", *FAST)
    if CUDA:
        result.assert_outcomes(passed=2, failed=2)
    else:
        result.assert_outcomes(passed=1, failed=1, skipped=2)
        result.stdout.fnmatch_lines([
            "SKIPPED [[]2[]] test_kernels.py:1: device 'cuda' is not available here "
            "(torch.cuda.is_available() is False)"])


def test_failure_shows_the_finding_and_the_flags_to_reproduce_without_pytest_noise(project):
    """A finding fails the item with its message and the exact flags to paste back."""
    result = project.runpytest_inprocess("-k", "scale_stale", *FAST)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*_ scale_stale[[]eager-cpu[]] _*",
        "equiv: kernels.scale_stale vs kernels.scale_ref: * finding*seed 123)",
        "MutationMismatch: argument 'w' was modified, but the contract does not declare it*",
        "  mode: eager   device: cpu   dtype: torch.float32   check: mutation",
        "+1 follow-on finding: gradients (eager)",
        "  gradients (eager): GradientMismatch: gradient w.r.t. 'x' differs from the reference "
        "on backward #1.",
        "Reproduce in pytest: pytest 'test_kernels.py::scale_stale[[]eager-cpu[]]' "
        "--equiv-profile=default --equiv-modes=eager --equiv-devices=cpu "
        "--equiv-max-examples=3 --equiv-seed=123",
        "FAILED test_kernels.py::scale_stale[[]eager-cpu[]] - equiv: *",
    ])
    out = result.stdout.str()
    out = out[out.index("= FAILURES ="):out.index("short test summary info")]
    for noise in ("_pytest", "def runtest", "raise_if_failed", "Traceback", "site-packages"):
        assert noise not in out, f"pytest-internal noise {noise!r} in the failure output"


def test_torch_trace_logs_are_left_out_of_the_failure_but_user_logs_stay(pytester):
    """torch.compile's DEBUG structured trace is not dumped under a failing item; the user's
    own log records still are."""
    noisy = KERNELS.replace("    y = x * w\n", (
        "    import logging\n"
        "    logging.getLogger('torch.__trace').debug('TRACE NOISE\\nmore noise')\n"
        "    logging.getLogger('mykernels').warning('USER RECORD')\n"
        "    y = x * w\n"))
    assert noisy != KERNELS
    pytester.makepyfile(kernels=noisy, test_kernels=TEST_MODULE)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-k", "scale_stale", "--log-level=DEBUG", *FAST)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "USER RECORD" in out and "Captured log call" in out
    assert "TRACE NOISE" not in out and "more noise" not in out


def test_the_printed_reproduce_line_reproduces_the_failure(project):
    """Running the printed node id and flags selects that one item and fails the same way."""
    result = project.runpytest_inprocess(
        "test_kernels.py::scale_stale[eager-cpu]", "--equiv-profile=default",
        "--equiv-modes=eager", "--equiv-devices=cpu", *FAST)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["MutationMismatch: argument 'w' was modified*"])


def test_header_states_profile_modes_devices_and_seed(project):
    """The header line names the profile, modes, devices, examples and the seed flag."""
    result = project.runpytest_inprocess("-k", "relu_", *FAST)
    result.stdout.fnmatch_lines([
        "equiv: profile=default modes=eager devices=cpu max_examples=3 --equiv-seed=123"])


def test_plain_pytest_in_a_fresh_process_prints_the_header_after_collection(pytester):
    """No option, no conftest: the header comes once equiv items are collected."""
    few = 'settings=__import__("equiv").settings(max_examples=3, modes=("eager",)))'  # quick
    pytester.makepyfile(kernels=KERNELS.replace('mutates={"x": "out"})',
                                                'mutates={"x": "out"}, ' + few)
                        .replace("@equivalent_to(scale_ref)", "@equivalent_to(scale_ref, " + few),
                        test_kernels=TEST_MODULE)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "collected 2 items",
        "equiv: profile=default modes=eager,compile[[]aot_eager[]] devices=cpu max_examples=60 "
        "--equiv-seed=*",
    ])


def test_random_seed_is_printed_and_used_in_the_reproduce_line(project):
    """Without --equiv-seed a seed is drawn once, printed, and reused by every item."""
    result = project.runpytest_inprocess("--equiv-max-examples=3", "-p", "no:cacheprovider")
    out = result.stdout.str()
    header = [ln for ln in out.splitlines() if ln.startswith("equiv: profile=")]
    assert len(header) == 1, out
    seed = header[0].rsplit("--equiv-seed=", 1)[1]
    assert seed.isdigit()
    assert f"Reproduce in pytest: pytest 'test_kernels.py::scale_stale[eager-cpu]' " \
           f"--equiv-profile=default --equiv-modes=eager --equiv-devices=cpu " \
           f"--equiv-max-examples=3 --equiv-seed={seed}" in out


def test_ci_profile_is_derandomized_and_says_so(project):
    """--equiv-profile=ci: the header says derandomized and reproduce flags carry no seed."""
    result = project.runpytest_inprocess("--equiv-profile=ci", "--equiv-modes=eager",
                                         "--equiv-max-examples=3", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "equiv: profile=ci modes=eager devices=cpu max_examples=3 derandomized",
        "Reproduce in pytest: pytest 'test_kernels.py::scale_stale[[]eager-cpu[]]' "
        "--equiv-profile=ci --equiv-modes=eager --equiv-devices=cpu --equiv-max-examples=3",
    ])


def test_k_selects_by_the_variable_name_and_by_the_item_name(project):
    """-k matches the name tests_for was bound to, and the spec[mode-device] id."""
    project.runpytest_inprocess("-k", "test_kernels", *FAST).assert_outcomes(
        passed=1, failed=1)
    project.runpytest_inprocess("-k", "relu_[eager-cpu]", *FAST).assert_outcomes(passed=1)


def test_equiv_module_option_collects_specs_without_a_test_module(pytester):
    """--equiv-module names a module; its specs become items with the module as node id."""
    pytester.makepyfile(kernels=KERNELS)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("--equiv-module=kernels", "-v", *FAST)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "kernels::relu_[[]eager-cpu[]] PASSED*",
        "kernels::scale_stale[[]eager-cpu[]] FAILED*",
        "Reproduce in pytest: pytest --equiv-module=kernels -k 'scale_stale[[]eager-cpu[]]' *",
    ])


def test_equiv_modules_ini_setting(pytester):
    """The ini setting equiv_modules works like --equiv-module."""
    pytester.makepyfile(kernels=KERNELS)
    pytester.makeini("[pytest]\nequiv_modules = kernels\n")
    pytester.syspathinsert()
    pytester.runpytest_inprocess(*FAST).assert_outcomes(passed=1, failed=1)


def test_equiv_module_that_fails_to_import_is_a_usage_error_with_its_traceback(pytester):
    """An import error names the option and shows the module's own traceback."""
    pytester.makepyfile(broken="import torch\nraise RuntimeError('kaboom in broken.py')\n")
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("--equiv-module=broken", *FAST)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: --equiv-module=broken: importing it failed:",
        "*broken.py*line 2*",
        "RuntimeError: kaboom in broken.py",
    ])


@pytest.mark.parametrize("args, message", [
    (("--equiv-profile=nope",), "ERROR: --equiv-profile=nope: no equiv settings profile named "
                                "'nope'; registered: [[]'ci', 'default', 'thorough'[]]*"),
    (("--equiv-modes=eager,,x",), "ERROR: --equiv-modes='eager,,x': give a comma-separated "
                                  "list with no empty entries*"),
    (("--equiv-max-examples=0",), "ERROR: --equiv-max-examples=0: give a positive integer."),
])
def test_bad_options_are_usage_errors_naming_the_option(project, args, message):
    """A bad option value stops the run with a message naming the option and the fix."""
    result = project.runpytest_inprocess(*args, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_unknown_mode_fails_the_item_naming_the_option(project):
    """A mode the runner does not know fails each item with the runner's message."""
    result = project.runpytest_inprocess(*FAST, "--equiv-modes=nosuchmode", "-k", "relu_")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "unknown mode 'nosuchmode'*",
        "This item's mode and device come from --equiv-modes/--equiv-devices*",
    ])


def test_json_and_html_reports_have_one_result_per_item(project, tmp_path):
    """--equiv-report writes the versioned JSON document with each item's verdict;
    --equiv-html the page with the same rows."""
    path, page = tmp_path / "r.json", tmp_path / "r.html"
    project.runpytest_inprocess(f"--equiv-report={path}", f"--equiv-html={page}",
                                "--equiv-devices=cpu,cuda", *FAST)
    html = page.read_text()
    assert html.count("<tr><td><code>kernels.") == 4 and 'class="verdict fail"' in html
    doc = json.loads(path.read_text())
    assert doc["schema"] == "equiv.results/1"
    assert doc["tool"] == "pytest" and doc["seed"] == 123 and doc["max_examples"] == 3
    verdicts = {r["nodeid"]: r["verdict"] for r in doc["results"]}
    cuda = "pass" if CUDA else "skipped"
    assert verdicts == {
        "test_kernels.py::relu_[eager-cpu]": "pass",
        "test_kernels.py::relu_[eager-cuda]": cuda,
        "test_kernels.py::scale_stale[eager-cpu]": "fail",
        "test_kernels.py::scale_stale[eager-cuda]": "fail" if CUDA else "skipped",
    }
    stale = next(r for r in doc["results"] if r["nodeid"].startswith("test_kernels.py::scale"))
    assert {f["check"] for f in stale["findings"]} >= {"mutation", "gradients"}


def test_xdist_gives_the_same_verdicts_as_a_serial_run_with_the_controllers_seed(project,
                                                                               tmp_path):
    """pytest -n 2: the workers use the seed the controller printed, and the items, verdicts
    and findings equal a serial run's with that seed; one report is gathered from the workers."""
    serial, parallel = tmp_path / "serial.json", tmp_path / "parallel.json"
    result = project.runpytest_subprocess("-n", "2", f"--equiv-report={parallel}",
                                          "--equiv-modes=eager", "--equiv-max-examples=3",
                                          "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    header = [ln for ln in result.stdout.lines if ln.startswith("equiv: profile=")]
    assert header and header[0].startswith(
        "equiv: profile=default modes=eager devices=cpu max_examples=3 --equiv-seed="), header
    seed = int(header[0].rsplit("=", 1)[1])
    result.stdout.fnmatch_lines(["*MutationMismatch: argument 'w' was modified*",
                                 f"*--equiv-seed={seed}"])
    project.runpytest_inprocess(f"--equiv-report={serial}", "--equiv-modes=eager",
                                "--equiv-max-examples=3", f"--equiv-seed={seed}",
                                "-p", "no:cacheprovider")

    def verdicts(p):
        return {(r["nodeid"], r["verdict"], r["seed"],
                 tuple(sorted(f["check"] for f in r["findings"])))
                for r in json.loads(p.read_text())["results"]}

    assert verdicts(parallel) == verdicts(serial)
    assert {v[:3] for v in verdicts(serial)} == {
        ("test_kernels.py::relu_[eager-cpu]", "pass", seed),
        ("test_kernels.py::scale_stale[eager-cpu]", "fail", seed)}


def test_xdist_tx_and_dist_options_give_the_verdicts_of_a_serial_run(project, tmp_path):
    """--tx 2*popen --dist loadgroup (the transport --tx ssh=... uses across machines): the
    same items and verdicts as a serial run with the seed, one report from both workers."""
    report = tmp_path / "tx.json"
    result = project.runpytest_subprocess("--tx", "2*popen", "--dist", "loadgroup",
                                          f"--equiv-report={report}", "--equiv-modes=eager",
                                          "--equiv-devices=cpu", "--equiv-max-examples=3",
                                          "--equiv-seed=11", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*2 workers*"])
    rows = {r["nodeid"]: (r["verdict"], r["seed"],
                          "mutation" in {f["check"] for f in r["findings"]})
            for r in json.loads(report.read_text())["results"]}
    assert rows == {"test_kernels.py::relu_[eager-cpu]": ("pass", 11, False),
                    "test_kernels.py::scale_stale[eager-cpu]": ("fail", 11, True)}


def test_xdist_without_equiv_options_still_prints_the_seed_line(project):
    """The controller collects nothing and imports no equiv: the seed line comes at the end."""
    result = project.runpytest_subprocess("-n", "2", "-k", "not compile", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    lines = [ln for ln in result.stdout.lines if ln.startswith("equiv: profile=")]
    assert len(lines) == 1 and " --equiv-seed=" in lines[0], result.stdout.lines[-30:]


def test_findings_reports_and_results_pickle():
    """What crosses process boundaries (xdist) pickles: the failure, its report, findings."""
    import pickle

    import equiv
    from equiv._results import run_one

    namespace: dict = {}
    exec(compile(KERNELS, "kernels_pickle.py", "exec"), namespace)
    spec = namespace["scale_stale"].__equiv_spec__
    result = run_one(spec, "eager", "cpu", max_examples=3, seed=5)
    assert result.verdict == "fail"
    assert pickle.loads(pickle.dumps(result)) == result
    with pytest.raises(equiv.EquivalenceFailure) as info:
        result.report.raise_if_failed()
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and again.report == result.report
    assert str(again) == str(info.value)


def test_options_reach_check_calls_in_user_tests_and_are_undone_afterwards(pytester):
    """--equiv-max-examples applies to check() inside tests; explicit check() args beat it."""
    import equiv

    pytester.makepyfile(kernels=KERNELS, test_direct=textwrap.dedent('''
        import equiv
        from kernels import relu_

        def test_option_applies():
            assert equiv.settings.default().max_examples == 4
            assert "max_examples=4" in equiv.check(relu_).settings

        def test_check_argument_wins():
            assert "max_examples=2" in equiv.check(relu_, max_examples=2).settings
    '''))
    pytester.syspathinsert()
    before = equiv.settings.default()
    pytester.runpytest_inprocess("--equiv-max-examples=4", "-p", "no:cacheprovider"
                                 ).assert_outcomes(passed=2)
    assert equiv.settings.default() == before


def test_decorator_devices_win_over_the_option(pytester):
    """A spec whose decorator names devices gets items for those, whatever --equiv-devices says."""
    pytester.makepyfile(kernels=KERNELS + textwrap.dedent('''
        import equiv

        @equivalent_to(relu_ref, mutates={"x": "out"},
                       settings=equiv.settings(devices=("cpu", "cuda")))
        def relu_everywhere_(x):
            return x.clamp_(min=0)
    '''), test_kernels="from equiv.pytest import tests_for\n"
                       "from kernels import relu_everywhere_\n"
                       "test_it = tests_for(relu_everywhere_)\n")
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("--co", "-q", "--equiv-devices=cpu", *FAST)
    result.stdout.fnmatch_lines(["test_kernels.py::relu_everywhere_[[]eager-cpu[]]",
                                 "test_kernels.py::relu_everywhere_[[]eager-cuda[]]",
                                 "2 tests collected*"])


def test_tests_for_misuse_and_disabled_plugin(pytester):
    """tests_for() needs specs; with the plugin disabled pytest warns instead of passing."""
    import equiv
    from equiv.pytest import tests_for

    with pytest.raises(equiv.InvalidArgument, match=r"tests_for\(\) needs at least one"):
        tests_for()
    with pytest.raises(equiv.InvalidArgument, match="has no equiv spec"):
        tests_for(len)
    pytester.makepyfile(kernels=KERNELS, test_kernels=TEST_MODULE)
    pytester.syspathinsert()
    result = pytester.runpytest_inprocess("-p", "no:equiv", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(["*cannot collect 'test_kernels' because it is not a function*"])


# -- the plugin module imports nothing heavy --------------------------------------------------

def _heavy_modules_after_import(module: str) -> list[str]:
    code = (f"import json, sys, {module}; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'equiv'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def test_loading_the_plugin_module_imports_neither_torch_nor_equiv():
    """The pytest11 entry point module imports only the standard library and pytest."""
    assert _heavy_modules_after_import("_equiv_pytestplugin") == []


def test_the_heavy_import_probe_can_fail(tmp_path, monkeypatch):
    """The probe above reports a module that loads torch (here a stub standing in for it)."""
    (tmp_path / "loads_torch_stub.py").write_text(
        "import sys, types\nsys.modules['torch'] = types.ModuleType('torch')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert _heavy_modules_after_import("loads_torch_stub") == ["torch"]


UNRELATED = "import sys\n\ndef test_torch_not_loaded():\n    assert 'torch' not in sys.modules\n"


def test_an_unrelated_pytest_run_does_not_import_torch(pytester):
    """With equiv installed, a test run that does not use equiv never imports torch; a plugin
    that loads (a stand-in for) torch makes the same test fail, so the check can fail."""
    pytester.makepyfile(test_unrelated=UNRELATED)
    clean = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    clean.assert_outcomes(passed=1)
    assert "equiv-" in clean.stdout.str()  # the plugin was loaded (listed under plugins:)
    assert "equiv: profile=" not in clean.stdout.str()  # and stayed out of the way
    pytester.makepyfile(loads_torch_stub="import sys, types\n"
                                         "sys.modules['torch'] = types.ModuleType('torch')\n")
    forced = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "loads_torch_stub")
    forced.assert_outcomes(failed=1)


BIG_KERNEL = textwrap.dedent('''
    import torch
    from equiv import equivalent_to
    from equiv.pytest import tests_for

    def rowsum_ref(x):
        return x.sum(-1)

    @equivalent_to(rowsum_ref, variants=(), examples=[(torch.arange(5000.0).reshape(50, 100),)])
    def rowsum_large(x):
        return x.sum(-1) + bool((x > 4900).any()) * 1.0

    test_rowsum = tests_for(rowsum_large)
''')


def test_a_big_examples_file_is_written_beside_the_report(pytester, tmp_path):
    """--equiv-report: a storage over 4096 elements is saved beside the report, in the file
    the finding's code loads; after the session files go to the default folder again."""
    from equiv import _values

    pytester.makepyfile(test_big=BIG_KERNEL)
    pytester.syspathinsert()
    report = tmp_path / "out" / "r.json"
    report.parent.mkdir()
    pytester.runpytest_inprocess(f"--equiv-report={report}", *FAST)
    doc = json.loads(report.read_text())
    code = doc["results"][0]["findings"][0]["example"]["code"]
    saved = list(report.parent.glob("equiv-example-*.pt"))
    assert len(saved) == 1 and f"torch.load({str(saved[0])!r})" in code, code
    assert _values.directory().endswith("equiv-examples")
