"""`bench/megatron_compare.py` tiny on CPU: four runs per module set through megatron's own schedule.

Checks that every run has its row, that the three offloading runs are bit-identical to the run
without offload (losses and grads; CPU kernels are deterministic), each run in a process of its
own or all in one, that megatron-core 0.16.1's built-in offload and chunk-offload's default run
copy bytes, that a module megatron lacks gives one skip row, that a failed run is one row and exit
status 1, and that a bad flag is a usage error (exit status 2).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ._scripts import load_bench_script, run_bench_script


pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
)


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench_script("megatron_compare", *args)


def _megatron_copies_on_cpu() -> bool:
    import megatron.core

    return tuple(int(x) for x in megatron.core.__version__.split(".")[:2]) < (0, 19)


def test_four_runs_bit_identical(tmp_path) -> None:
    out = tmp_path / "compare.json"
    done = _run("--min-offload-bytes", "1", "--iterations", "2", "--warmup", "1",
                "--modules", "core_attn,qkv_linear", "--modules", "mlp_fc1", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    runs = {(r["modules"], r["run"]): r for r in rows}
    assert [r["run"] for r in rows] == ["none", "chunk-offload", "chunk-offload budget", "megatron"] * 2
    ran = [r for r in rows if "skipped" not in r]
    assert all(r["losses_identical"] and r["grads_identical"] for r in ran), done.stdout
    assert all(r["median_step_s"] > 0 and r["min_step_s"] <= r["median_step_s"] for r in ran)
    base = runs[("core_attn,qkv_linear", "none")]
    shared = runs[("mlp_fc1", "none")]  # the run without offload ran once, shown in both sets
    assert shared["same_run_as"] == "core_attn,qkv_linear" and shared["wall_s"] == base["wall_s"] and "same_run_as" not in base
    assert "none: one run, shown in every module set (it offloads nothing): the run of core_attn,qkv_linear" in done.stdout
    for r in ran:  # both overheads against 'none' of the same module set, and the collector's time per step
        none = runs[(r["modules"], "none")]
        assert r["overhead_min"] == r["min_step_s"] / none["min_step_s"] - 1 and r["gc_ms"] >= 0 and len(r["gc_collections"]) == 3
    assert base["overhead_min"] == 0 and "min ovh" in done.stdout and "gc ms: the garbage collector's time per step" in done.stdout
    modules = "core_attn,qkv_linear"
    # PP=1: every backward follows its forward; from the second iteration on the plan copies all
    # but each chunk's last group (NOTE [Kept tail]).
    default = runs[(modules, "chunk-offload")]
    assert 0 < default["bytes_copied"] and default["peak_bytes"] is not None
    # timed_reload_ahead="auto" on CPU streams: one group ahead (NOTE [Timed reload ahead by default]).
    assert {r.get("timed_reload_ahead") for r in ran if r["run"].startswith("chunk-offload")} == {False}
    assert "chunk-offload's reloads: one group ahead (timed_reload_ahead; by default timed on CUDA only)" in done.stdout
    budget = runs[(modules, "chunk-offload budget")]
    # Half the saved peak is below the lowest reachable peak here (each chunk's input stays on
    # device: NOTE [Storages held elsewhere]). The default's layer groups (both modules of a layer
    # under 16 MiB: one group per layer, two per chunk) lower no peak: the budget run splits them
    # (NOTE [Budget splits layer groups]) and copies, its last iteration peaks lower than the
    # default's, and with groups as fine as they go it still falls short: it says so, once.
    assert budget["bytes_copied"] > 0 and default["saved_peak_bytes"] > budget["saved_peak_bytes"] > budget["budget_bytes"]
    assert done.stderr.count(f"({budget['budget_bytes']} bytes) cannot be met: the lowest peak reachable is ") == 1, done.stderr
    megatron = runs[(modules, "megatron")]
    assert (megatron["bytes_copied"] > 0) == _megatron_copies_on_cpu()
    assert runs[("mlp_fc1", "megatron")]["skipped"].startswith("it has no offload module 'mlp_fc1'")
    skip_rows = [line for line in done.stdout.splitlines() if "skipped:" in line]
    assert len(skip_rows) == 1 and skip_rows[0].split()[:2] == ["mlp_fc1", "megatron"]
    assert "losses =" in done.stdout and "peak: CPU has no device allocator" in done.stdout
    # Issue 26's reading: each chunk-offload run's overheads over megatron's of its set (megatron copies here: 0.16).
    for r in ran:
        against = r.get("vs_megatron")
        assert (against is not None) == (r["run"].startswith("chunk-offload") and r["modules"] == modules), r["run"]
        if against is not None and megatron["overhead"] > 0:
            assert against["overhead"] == r["overhead"] / megatron["overhead"] and against["peak_at_or_below"] is None
            assert f"{modules} / {r['run']}: overhead {against['overhead']:.2f}x megatron's (fastest step " in done.stdout
    # On CPU chunk-offload copies inline, as megatron's built-in does (NOTE [Copies on CPU]).
    assert "chunk-offload's copies on CPU: inline on the calling thread, as megatron copies on CPU" in done.stdout
    # Each run in a process of its own (the default): nothing an earlier run left, its whole process timed.
    assert "each run in a process of its own" in done.stdout
    assert all(r["left_bytes"] == 0 and r["process_s"] > r["wall_s"] for r in ran if "same_run_as" not in r)


def test_reload_ahead_and_module_groups_add_bit_identical_runs_and_every_run_times_its_reloads_when_asked(tmp_path) -> None:
    """``--timed-reload-ahead`` alone is ``on``: every chunk-offload run's reloads ahead by its timing
    (on CPU streams the default, ``auto``, leaves them one group ahead: the other tests' runs)."""
    out = tmp_path / "compare.json"
    done = _run("--min-offload-bytes", "1", "--iterations", "2", "--warmup", "1", "--modules", "core_attn,qkv_linear",
                "--reload-ahead-bytes", "1048576", "--timed-reload-ahead", "--module-groups", "--processes", "one", "--cpu-copies", "threads",
                "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    runs = ["none", "chunk-offload", "chunk-offload budget", "chunk-offload reload-ahead", "chunk-offload module", "megatron"]
    assert [r["run"] for r in rows] == runs
    assert [r["timed_reload_ahead"] for r in rows] == [None, True, True, True, True, None]
    for ahead in rows[3:5]:
        assert ahead["losses_identical"] and ahead["grads_identical"] and ahead["bytes_copied"] > 0, ahead["run"]
    assert "chunk-offload's reloads: ahead by the last iteration's copy timing (timed_reload_ahead" in done.stdout
    assert "chunk-offload reload-ahead" in done.stdout and "wait ms" in done.stdout
    assert "chunk-offload module" in done.stdout and "every run in one process" in done.stdout
    assert "chunk-offload's copies on CPU: on its CPU streams worker threads (--cpu-copies" in done.stdout
    assert all("process_s" not in r for r in rows)


def test_none_again_runs_the_baseline_last_and_overheads_are_over_both(tmp_path) -> None:
    out = tmp_path / "compare.json"
    done = _run("--min-offload-bytes", "1", "--iterations", "2", "--warmup", "1", "--modules", "core_attn,qkv_linear",
                "--none-again", "--processes", "one", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == ["none", "chunk-offload", "chunk-offload budget", "megatron", "none again"]
    first, again = rows[0], rows[-1]
    median = (first["median_step_s"] + again["median_step_s"]) / 2
    fastest = min(first["min_step_s"], again["min_step_s"])
    for r in rows:
        assert r["overhead"] == r["median_step_s"] / median - 1 and r["overhead_min"] == r["min_step_s"] / fastest - 1, r["run"]
    assert again["losses_identical"] and again["grads_identical"] and again["bytes_copied"] == 0
    assert "with 'none again': over the mean of both medians" in done.stdout


@pytest.mark.parametrize("processes", ["per-run", "one"])
def test_profile_gives_each_engine_its_host_time(tmp_path, processes: str) -> None:
    """In its own process a run is profiled after its timed steps; in one process each run is built again."""
    out = tmp_path / "compare.json"
    done = _run("--min-offload-bytes", "1", "--iterations", "1", "--warmup", "1", "--modules", "core_attn,qkv_linear",
                "--profile", "2", "--processes", processes, "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    runs = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert "engine_host_ms" not in runs["none"] and "host_added_s" not in runs["none"]
    for run in ("chunk-offload", "chunk-offload budget", "megatron"):
        assert runs[run]["engine_host_ms"] > 0, run
        assert len(runs[run]["host_added_s"]) == 15, run
        assert f"core_attn,qkv_linear / {run}: engine " in done.stdout
        assert runs[run]["cuda_api_added"] == {}, run  # torch.profiler counts CUDA API calls on CUDA only
    assert "CUDA API calls (torch.profiler): none without CUDA" in done.stdout
    assert runs["chunk-offload"]["losses_identical"] and runs["chunk-offload"]["grads_identical"]
    # A run's wall time is that of its timed steps, its profile not included.
    assert all(r["wall_s"] > 0 and r["left_bytes"] == 0 for r in runs.values())
    assert done.stdout.index("core_attn,qkv_linear  megatron") < done.stdout.index("host profile")


def test_profiles_take_each_sets_none_first_and_megatrons_second(monkeypatch) -> None:
    """Whatever a profiler leaves in the process counts against chunk-offload's runs, never for them."""
    bench = load_bench_script("megatron_compare")
    profiled = []

    def profile_run(args, shape, modules, run, budget, *, measure, profile_steps):
        assert not measure and profile_steps == 3
        profiled.append((",".join(modules), run))
        return {"_profile": ({}, 1.0), "_api": {}}

    monkeypatch.setattr(bench, "run_once", profile_run)
    runs = ["none", "chunk-offload", "chunk-offload budget", "megatron", "none again"]
    rows = [{"modules": m, "run": r, "budget_bytes": None} for m in ("b", "a") for r in runs]
    rows[8] = {"modules": "a", "run": "megatron", "skipped": "not here"}
    rows[5]["same_run_as"] = "b"  # set a shows set b's run without offload: profiled once
    bench._add_profiles(bench._Runs(SimpleNamespace(profile=3), None, None), rows)
    assert profiled == [("b", "none"), ("b", "megatron"), ("b", "chunk-offload"), ("b", "chunk-offload budget"),
                        ("a", "chunk-offload"), ("a", "chunk-offload budget")]  # fmt: skip
    assert all(r["engine_host_ms"] == 1e3 for r in rows if r["run"] not in ("none", "none again") and "skipped" not in r)
    assert rows[5]["_profile"] is rows[0]["_profile"]


def test_each_finished_set_is_in_the_json_before_the_next_one_runs(tmp_path, monkeypatch) -> None:
    """A run stopped during its second module set (a time limit) leaves the first set's rows."""
    bench = load_bench_script("megatron_compare")
    out = tmp_path / "compare.json"
    calls = []

    def module_set(runs, modules, none=None):
        calls.append(",".join(modules))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run stops during its second set
        return [{"modules": calls[-1], "run": "none", "_losses": []}]

    monkeypatch.setattr(bench, "_module_set", module_set)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--modules", "core_attn", "--modules", "qkv_linear", "--processes", "one", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["rows"] == [{"modules": "core_attn", "run": "none"}]


def test_each_run_is_in_the_json_as_soon_as_it_ends(tmp_path, monkeypatch) -> None:
    """A time limit that stops the comparison during a run leaves every run that ended before it."""
    bench = load_bench_script("megatron_compare")
    calls = []

    def in_own_process(function, args, shape, modules, run, budget, base_file, is_base):
        calls.append(run)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the limit: during the third run
        return {"run": run, "modules": ",".join(modules), "peak_bytes": None, "median_step_s": 0.2, "min_step_s": 0.1,
                "saved_peak_bytes": 8, "_losses": [torch.zeros(1)], **({} if is_base else {"grads_identical": True})}  # fmt: skip

    monkeypatch.setattr(bench, "in_own_process", in_own_process)
    out = tmp_path / "compare.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--modules", "core_attn", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] is False and [r["run"] for r in data["rows"]] == calls[:2] == ["none", "megatron"]
    assert data["rows"][1]["losses_identical"] and "_losses" not in data["rows"][1]


def test_a_failed_run_is_one_row_the_others_run_and_the_exit_status_is_1(tmp_path, monkeypatch, capsys) -> None:
    """A run whose process raises (or ends without an answer) is a ``failed`` row, not the end of the comparison."""
    bench = load_bench_script("megatron_compare")
    calls = []

    def in_own_process(function, args, shape, modules, run, budget, base_file, is_base):
        # Only the run without offload saves its grads (for the others to compare theirs with).
        assert is_base == (run == "none") and base_file.name == "grads-none.pt"
        calls.append(run)
        if run == "megatron":
            raise bench.RunFailed("OutOfMemoryError: CUDA out of memory")
        return {"run": run, "modules": ",".join(modules), "peak_bytes": None, "median_step_s": 0.2, "min_step_s": 0.1,
                "bytes_copied": 0, "compute_wait_ms": None, "gc_ms": 0.0, "saved_peak_bytes": 8, "_losses": [torch.zeros(1)],
                "budget_bytes": budget, "left_bytes": 0, "wall_s": 1.0, **({} if is_base else {"grads_identical": True})}  # fmt: skip

    monkeypatch.setattr(bench, "in_own_process", in_own_process)
    out = tmp_path / "compare.json"
    assert bench.main(["--modules", "core_attn", "--json", str(out)]) == 1
    assert calls == ["none", "megatron", "chunk-offload", "chunk-offload budget"]
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["megatron"] == {"run": "megatron", "modules": "core_attn", "failed": "OutOfMemoryError: CUDA out of memory"}
    assert rows["chunk-offload"]["grads_identical"] and rows["chunk-offload budget"]["budget_bytes"] == 4  # half its saved peak
    captured = capsys.readouterr()
    assert "core_attn  megatron              failed: OutOfMemoryError: CUDA out of memory" in captured.out
    assert "core_attn / megatron failed: OutOfMemoryError: CUDA out of memory" in captured.err


def test_a_set_whose_run_without_offload_failed_stops_there() -> None:
    bench = load_bench_script("megatron_compare")

    class Runs:
        args = bench.parse_args(["--modules", "core_attn"])

        def compared(self, modules, run, budget, base):
            assert run == "none" and base is None
            return {"run": run, "modules": ",".join(modules), "failed": "RuntimeError: no device"}

    assert bench._module_set(Runs(), ["core_attn"]) == [{"run": "none", "modules": "core_attn", "failed": "RuntimeError: no device"}]


def test_deterministic_runs_say_so_under_the_table(tmp_path) -> None:
    out = tmp_path / "compare.json"
    done = _run("--min-offload-bytes", "1", "--iterations", "1", "--warmup", "1", "--modules", "core_attn,qkv_linear",
                "--deterministic", "--processes", "one", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert data["args"]["deterministic"] is True and data["complete"] is True
    assert all(r["losses_identical"] and r["grads_identical"] for r in data["rows"] if "skipped" not in r)
    assert "torch.equal against 'none' (deterministic kernels, --deterministic: a difference is the offload's)" in done.stdout


def test_memory_left_by_earlier_runs_is_named_under_the_table() -> None:
    text = load_bench_script("megatron_compare")  # its table's text (bench/_compare_text.py)
    row = {"modules": "core_attn", "peak_bytes": 2 * 10**9, "median_step_s": 0.2, "min_step_s": 0.1, "overhead": 0.0,
           "overhead_min": 0.0, "bytes_copied": 0, "losses_identical": True, "grads_identical": True,
           "compute_wait_ms": None, "gc_ms": 0.0}  # fmt: skip
    rows = [{**row, "run": "none", "left_bytes": 0}, {**row, "run": "chunk-offload", "left_bytes": 7_560_000_000}]
    table = text.format_table(rows, "cuda")
    assert ("left allocated by the runs before (GB; taken off that run's peak and added to its budget): "
            "core_attn / chunk-offload 7.56") in table  # fmt: skip
    assert "left allocated" not in text.format_table(rows[:1], "cuda")


@pytest.mark.parametrize(
    ("flag", "message"),
    [("--no-such-flag", "unrecognized arguments: --no-such-flag"), ("--none-again=yes", "argument --none-again: ignored explicit argument 'yes'"),
     ("--deterministic=yes", "argument --deterministic: ignored explicit argument 'yes'"),
     ("--processes=two", "argument --processes: invalid choice: 'two' (choose from 'per-run', 'one')"),
     ("--timed-reload-ahead=yes", "argument --timed-reload-ahead: invalid choice: 'yes' (choose from 'auto', 'off', 'on')"),
     ("--cpu-copies=async", "argument --cpu-copies: invalid choice: 'async' (choose from 'inline', 'threads')")],  # fmt: skip
)
def test_bad_flag_exits_2(flag: str, message: str) -> None:
    done = _run(flag)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "0"], "--layers must be an integer >= 1, got 0"),
        (["--modules", "mlp_fc2"], "--modules: chunk_offload: unknown offload module 'mlp_fc2'"),
        (["--warmup", "0"], "--warmup must be an integer >= 1"),
        (["--hidden", "30", "--heads", "4"], "--hidden must be divisible by --heads (4), got 30"),
        (["--budget-bytes", "-1"], "--budget-bytes must be an integer >= 0, got -1"),
        (["--reload-ahead-bytes", "-5"], "--reload-ahead-bytes must be an integer >= 0, got -5"),
        (["--reload-ahead-bytes", "lots"], "argument --reload-ahead-bytes: invalid int value: 'lots'"),
        (["--profile", "-1"], "--profile must be an integer >= 0, got -1"),
        (["--processes", "two"], "argument --processes: invalid choice: 'two' (choose from"),
        (["--cpu-copies", "async"], "argument --cpu-copies: invalid choice: 'async' (choose from"),
    ],
)
def test_usage_errors(capsys, argv: list[str], message: str) -> None:
    bench = load_bench_script("megatron_compare")
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_run_in_its_own_process_compares_its_grads_with_the_run_without_offloads(tmp_path, monkeypatch) -> None:
    """`run_alone`: the run without offload saves its grads; each other run answers whether its own
    equal them, bit for bit and name for name."""
    load_bench_script("megatron_compare")
    compare_run = sys.modules["_compare_run"]
    grads = {"w": torch.ones(3), "b": torch.zeros(2)}
    monkeypatch.setattr(compare_run, "run_once", lambda *args, check_grads, **kwargs: check_grads(dict(grads)))
    base, args = tmp_path / "grads-none.pt", SimpleNamespace(profile=0)
    assert compare_run.run_alone(args, None, [], "none", None, base, True) == {} and base.exists()
    assert compare_run.run_alone(args, None, [], "chunk-offload", None, base, False) == {"grads_identical": True}
    grads["w"] = torch.tensor([1.0, 1.0, float.fromhex("0x1.000002p+0")])  # one ulp off in one element
    assert compare_run.run_alone(args, None, [], "chunk-offload", None, base, False) == {"grads_identical": False}
    grads["w"] = torch.ones(3)
    del grads["b"]
    assert compare_run.run_alone(args, None, [], "chunk-offload", None, base, False) == {"grads_identical": False}
