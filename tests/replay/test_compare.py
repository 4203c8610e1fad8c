"""``--compare megatron``: one stage three ways (no offload, chunk-offload, megatron-core's built-in).

On CPU, at tiny size:

- the three modes' losses and every parameter gradient are bit-identical (`torch.equal`), on a
  last stage (losses) and on an interleaved first stage (grads, received-activation path);
- megatron-core 0.16.1's offload really copies (bytes > 0); 0.19.2 manages CUDA tensors only and
  copies nothing on CPU, which the table says;
- the table and the JSON name the three modes;
- where megatron's path cannot run (a module it does not have, or a reason passed in), one line
  says so and why, and the other two modes still run;
- the Transformer Engine stand-in is bound only while megatron's path runs.
"""

from __future__ import annotations

import pytest
import torch

from chunk_offload import OffloadConfig
from chunk_offload.devkit.gpt import GPTShape
from chunk_offload.replay.compare import HOST_ROWS

from ._common import needs_megatron_on_cpu, run_cli

pytestmark = needs_megatron_on_cpu

_SHAPE = GPTShape(
    num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, micro_batch_size=2, attention="sdpa"
)


def _megatron_copies_on_cpu() -> bool:
    import megatron.core

    return tuple(int(x) for x in megatron.core.__version__.split(".")[:2]) < (0, 19)


# core_attn alone on the interleaved stage: megatron-core 0.19.2 (on CPU) fails its own
# "Chunk mismatch" assert there with core_attn,qkv_linear, which the skip line then reports.
@pytest.mark.parametrize(
    ("pp", "stage", "vp", "modules"),
    [(2, 1, 1, "core_attn,qkv_linear"), (2, 0, 2, "core_attn")],
    ids=["pp2_last_stage", "pp2_vpp2_stage0"],
)
def test_three_modes_bit_identical(pp: int, stage: int, vp: int, modules: str) -> None:
    import megatron.core.extensions.transformer_engine as te_ext

    from chunk_offload.replay.compare import compare_with_megatron

    before = te_ext.cpu_offload
    comparison = compare_with_megatron(
        _SHAPE, pp_size=pp, pp_rank=stage, vp_size=vp, modules=modules, num_microbatches=4, config=OffloadConfig(min_offload_bytes=1)
    )
    assert te_ext.cpu_offload is before  # the stand-in is gone again

    assert comparison.skipped is None and comparison.builtin is not None
    base, chunk, builtin = comparison.replay.baseline, comparison.replay.offload, comparison.builtin
    last_stage = stage == pp - 1
    assert len(base.losses) == len(builtin.losses) == (4 if last_stage else 0)
    assert all(torch.equal(a, b) for a, b in zip(base.losses, builtin.losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(base.losses, chunk.losses, strict=True))
    assert base.grads.keys() == builtin.grads.keys() == chunk.grads.keys()
    assert sum(int(g.count_nonzero()) for g in base.grads.values()) > 0
    differing = [k for k in base.grads if not (torch.equal(base.grads[k], builtin.grads[k]) and torch.equal(base.grads[k], chunk.grads[k]))]
    assert not differing

    modes = comparison.summary()["modes"]
    assert list(modes) == ["none", "chunk_offload", "megatron"]
    for mode in ("chunk_offload", "megatron"):
        assert modes[mode]["grads"] is True
        assert modes[mode]["losses"] is (True if last_stage else None)
    if _megatron_copies_on_cpu():
        assert modes["megatron"]["bytes_offloaded"] > 0
    else:
        assert modes["megatron"]["bytes_offloaded"] == 0
        assert "copied nothing on CPU" in comparison.format()
    if not last_stage:
        assert modes["chunk_offload"]["bytes_offloaded"] > 0
    table = comparison.format()
    assert "no offload" in table and "chunk-offload" in table and "megatron " in table
    assert "skipped" not in table


def test_cli_compare_writes_three_modes(tmp_path, capsys) -> None:
    printed, summary = run_cli(capsys, tmp_path / "compare.json", "--pp", "2", "--stage", "1", "--compare", "megatron")
    assert list(summary["modes"]) == ["none", "chunk_offload", "megatron"]
    assert summary["modes"]["megatron"]["losses"] is True and summary["modes"]["megatron"]["grads"] is True
    assert summary["args"]["compare"] == "megatron" and summary["replay"]["stage"] == "stage 1 of 2"
    assert "losses bit-identical" in printed and "megatron " in printed


def test_cli_compare_on_deterministic_kernels_says_so_and_restores_torchs_setting(tmp_path, capsys) -> None:
    """``--deterministic``: every mode on deterministic kernels (on CPU they are already), one line
    under the table, and torch's setting as it was once the replay returns."""
    from chunk_offload.replay.__main__ import DETERMINISTIC_LINE

    assert not torch.are_deterministic_algorithms_enabled()
    printed, summary = run_cli(capsys, tmp_path / "compare.json", "--pp", "2", "--stage", "1", "--compare", "megatron", "--deterministic")
    assert summary["args"]["deterministic"] is True and printed.rstrip().endswith(DETERMINISTIC_LINE)
    assert all(summary["modes"][mode]["losses"] and summary["modes"][mode]["grads"] for mode in ("chunk_offload", "megatron"))
    assert not torch.are_deterministic_algorithms_enabled()


def test_cli_compare_with_a_budget_writes_four_modes(tmp_path, capsys) -> None:
    """Each chunk-offload run gets its own simulated link (a manager closes its streams)."""
    printed, summary = run_cli(
        capsys, tmp_path / "compare.json", "--pp", "2", "--stage", "0", "--compare", "megatron", "--budget-bytes", "40KiB", "--link-gbps", "1"
    )
    assert list(summary["modes"]) == ["none", "chunk_offload", "megatron", "chunk_offload_budget"]
    under = summary["modes"]["chunk_offload_budget"]
    assert summary["args"]["budget_bytes"] == under["budget_bytes"] == 40 << 10 and under["grads"] is True
    assert under["peak_bytes"] <= 40 << 10 and "chunk-offload budget: device budget 0.04 MiB" in printed
    # One profiled iteration per mode by default: every engine's host time, per iteration and per group.
    groups = summary["groups_per_iteration"]
    assert groups == 4 * 2  # 4 microbatches x the stage's 2 layers x one module (core_attn)
    row = next(line for line in printed.splitlines() if line.startswith("host time / group (us)")).split()[6:]
    for mode, cell in zip(("chunk_offload", "megatron", "chunk_offload_budget"), row, strict=True):
        fields = summary["modes"][mode]
        assert fields["host_engine_s"] > 0 and fields["host_us_per_group"] == fields["host_engine_s"] * 1e6 / groups
        assert cell == f"{fields['host_us_per_group']:.1f}"
        # The heaviest functions, each at most the engine's whole time, listed in the printout.
        assert 0 < len(fields["host_functions"]) <= HOST_ROWS
        assert all(0 <= float(line.split()[0]) <= fields["host_us_per_group"] for line in fields["host_functions"])
        assert "\n".join(fields["host_functions"]) in printed
    assert "fine_grained_activation_offload.py" in "".join(summary["modes"]["megatron"]["host_functions"])
    assert any(".py:" in line for line in summary["modes"]["chunk_offload"]["host_functions"])  # its own code, by file:line
    assert f"over the {groups} groups chunk-offload tracks per iteration, for each engine alike" in printed


def test_without_profiled_iterations_no_host_time_is_shown(tmp_path, capsys) -> None:
    printed, summary = run_cli(
        capsys, tmp_path / "compare.json", "--pp", "2", "--stage", "0", "--compare", "megatron", "--host-profile-iterations", "0"
    )
    assert not any("host_engine_s" in fields or "host_us_per_group" in fields or "host_functions" in fields for fields in summary["modes"].values())
    assert "host time / group (us)" in printed and "host time / group:" not in printed
    assert next(line for line in printed.splitlines() if line.startswith("host time / group (us)")).split()[6:] == ["n/a", "n/a"]


@pytest.mark.parametrize(
    ("modules", "skip", "line"),
    [
        ("mlp_fc1,core_attn", None, "megatron-core built-in offload: skipped: it has no offload module 'mlp_fc1'"),
        ("core_attn", "simulated: unsupported schedule", "megatron-core built-in offload: skipped: simulated: unsupported schedule"),
    ],
    ids=["module_megatron_lacks", "reason_given"],
)
def test_skip_line_and_the_rest_runs(modules: str, skip: str | None, line: str) -> None:
    from chunk_offload.replay.compare import compare_with_megatron

    comparison = compare_with_megatron(
        _SHAPE, pp_size=2, pp_rank=0, modules=modules, num_microbatches=4, config=OffloadConfig(min_offload_bytes=1), skip_builtin=skip
    )
    assert comparison.builtin is None
    table = comparison.format()
    assert [row for row in table.splitlines() if "skipped" in row] == [line + table.split(line, 1)[1].split("\n")[0]]
    assert "megatron 0." not in table  # no third column
    summary = comparison.summary()
    assert list(summary["modes"]) == ["none", "chunk_offload", "megatron"]
    assert summary["modes"]["megatron"] == {"skipped": comparison.skipped}
    assert summary["modes"]["chunk_offload"]["grads"] is True
    assert summary["modes"]["chunk_offload"]["bytes_offloaded"] > 0


def test_cli_compare_usage_error(capsys) -> None:
    from chunk_offload.replay.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--pp", "2", "--stage", "0", "--modules", "core_attn", "--compare", "te"])
    assert exit_info.value.code == 2
    assert "argument --compare: invalid choice: 'te'" in capsys.readouterr().err


def test_budget_mode_trains_under_the_budget_bit_identical() -> None:
    """``budget_bytes``: a fourth build trains under the device budget (halfway between the
    stage's peaks without offload and with the default offload): its peak stays within the
    budget, above the default's, with fewer bytes copied, and its grads equal the run without
    offload; the table and the JSON name the fourth mode. Module groups (one per offload module
    call): the default's layer groups, one per layer here, leave the budget no choice between
    the peaks."""
    from chunk_offload.replay.compare import compare_with_megatron

    config = OffloadConfig(min_offload_bytes=1, group_by="module")
    run = dict(pp_size=2, pp_rank=0, modules="core_attn,qkv_linear", num_microbatches=4, config=config)
    plain = compare_with_megatron(_SHAPE, **run, skip_builtin="not needed here")
    budget = (plain.replay.baseline.peak_bytes + plain.replay.offload.peak_bytes) // 2
    comparison = compare_with_megatron(_SHAPE, **run, budget_bytes=budget)
    modes = comparison.summary()["modes"]
    assert list(modes) == ["none", "chunk_offload", "megatron", "chunk_offload_budget"]
    under = modes["chunk_offload_budget"]
    assert under["budget_bytes"] == budget and under["budget_fits"] is True and under["grads"] is True
    assert modes["chunk_offload"]["peak_bytes"] < under["peak_bytes"] <= budget < modes["none"]["peak_bytes"]
    assert 0 < under["bytes_offloaded"] < modes["chunk_offload"]["bytes_offloaded"]
    assert under["drop_bytes"] == modes["none"]["peak_bytes"] - under["peak_bytes"] and under["R"] == 1.0
    assert sum(under["offloaded_groups"].values()) > 0
    table = comparison.format()
    assert "chunk-offload budget" in table.splitlines()[1]
    assert f"chunk-offload budget: device budget {budget / (1 << 20):.2f} MiB, predicted to fit, measured peak " in table


def test_what_earlier_builds_left_comes_off_the_peaks_and_onto_the_budget(monkeypatch) -> None:
    """On CUDA a build can find device memory still allocated by the builds before it (the H200
    run of 2026-11-27): each later build's peak and budget are taken over what it found. Here the
    device memory left is a stand-in (0 at the first build, then 1 and 3 MiB)."""
    from chunk_offload.replay import compare

    left = iter([0, 1 << 20, 3 << 20])
    monkeypatch.setattr(compare, "device_bytes_left", lambda: next(left))
    given, real = [], compare.replay_under_budget

    def under_budget(*args, device_budget_bytes: int, **kwargs):
        given.append(device_budget_bytes)
        return real(*args, device_budget_bytes=device_budget_bytes, **kwargs)

    monkeypatch.setattr(compare, "replay_under_budget", under_budget)
    budget = 64 << 20
    comparison = compare.compare_with_megatron(_SHAPE, pp_size=2, pp_rank=0, modules="core_attn", num_microbatches=4, budget_bytes=budget)
    assert comparison.left_bytes == {"megatron": 1 << 20, "chunk_offload_budget": 3 << 20}
    assert given == [budget + (3 << 20)]
    under = comparison.summary()["modes"]["chunk_offload_budget"]
    assert under["budget_bytes"] == budget and under["left_bytes"] == 3 << 20
    assert under["peak_bytes"] == comparison.budget.result.peak_bytes - (3 << 20)
    assert comparison.summary()["modes"]["megatron"]["left_bytes"] == 1 << 20
    assert ("left allocated by the builds before (MiB; taken off that column's peak and added to its budget): "
            "megatron 0.16.1 1.00, chunk-offload budget 3.00").replace("0.16.1", comparison.megatron_version) in comparison.format()  # fmt: skip


def test_budget_at_megatrons_peak_is_skipped_without_one() -> None:
    """On CPU megatron's path has no peak: the budget mode at its peak says so in one line, and the rest runs."""
    from chunk_offload.replay.compare import compare_with_megatron

    comparison = compare_with_megatron(
        _SHAPE, pp_size=2, pp_rank=0, modules="core_attn", num_microbatches=4, config=OffloadConfig(min_offload_bytes=1), budget_bytes="megatron"
    )
    reason = "megatron's peak is the budget, and megatron's path has no peak on CPU (no device allocator)"
    assert comparison.budget is None and comparison.summary()["modes"]["chunk_offload_budget"] == {"skipped": reason}
    assert f"chunk-offload budget: skipped: {reason}" in comparison.format().splitlines()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget-bytes", "1MiB"], "--budget-bytes 1048576 is a column of the comparison: add --compare megatron"),
        (["--compare", "megatron", "--budget-bytes", "lots"], "argument --budget-bytes: expected a byte count >= 0 such as 1048576 or 1MiB"),
        (["--compare", "megatron", "--budget-bytes", "megatron"], "--budget-bytes megatron needs CUDA: megatron's path has no measured peak on CPU"),
        (["--deterministic=yes"], "argument --deterministic: ignored explicit argument 'yes'"),
        (["--host-profile-iterations", "2"], "--host-profile-iterations 2 is a row of the comparison: add --compare megatron"),
        (["--compare", "megatron", "--host-profile-iterations", "-1"], "--host-profile-iterations must be an integer >= 0, got -1"),
        (["--compare", "megatron", "--host-profile-iterations", "one"], "argument --host-profile-iterations: invalid int value: 'one'"),
    ],
    ids=["without_compare", "not_bytes", "megatron_on_cpu", "deterministic_with_a_value", "profile_without_compare",
         "profile_negative", "profile_not_int"],
)
def test_cli_budget_usage_errors(capsys, args: list[str], message: str) -> None:
    from chunk_offload.replay.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--pp", "2", "--stage", "0", "--modules", "core_attn", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
