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


def _train(nproc: int, case_args: str, extra: list[str], tmp_path: Path, *, script: Path = SCRIPT, launcher: bool = True) -> list[tuple[str, int, str]]:
    """Run ``script`` (under the launcher); the (kind, rank, hex value) lines in the order each rank printed them."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), *(["-m", "chunk_offload.megatron_lm"] if launcher else []), str(script)]
    cmd += COMMON + case_args.split() + extra
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # A session of its own: on a hang the whole process group (torchrun and its ranks) is killed.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    # stdout apart from stderr: a warning written by one rank must not split another's result line.
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {TIMEOUT_S} s:\n{(out + err)[-6000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited with {proc.returncode}:\n{(out + err)[-6000:]}"
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
    offload = _train(
        nproc,
        case_args,
        ["--chunk-offload-modules", modules, "--chunk-offload-min-offload-bytes", "0", "--chunk-offload-report", str(report)],
        tmp_path,
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
        ("--chunk-offload-host-budget", "auto", "expected a byte count >= 0"),
    ],
)
def test_bad_budget_is_a_usage_error_through_megatrons_parser(flag: str, value: str, message: str, tmp_path: Path) -> None:
    """Megatron-LM's own parser (our flags composed into it by the launcher) answers with exit code 2."""
    cmd = [sys.executable, "-m", "chunk_offload.megatron_lm", str(SCRIPT), *COMMON, "--chunk-offload-modules", "core_attn", flag, value]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"argument {flag}: {message}" in proc.stderr and "Traceback" not in proc.stderr
