"""`bench/overhead.py` with tiny sizes: every mode timed, the ratios to the floor and to bookkeeping printed.

The figures themselves depend on the host; the test checks that each mode ran (one row per
mode, times > 0), that the floor costs something over plain autograd (it adds hooks and a
node per group), and that each printed ratio is the quotient of the printed per-group costs.
"""

from __future__ import annotations

import re
import subprocess

from ._scripts import run_bench_script

_NUMBER = r"(-?[0-9.]+|nan|inf)"
MODES = ("plain", "floor", "bookkeeping", "offload", "offload_layer", "offload_inline", "offload_unslabbed", "offload_timed")


def _run(*args: str) -> subprocess.CompletedProcess:
    return run_bench_script("overhead", *args)


def test_prints_every_mode_and_the_ratios_to_the_floor() -> None:
    done = _run("--layers", "12", "--repeats", "5", "--hidden", "8", "--batch", "2")
    assert done.returncode == 0, done.stderr
    rows = {}
    for mode in MODES:
        match = re.search(rf"^{mode}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}\s+{_NUMBER}$", done.stdout, re.M)
        assert match, f"no row for {mode}:\n{done.stdout}"
        rows[mode] = [float(v) for v in match.groups()]
        assert rows[mode][0] > 0 and rows[mode][2] > 0, (mode, rows[mode])
    assert rows["plain"][1] == rows["plain"][3] == 0.0
    assert rows["floor"][3] > 0, f"the floor costs nothing over plain autograd:\n{done.stdout}"
    for label, mode in (("bookkeeping", "bookkeeping"), ("copies", "offload")):
        match = re.search(rf"^{label} / floor \(us/group over plain\): {_NUMBER} fastest, {_NUMBER} median$", done.stdout, re.M)
        assert match, f"no {label} / floor line:\n{done.stdout}"
        fastest, median = (float(v) for v in match.groups())
        # The printed ratio is the quotient of the printed per-group costs (2 decimals each).
        expected = rows[mode][3] / rows["floor"][3]
        assert abs(fastest - expected) <= 0.01 + 0.01 * expected, (label, fastest, expected)
        if rows["floor"][1] > 0:
            expected_median = rows[mode][1] / rows["floor"][1]
            assert abs(median - expected_median) <= 0.01 + 0.01 * abs(expected_median), (label, median, expected_median)
    for mode in ("offload", "offload_layer", "offload_inline", "offload_unslabbed", "offload_timed"):
        match = re.search(rf"^{mode} / bookkeeping \(us/group over plain\): {_NUMBER} fastest, {_NUMBER} median$", done.stdout, re.M)
        assert match, f"no {mode} / bookkeeping line:\n{done.stdout}"
        if rows["bookkeeping"][3] > 0:
            expected = rows[mode][3] / rows["bookkeeping"][3]
            assert abs(float(match.group(1)) - expected) <= 0.01 + 0.01 * abs(expected), (mode, match.group(1), expected)
    differences = (("copy streams' machinery", "offload", "offload_inline"), ("group slabs' saving", "offload_unslabbed", "offload"),
                   ("timing", "offload_timed", "offload"))  # fmt: skip
    for label, more, less in differences:
        added = re.search(rf"^{label} \({more} - {less}, us/group\): {_NUMBER} fastest, {_NUMBER} median$", done.stdout, re.M)
        assert added, done.stdout
        # The printed difference is that of the printed per-group costs (2 decimals each).
        assert abs(float(added.group(1)) - (rows[more][3] - rows[less][3])) <= 0.011, added.group(0)
        assert abs(float(added.group(2)) - (rows[more][1] - rows[less][1])) <= 0.011, added.group(0)
    # 12 modules in layers of 5 (the default): 3 layer groups for 12 module groups.
    assert re.search(r"^tensors offloaded per group: [0-9.]+; offload_layer: 0.25 groups per module group$", done.stdout, re.M), done.stdout
    cyclic = re.search(r"^objects left in reference cycles per group and iteration \(freed only by the garbage collector\): "
                       + ", ".join(rf"{mode} {_NUMBER}" for mode in MODES) + "$",
                       done.stdout, re.M)  # fmt: skip
    assert cyclic, done.stdout
    # Autograd alone leaves none, and neither does the engine: a released group lets go of its
    # storages and copy events, and the groups of a released handler forget it (NOTE [No cycles per iteration]).
    assert [float(v) for v in cyclic.groups()] == [0.0] * len(MODES), done.stdout


def test_bad_argument_is_a_usage_error() -> None:
    done = _run("--layers", "0")
    assert done.returncode == 2
    assert "--layers: must be an integer >= 1, got '0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_modules_per_layer_below_one_is_a_usage_error() -> None:
    done = _run("--modules-per-layer", "0")
    assert done.returncode == 2
    assert "--modules-per-layer: must be an integer >= 1, got '0'" in done.stderr
    assert "Traceback" not in done.stderr


def test_negative_profile_is_a_usage_error() -> None:
    done = _run("--profile", "-1")
    assert done.returncode == 2
    assert "--profile: must be an integer >= 0, got -1" in done.stderr
    assert "Traceback" not in done.stderr


def test_profile_prints_host_time_per_group() -> None:
    done = _run("--layers", "6", "--repeats", "2", "--hidden", "8", "--batch", "2", "--profile", "2")
    assert done.returncode == 0, done.stderr
    # On CPU the inline streams' path: the engine's own, without worker threads taking the GIL mid-call.
    assert ("profile of the offload_inline mode over bookkeeping, 2 iterations each: the own host time per group (us) and calls "
            "per group that the copies add, by function") in done.stdout  # fmt: skip
    # Only the offload mode copies: each group's one launch to host is a call the copies add.
    rows = [line.split() for line in done.stdout.splitlines() if line.rstrip().endswith(")") and " copy_to_host (copies.py:" in line]
    assert len(rows) == 1 and rows[0][1] == "1.00", done.stdout
    assert "CUDA API calls (torch.profiler): none without CUDA" in done.stdout  # torch.profiler's part runs on CUDA only
