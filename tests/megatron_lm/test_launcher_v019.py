"""The launcher runs Megatron-LM's own ``pretrain`` (megatron-core >= 0.19 ships ``megatron.training``).

`train_gpt_v019.py` (a script in core_v0.19's style: ``parse_and_validate_args``, a config
container, ``pretrain`` without a model provider) runs under
``torchrun -m chunk_offload.megatron_lm`` on CPU with mock data, 3 iterations with an evaluation
after the 2nd, once without and once with offload: every microbatch loss and every step's gradient
norm must be bit-identical (printed with ``float.hex``), and the report must show bytes copied.

Skipped where megatron.training is missing (the megatron-core 0.16.1 wheel has none), unless
``CHUNK_OFFLOAD_REQUIRE_MEGATRON_TRAINING=1`` (set by tests/run_megatron_019.sh), where that fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("train_gpt_v019.py")

if importlib.util.find_spec("megatron.training") is None:
    if os.environ.get("CHUNK_OFFLOAD_REQUIRE_MEGATRON_TRAINING") == "1":
        raise RuntimeError("CHUNK_OFFLOAD_REQUIRE_MEGATRON_TRAINING=1 but megatron.training does not import")
    pytest.skip("megatron.training is not installed (megatron-core < 0.19)", allow_module_level=True)

COMMON = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 4 --train-iters 3 --eval-interval 2 --eval-iters 1 "
    "--lr 1e-3 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
    "--distributed-backend gloo --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-persist-layer-norm "
    "--attention-dropout 0 --hidden-dropout 0 --seed 1234 --log-interval 1"
).split()
CASES = {
    "pp2_vpp2": (2, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1", "core_attn,qkv_linear,mlp_fc1"),
    "pp2_ep2_moe": (
        4,
        "--pipeline-model-parallel-size 2 --num-experts 4 --expert-model-parallel-size 2 "
        "--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01",
        "core_attn,expert_fc1",
    ),
}
TIMEOUT_S = 420
_LINE = re.compile(r"^chunk-offload-test (loss|grad-norm) rank=(\d+) value=(\S+)$", re.MULTILINE)


def _run(nproc: int, args: list[str], tmp_path: Path, *, script: Path = SCRIPT, launcher: bool = True, **env_vars: str) -> tuple[int, str, str]:
    """Run ``script`` with ``args`` under torchrun (and the launcher); its exit status, stdout and stderr."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), *(["-m", "chunk_offload.megatron_lm"] if launcher else []), str(script)]
    cmd += args
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_vars}
    # A session of its own: on a hang the whole process group (torchrun and its ranks) is killed.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # stdout apart from stderr: a warning written by one rank must not split another's result line.
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {TIMEOUT_S} s:\n{(out + err)[-6000:]}")
    return proc.returncode, out, err


def _run_one_rank(args: list[str], tmp_path: Path, **env_vars: str) -> tuple[int, str, str]:
    """One rank without torchrun (its environment set here), so that the launcher's own exit status
    and stderr come back as they are: `_WRAPPER` runs `SCRIPT` as set up by ``env_vars``."""
    wrapper = tmp_path / "wrapped_train_gpt.py"
    wrapper.write_text(_WRAPPER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TEST_SCRIPT": str(SCRIPT), **rank, **env_vars}
    cmd = [sys.executable, "-m", "chunk_offload.megatron_lm", str(wrapper), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout, proc.stderr


# Runs SCRIPT after the launcher's checks passed: without matplotlib, with a folder where a report file
# goes, or (in the run with offload of --chunk-offload-verify, the one with our flags) with every
# parameter nudged after the first training step.
_WRAPPER = """import os, runpy, sys
if os.environ.get("TEST_NO_MATPLOTLIB"):
    sys.modules["matplotlib"] = None  # import matplotlib fails
if os.environ.get("TEST_BLOCK"):
    os.makedirs(os.environ["TEST_BLOCK"])  # writing this report file will fail at the end
if os.environ.get("TEST_NUDGE") and "--chunk-offload-modules" in sys.argv:
    import torch
    import megatron.training.training as training
    train_step = training.train_step

    def nudged(*args, **kwargs):
        result = train_step(*args, **kwargs)
        if training.get_args().curr_iteration == 0:
            with torch.no_grad():
                for chunk in args[2]:
                    for p in chunk.parameters():
                        p.add_(1e-3)
        return result

    training.train_step = nudged
runpy.run_path(os.environ["TEST_SCRIPT"], run_name="__main__")
"""


def _train(
    nproc: int, case_args: str, extra: list[str], tmp_path: Path, *, script: Path = SCRIPT, launcher: bool = True, outputs: list | None = None
) -> list[tuple[str, int, str]]:
    """Run ``script`` (under the launcher); the (kind, rank, hex value) lines in the order each rank printed them.

    ``outputs``: the run's stdout and stderr are appended to it.
    """
    returncode, out, err = _run(nproc, COMMON + case_args.split() + extra, tmp_path, script=script, launcher=launcher)
    assert returncode == 0, f"exited with {returncode}:\n{(out + err)[-6000:]}"
    if outputs is not None:
        outputs += [out, err]
    lines = sorted(_LINE.findall(out), key=lambda t: int(t[1]))  # stable: per rank in print order
    return [(kind, int(rank), value) for kind, rank, value in lines]


@pytest.fixture(scope="module")
def plain_runs() -> dict[str, list[tuple[str, int, str]]]:
    """Each case trained once without offload (model from the config), shared by the tests."""
    return {}


def _plain(plain_runs: dict, case: str, tmp_path: Path) -> list[tuple[str, int, str]]:
    if case not in plain_runs:
        nproc, case_args, _ = CASES[case]
        plain_runs[case] = _train(nproc, case_args, [], tmp_path)
    return plain_runs[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_pretrain_through_launcher_bit_identical_with_report(case: str, plain_runs: dict, tmp_path: Path) -> None:
    nproc, case_args, modules = CASES[case]
    report = tmp_path / "report"
    plain = _plain(plain_runs, case, tmp_path)
    outputs: list[str] = []
    offload = _train(
        nproc,
        case_args,
        ["--chunk-offload-modules", modules, "--chunk-offload-min-offload-bytes", "0", "--chunk-offload-report", str(report)],
        tmp_path,
        outputs=outputs,
    )
    losses = [line for line in plain if line[0] == "loss"]
    norms = [line for line in plain if line[0] == "grad-norm"]
    assert len(norms) == 3 * nproc, plain  # every rank, every one of the 3 steps
    assert losses, "the last stage printed no loss"
    assert offload == plain

    for suffix in (".json", ".md", ".png"):
        assert report.with_suffix(suffix).is_file(), f"no {report}{suffix}"
    reports = json.loads(report.with_suffix(".json").read_text())["reports"]
    assert sorted(r["rank"] for r in reports) == list(range(nproc))
    stage0 = [r for r in reports if r["pp_rank"] == 0]
    for r in stage0:  # the first stage's chunks wait for their backward: they are copied
        assert sum(r["bytes_per_module"].values()) > 0, r
        assert r["measured_drop"] == r["theoretical_drop"] > 0, r
    idle = [r["rank"] for r in reports if not any(r["bytes_per_module"].values())]  # e.g. the last stage without VPP
    table = report.with_suffix(".md").read_text()
    if idle:
        assert f"{'rank' if len(idle) == 1 else 'ranks'} {', '.join(map(str, idle))} copied nothing: the plan kept" in table
    # The launcher's summary on rank 0, after the report: a row per rank with the report's drop and R.
    out = outputs[0]
    summary = out[out.index("chunk-offload summary: ") :].splitlines()
    assert summary[0] == f"chunk-offload summary: --chunk-offload-modules {modules}, the last of 3 training iterations, per rank"
    rows = {int(cells[0]): cells for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in summary[5 : 5 + nproc])}
    assert sorted(rows) == list(range(nproc))
    for r in reports:
        cells = rows[r["rank"]]
        assert cells[1] == f"{r['pp_rank']}/2" and cells[2] == str(sum(r["bytes_per_module"].values())) and cells[3] == str(r["peak_with"])
        assert cells[4] == (str(r["measured_drop"]) if r["rank"] not in idle else "-")
    assert f"report: {report}.json, {report}.md, {report}.png" in summary
    assert out.count("chunk-offload summary: ") == 1  # rank 0 only


def test_model_provider_and_the_readme_snippet(plain_runs: dict, tmp_path: Path) -> None:
    """A model provider called by Megatron-LM's get_model (config=, pg_collection=), and the script's own flags.

    The script's ``--test-model-from provider`` comes from its own ``extra_args_provider``, which
    the launcher composes with ours. The README's snippet for users who keep their own script
    (train_gpt_readme_snippet.py runs it as written, no launcher) must train the same. The model
    provider builds the same model as the config, so both compare with the plain run from the config.
    """
    nproc, case_args, modules = CASES["pp2_vpp2"]
    case_args += " --test-model-from provider"
    ours = ["--chunk-offload-modules", modules, "--chunk-offload-min-offload-bytes", "0"]
    plain = _plain(plain_runs, "pp2_vpp2", tmp_path)
    launched = _train(nproc, case_args, [*ours, "--chunk-offload-report", str(tmp_path / "launched")], tmp_path)
    snippet = _train(
        nproc,
        case_args.replace(" --test-model-from provider", ""),
        [*ours, "--chunk-offload-iterations", "auto", "--chunk-offload-report", str(tmp_path / "snippet")],
        tmp_path,
        script=SCRIPT.with_name("train_gpt_readme_snippet.py"),
        launcher=False,
    )
    assert len([line for line in plain if line[0] == "grad-norm"]) == 3 * nproc
    assert launched == plain
    assert snippet == plain
    for name in ("launched", "snippet"):
        reports = json.loads((tmp_path / f"{name}.json").read_text())["reports"]
        assert all(sum(r["bytes_per_module"].values()) > 0 for r in reports), reports  # VPP: both stages copy


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--chunk-offload-device-budget", "lots", "expected 'auto' or a byte count >= 0"),
        ("--chunk-offload-host-budget", "auto", "expected 'none' or a byte count >= 0 such as 16MiB or 600KiB (suffixes KiB, MiB, GiB, TiB), got 'auto'"),
    ],
)
def test_bad_budget_is_a_usage_error_through_megatrons_parser(flag: str, value: str, message: str, tmp_path: Path) -> None:
    """Megatron-LM's own parser (our flags composed into it by the launcher) answers with exit code 2."""
    cmd = [sys.executable, "-m", "chunk_offload.megatron_lm", str(SCRIPT), *COMMON, "--chunk-offload-modules", "core_attn", flag, value]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"argument {flag}: {message}" in proc.stderr and "Traceback" not in proc.stderr


PROG = "python -m chunk_offload.megatron_lm"
ONE_STAGE = COMMON[: COMMON.index("--train-iters")] + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1"] + COMMON[COMMON.index("--lr") :]


def test_without_matplotlib_and_with_nothing_offloaded_the_run_succeeds_and_says_why(tmp_path: Path) -> None:
    """PP=1, the default minimum size typed out (a tiny model saves nothing that large), a module the dense model lacks."""
    report = tmp_path / "r"
    ours = ["--chunk-offload-modules", "core_attn,expert_fc1", "--chunk-offload-device-budget", "auto", "--chunk-offload-report", str(report)]
    ours += ["--chunk-offload-min-offload-bytes", "1MiB"]  # quoted back as typed
    returncode, out, err = _run_one_rank(ONE_STAGE + ours, tmp_path, TEST_NO_MATPLOTLIB="1")
    assert returncode == 0, (out + err)[-6000:]
    assert "Traceback" not in err
    # The plot is optional: one warning line, the PNG skipped, the rest written.
    both = out + err
    assert both.count("matplotlib is not installed") == 1
    assert f"chunk_offload: matplotlib is not installed: skipped the plot {report}.png (pip install 'chunk-offload[plot]')" in both
    assert not report.with_suffix(".png").exists() and report.with_suffix(".json").is_file() and report.with_suffix(".md").is_file()
    assert f"report: {report}.json, {report}.md (no PNG: see the warning above)" in out.splitlines()
    # Nothing offloaded: warnings that say why (stderr), after the summary (stdout).
    assert f"{PROG}: warning: --chunk-offload-modules expert_fc1 matches no submodule on rank 0: nothing of it is offloaded there\n" in err
    assert (
        f"{PROG}: warning: nothing was offloaded on rank 0: no saved tensor of core_attn reached --chunk-offload-min-offload-bytes "
        "1MiB (default 1 MiB); a small model needs a lower threshold, e.g. --chunk-offload-min-offload-bytes 0\n"
    ) in err
    # Megatron-LM's argument dump shows what runs; each of our lines appears once.
    assert re.search(r"^  chunk_offload_iterations \.+ auto$", out, flags=re.MULTILINE), out[:4000]
    assert re.search(r"^  chunk_offload_device_budget \.+ auto$", out, flags=re.MULTILINE)
    ours_lines = [line for line in both.splitlines() if "chunk_offload" in line or "chunk-offload" in line]
    assert len(ours_lines) == len(set(ours_lines)), [line for line in ours_lines if ours_lines.count(line) > 1]
    assert all("device budget auto (levelled to " in line for line in ours_lines if "device budget" in line)


def test_a_report_that_cannot_be_written_at_the_end_still_prints_the_results_and_exits_1(tmp_path: Path) -> None:
    report = tmp_path / "r"
    ours = ["--chunk-offload-modules", "core_attn", "--chunk-offload-min-offload-bytes", "0", "--chunk-offload-report", str(report)]
    returncode, out, err = _run_one_rank(ONE_STAGE + ours, tmp_path, TEST_BLOCK=f"{report}.md")
    assert returncode == 1, (out + err)[-6000:]
    assert "Traceback" not in err
    assert f"{PROG}: error: --chunk-offload-report {report}: could not write the report: " in err
    summary = out[out.index("chunk-offload summary: ") :]
    assert "report: not written (see the error below)" in summary
    assert "the report that could not be written:" in summary and "| rank |  pp | vp | peak without (B) |" in summary


def test_verify_passes_through_torchrun(tmp_path: Path) -> None:
    """Two launchers, each running the job twice as child runs (a fresh rendezvous each time)."""
    nproc, case_args, modules = CASES["pp2_vpp2"]
    ours = ["--chunk-offload-modules", modules, "--chunk-offload-min-offload-bytes", "0", "--chunk-offload-verify", "2"]
    returncode, out, err = _run(nproc, COMMON + case_args.split() + ours, tmp_path)
    assert returncode == 0, (out + err)[-6000:]
    runs = [line for line in out.splitlines() if line.startswith("chunk-offload verify: ")]
    assert runs[:2] == [f"chunk-offload verify: run {k} of 2, with{'out' if k == 1 else ''} offload, 2 training iterations" for k in (1, 2)]
    assert re.fullmatch(r"chunk-offload verify: PASS \(2 iterations, 2 ranks, \d+ parameters compared, [1-9]\d* bytes offloaded\)", runs[2]), runs
    assert len(runs) == 3 and out.count("chunk-offload summary: ") == 1  # the run with offload's, by rank 0
    assert len([line for line in _LINE.findall(out) if line[0] == "grad-norm"]) == 2 * 2 * nproc  # 2 runs, 2 steps, every rank


def test_verify_reports_the_first_mismatch_and_exits_1(tmp_path: Path) -> None:
    ours = ["--chunk-offload-modules", "core_attn", "--chunk-offload-min-offload-bytes", "0", "--chunk-offload-verify", "2"]
    returncode, out, err = _run_one_rank(ONE_STAGE + ours, tmp_path, TEST_NUDGE="1")
    assert returncode == 1, (out + err)[-6000:]
    assert "Traceback" not in err
    last = [line for line in out.splitlines() if line.startswith("chunk-offload verify: ")][-1]
    assert re.fullmatch(r"chunk-offload verify: MISMATCH at iteration 2, rank 0, loss loss\[0\]\['lm loss'\]: max abs difference \d\S*", last), last
