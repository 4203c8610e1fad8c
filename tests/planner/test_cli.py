"""``chunk-offload plan``: output equals the API's estimates, errors name the fix, the script runs."""

from __future__ import annotations

import importlib.util
import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chunk_offload.planner import GB, GPTDims, Hardware, PipelineConfig, StagePlanner, recommend
from chunk_offload.planner.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron_plan reads megatron-core's schedule tables"
)

_ARGS = [
    "plan",
    "--num-layers", "8",
    "--hidden-size", "64",
    "--num-attention-heads", "4",
    "--num-query-groups", "2",
    "--seq-length", "32",
    "--micro-batch-size", "2",
    "--pp", "2",
    "--vpp", "2",
    "--num-microbatches", "4",
    "--min-offload-bytes", "1",
    "--host-bandwidth-gbs", "10",
    "--device-tflops", "0.001",
]  # fmt: skip
_DIMS = GPTDims(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32, micro_batch_size=2)
_PIPELINE = PipelineConfig(pipeline_parallel=2, virtual_pipeline=2, num_microbatches=4)
_HARDWARE = Hardware(host_bandwidth_gbs=10, device_tflops=0.001)
_DEFAULT_GROUPING = dict(group_by="layer", layer_group_bytes=16 << 20)
"""The groups the command line plans without --group-by and --layer-group-bytes (the option table's defaults)."""


def _run(capsys, *extra: str) -> tuple[int, str, str]:
    status = main([*_ARGS, *extra])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_json_equals_the_api(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    status, out, err = _run(capsys, "--modules", "qkv_linear,core_attn", "--json", str(path))
    assert (status, err) == (0, "")
    data = json.loads(path.read_text())
    stages = StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, **_DEFAULT_GROUPING).estimate(["qkv_linear", "core_attn"])
    assert data["stages"] == [json.loads(json.dumps({**s.to_dict(), "budget": None})) for s in stages]  # no --budget-gb
    assert (data["group_by"], data["layer_group_bytes"]) == ("layer", 16 << 20)
    assert data["modules"] == ["qkv_linear", "core_attn"]
    assert data["schedule"] == "megatron interleaved 1F1B (group 2)"
    assert data["recommendations"] is None
    # The text table shows the same numbers, one row per stage.
    rows = out.split("per stage (GB")[1].splitlines()[3:5]
    for stage, row in zip(stages, rows, strict=True):
        cells = row.split()
        assert cells[:6] == [
            str(stage.pp_rank),
            str(stage.chunks_in_flight_peak),
            str(len(stage.kept_chunks)),
            f"{stage.peak_saved_bytes / 1e9:.3f}",
            f"{stage.peak_resident_bytes / 1e9:.3f}",
            f"{stage.drop / 1e9:.3f}",
        ]
        assert cells[7:10] == [
            f"{stage.copy_seconds_per_layer * 1e3:.3f}",
            f"{stage.compute_seconds_per_layer * 1e3:.3f}",
            f"{stage.backward_compute_seconds_per_layer * 1e3:.3f}",
        ]
        assert cells[10] == ("yes" if stage.hides else "NO")
    per_layer = f"{stages[0].module_bytes_per_layer['core_attn'] / 1e6:.2f}/{stages[0].chunk_module_bytes[0]['core_attn'] / 1e6:.2f}"
    assert per_layer in out


def test_group_by_layer_equals_the_api(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    status, _, err = _run(capsys, "--modules", "qkv_linear,core_attn", "--group-by", "layer", "--json", str(path))
    assert (status, err) == (0, "")
    data = json.loads(path.read_text())
    planner = StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, group_by="layer", layer_group_bytes=16 << 20)
    stages = planner.estimate(["qkv_linear", "core_attn"])
    assert (data["group_by"], data["layer_group_bytes"]) == ("layer", 16 << 20)  # the default bound
    assert data["stages"] == [json.loads(json.dumps({**s.to_dict(), "budget": None})) for s in stages]
    assert {name for s in stages for names in s.group_names.values() for name in names} == {"qkv_linear+core_attn"}


def test_layer_group_bytes_equals_the_api(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    status, _, err = _run(capsys, "--modules", "qkv_linear,core_attn", "--group-by", "layer", "--layer-group-bytes", "1", "--json", str(path))
    assert (status, err) == (0, "")
    data = json.loads(path.read_text())
    planner = StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, group_by="layer", layer_group_bytes=1)
    stages = planner.estimate(["qkv_linear", "core_attn"])
    assert data["layer_group_bytes"] == 1
    assert data["stages"] == [json.loads(json.dumps({**s.to_dict(), "budget": None})) for s in stages]
    assert {name for s in stages for names in s.group_names.values() for name in names} == {"qkv_linear", "core_attn"}


def test_layer_group_bytes_without_group_by(capsys, tmp_path: Path):
    """Layer groups are the default: --layer-group-bytes alone bounds them ('none': the whole layer), and
    --group-by module alone is no contradiction (the default bound is not typed)."""
    path = tmp_path / "plan.json"
    cases = [
        (["--layer-group-bytes", "1"], dict(group_by="layer", layer_group_bytes=1), {"qkv_linear", "core_attn"}),
        (["--layer-group-bytes", "none"], dict(group_by="layer", layer_group_bytes=None), {"qkv_linear+core_attn"}),
        (["--group-by", "module"], dict(group_by="module"), {"qkv_linear", "core_attn"}),
    ]
    for flags, grouping, names in cases:
        status, _, err = _run(capsys, "--modules", "qkv_linear,core_attn", *flags, "--json", str(path))
        assert (status, err) == (0, ""), flags
        data = json.loads(path.read_text())
        stages = StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, **grouping).estimate(["qkv_linear", "core_attn"])
        assert data["group_by"] == grouping["group_by"]
        assert data["stages"] == [json.loads(json.dumps({**s.to_dict(), "budget": None})) for s in stages]
        assert {name for s in stages for names in s.group_names.values() for name in names} == names, flags
        if grouping["group_by"] == "layer":
            assert data["layer_group_bytes"] == grouping["layer_group_bytes"]


def test_default_modules_are_every_module_the_model_has(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    status, _, _ = _run(capsys, "--json", str(path))
    assert status == 0
    assert json.loads(path.read_text())["modules"] == ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"]


def test_budget_recommendation(capsys, tmp_path: Path):
    planner = StagePlanner(_DIMS, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, **_DEFAULT_GROUPING)
    budget_gb = planner.estimate([])[0].peak_with_offload_bytes / GB * 0.9
    path = tmp_path / "plan.json"
    status, out, _ = _run(capsys, "--budget-gb", str(budget_gb), "--json", str(path))
    assert status == 0
    expected = recommend(planner, budget_bytes=round(budget_gb * GB), candidates=["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp_fc1"])
    assert json.loads(path.read_text())["recommendations"] == [json.loads(json.dumps(r.to_dict())) for r in expected]
    assert expected[0].fits
    for r in expected:
        assert f"  {r.describe()}" in out


def test_budget_nothing_fits(capsys):
    status, out, _ = _run(capsys, "--budget-gb", "0")
    assert status == 0
    assert "stage 0: no module set fits 0.000 GB without stalls; best without stalls: " in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--modules", "core_attn,qkv"], r"unknown offload module 'qkv'; valid names: \['attn_norm', 'qkv_linear', 'core_attn', 'attn_proj', 'mlp_norm', 'mlp_fc1', 'expert_fc1', 'moe_act', 'fused_group_mlp', 'router_fc1'\]"),
        (["--modules", "expert_fc1"], r"module\(s\) \['expert_fc1'\] not in this model; it has \['attn_norm', 'qkv_linear', 'core_attn', 'attn_proj', 'mlp_norm', 'mlp_fc1'\]"),
        (["--num-microbatches", "3"], r"--num-microbatches \(3\) to be a multiple of the microbatch group size \(2\)"),
        (["--vpp", "3"], r"--num-layers 8 must split evenly over 2 stages x 3 model chunks \(a multiple of 6\)"),
        (["--pp", "1"], "--vpp=2 needs --pp >= 2, got 1"),
        (["--num-experts", "3", "--ep", "2"], "--num-experts 3 must be divisible by --ep 2"),
        (["--num-experts", "3", "--expert-model-parallel-size", "2"], "--num-experts 3 must be divisible by --expert-model-parallel-size 2"),
        (["--num-experts", "4", "--moe-layer-freq", "1,x"], r"--moe-layer-freq takes an int or comma-separated 0/1 per layer, got '1,x'"),
        (["--budget-gb", "-1"], "--budget-gb must be >= 0, got -1.0"),
        (["--host-bandwidth-gbs", "0"], "--host-bandwidth-gbs must be a finite number > 0, got 0.0"),
        (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size >= 2, got --tensor-model-parallel-size 1"),
        (["--tp", "3"], "--num-attention-heads 4 must be divisible by --tp 3"),
        (["--tp", "4"], "--num-query-groups 2 must be divisible by --tp 4"),
        (["--tensor-model-parallel-size", "4"], "--num-query-groups 2 must be divisible by --tensor-model-parallel-size 4"),
        (["--tp", "2", "--num-experts", "4"], "MoE with --tp 2 is not modelled"),
        (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk"),
    ],
)
def test_invalid_input_names_the_fix(capsys, extra, message):
    status, out, err = _run(capsys, *extra)
    assert status == 2 and out == ""
    assert err.startswith("chunk-offload plan: error: chunk_offload: ")
    assert re.search(message, err), err
    internal = {f.name for cls in (GPTDims, PipelineConfig, Hardware) for f in dataclasses.fields(cls)} | {"min_offload_bytes"}
    named = set(re.findall(r"[a-z]+(?:_[a-z0-9]+)+", err)) & internal
    assert not named, f"the error names library fields {named} instead of the flags: {err}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budget-gb", "nan"], "argument --budget-gb: must be a finite number, got nan"),
        (["--device-tflops", "inf"], "argument --device-tflops: must be a finite number, got inf"),
        (["--json", "/missing/dir/x.json"], "argument --json: folder '/missing/dir' of '/missing/dir/x.json' does not exist"),
        (["--attention", "flash"], "argument --attention: invalid choice: 'flash'"),
        (["--min-offload-bytes", "-1"], "argument --min-offload-bytes: expected a byte count >= 0 such as 1048576 or 1MiB"),
        (["--schedule", "all"], "argument --schedule: invalid choice: 'all' (choose from 'plan', 'group-start')"),
        (["--group-by", "block"], "argument --group-by: invalid choice: 'block' (choose from 'call', 'module', 'layer')"),
        (["--group-by", "module", "--layer-group-bytes", "4KiB"], "argument --layer-group-bytes: needs --group-by layer: it bounds layer groups"),
        (["--group-by", "call", "--layer-group-bytes", "none"], "argument --layer-group-bytes: needs --group-by layer: it bounds layer groups"),
        (["--group-by", "layer", "--layer-group-bytes", "-1"], "argument --layer-group-bytes: expected 'none' or a byte count >= 0"),
        (["--layer-group-bytes", "lots"], "argument --layer-group-bytes: expected 'none' or a byte count >= 0"),
        (["--attention-kernel", "fused"], "argument --attention-kernel: 'fused' is not a kernel of --transformer-impl local; choose from ['flash', 'efficient']"),
        (["--transformer-impl", "transformer_engine", "--attention-kernel", "efficient"], "choose from ['flash', 'fused']"),
    ],
)
def test_usage_errors_before_computing(capsys, monkeypatch, extra, message):
    from chunk_offload.planner import cli

    def must_not_run(args):
        raise AssertionError("computed before checking the arguments")

    monkeypatch.setattr(cli, "_plan", must_not_run)
    with pytest.raises(SystemExit) as info:
        main([*_ARGS, *extra])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_attention_models(capsys, tmp_path: Path):
    """--attention picks the core attention the bytes are for; sdpa is the default."""
    path = tmp_path / "plan.json"
    per_layer = {}
    for attention in ("sdpa", "local"):
        status, out, err = _run(capsys, "--attention", attention, "--modules", "core_attn", "--json", str(path))
        assert (status, err) == (0, "")
        dims = dataclasses.replace(_DIMS, attention=attention)
        stages = StagePlanner(dims, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, **_DEFAULT_GROUPING).estimate(["core_attn"])
        assert json.loads(path.read_text())["stages"] == [json.loads(json.dumps({**s.to_dict(), "budget": None})) for s in stages]
        per_layer[attention] = stages[0].module_bytes_per_layer["core_attn"]
    assert "torch's SDPA (core_attn: q, k, v, output, log-sum-exp); core_attn from source, unmeasured" in _run(capsys)[1]
    assert per_layer["sdpa"] < per_layer["local"]


def test_transformer_engine_spec(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    status, out, err = _run(capsys, "--transformer-impl", "transformer_engine", "--attention-kernel", "fused", "--json", str(path))
    assert (status, err) == (0, "")
    data = json.loads(path.read_text())
    assert data["modules"] == ["qkv_linear", "core_attn", "attn_proj", "mlp_fc1"]  # the norms are fused in
    assert data["byte_model"].endswith("from source, unmeasured; FP8 activations not modelled")
    assert "Transformer Engine's spec" in out and "from source, unmeasured; FP8 activations not modelled" in out
    status, out, err = _run(capsys, "--transformer-impl", "transformer_engine", "--modules", "attn_norm")
    assert status == 2 and "module(s) ['attn_norm'] not in this model" in err


def test_malformed_flags_exit_through_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--num-layers", "8"])
    assert info.value.code == 2
    assert "the following arguments are required: --hidden-size" in capsys.readouterr().err


def test_llama_and_tensor_parallel_flags(capsys, tmp_path: Path):
    """--normalization, --swiglu, --no-bias-swiglu-fusion, --rope, --tp and --sequence-parallel reach GPTDims."""
    path = tmp_path / "plan.json"
    flags = ["--normalization", "RMSNorm", "--swiglu", "--no-bias-swiglu-fusion", "--rope", "--tp", "2", "--sequence-parallel"]
    status, out, err = _run(capsys, *flags, "--json", str(path))
    assert (status, err) == (0, "")
    dims = dataclasses.replace(
        _DIMS,
        normalization="RMSNorm",
        swiglu=True,
        bias_swiglu_fusion=False,
        position_embedding_type="rope",
        tensor_parallel=2,
        sequence_parallel=True,
    )
    data = json.loads(path.read_text())
    assert data["model"] == json.loads(json.dumps(dataclasses.asdict(dims)))
    stages = StagePlanner(dims, _PIPELINE, hardware=_HARDWARE, min_offload_bytes=1, **_DEFAULT_GROUPING).estimate(data["modules"])
    assert data["stages"] == [json.loads(json.dumps({**s.to_dict(), "budget": None})) for s in stages]
    assert "layers: RMSNorm, SwiGLU (unfused), rope positions; TP=2 with sequence parallel" in out
    # --position-embedding-type rope is the same as --rope; the defaults are LayerNorm, GELU, learned.
    status, _, _ = _run(capsys, "--position-embedding-type", "rope", "--json", str(path))
    assert status == 0 and json.loads(path.read_text())["model"]["position_embedding_type"] == "rope"
    status, out, _ = _run(capsys)
    assert "layers: LayerNorm, GELU, learned_absolute positions; TP=1 (bytes and FLOPs per TP rank)" in out


def test_moe_model(capsys, tmp_path: Path):
    path = tmp_path / "plan.json"
    status, out, _ = _run(capsys, "--num-experts", "4", "--moe-layer-freq", "1,0,1,0,1,0,1,0", "--ep", "2", "--modules", "router_fc1,mlp_fc1", "--json", str(path))
    assert status == 0
    stages = json.loads(path.read_text())["stages"]
    tokens = 32 * 2
    assert stages[0]["module_bytes_per_layer"] == {"expert_fc1": tokens * 2 * 64 * 2, "mlp_fc1": tokens * 64 * 2}
    assert "4 experts top-2 EP=2" in out


def test_installed_console_script(tmp_path: Path):
    script = shutil.which("chunk-offload") or str(Path(sys.executable).with_name("chunk-offload"))
    if not Path(script).exists():
        pytest.skip("the console script is not installed: pip install -e . registers it")
    path = tmp_path / "plan.json"
    done = subprocess.run([script, *_ARGS, "--json", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "per stage (GB" in done.stdout
    assert len(json.loads(path.read_text())["stages"]) == 2
    bad = subprocess.run([script, *_ARGS, "--modules", "qkv"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown offload module 'qkv'" in bad.stderr
