"""Megatron's rules for offload-module combinations (`chunk_offload.module_names.combination_problem`),
applied with the flags as typed in the library (Megatron `attach`), the launcher's flags (`check_args`)
and the planner (its `--modules`, and the sets `recommend` tries)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from torch import nn

from chunk_offload import ChunkOffloadError
from chunk_offload.integrations.megatron import add_arguments, attach, check_args
from chunk_offload.module_names import combination_problem
from chunk_offload.planner import GPTDims, PipelineConfig, StagePlanner
from chunk_offload.planner.cli import main as planner_main
from chunk_offload.planner.recommend import recommend


@pytest.mark.parametrize(
    ("modules", "recompute", "refused"),
    [
        (["attn_proj"], [], True),
        (["qkv_linear", "attn_proj"], [], True),
        (["core_attn", "attn_proj"], [], False),
        (["attn_proj"], ["core_attn"], False),
        (["expert_fc1"], ["moe"], True),
        (["moe_act", "core_attn"], ["core_attn", "moe"], True),
        (["expert_fc1"], ["core_attn", "mlp"], False),
        (["core_attn", "mlp_fc1"], ["moe"], False),
        (["fused_group_mlp", "core_attn"], [], False),
        (["fused_group_mlp", "expert_fc1"], [], True),
        (["moe_act", "fused_group_mlp"], [], True),
        (["fused_group_mlp"], ["moe"], True),
        (["fused_group_mlp"], ["core_attn"], False),
    ],
)
def test_combination_rules(modules: list[str], recompute: list[str], refused: bool) -> None:
    assert (combination_problem(modules, recompute) is not None) is refused


def _launcher_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--recompute-granularity", default=None)
    parser.add_argument("--recompute-modules", nargs="*", default=None)
    return add_arguments(parser)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunk-offload-modules", "attn_proj"], "--chunk-offload-modules attn_proj: attn_proj is offloaded without core_attn"),
        (
            ["--chunk-offload-modules", "expert_fc1", "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
            "--chunk-offload-modules expert_fc1 with --recompute-modules core_attn moe: expert_fc1 cannot be offloaded while the MoE",
        ),
    ],
)
def test_the_launcher_refuses_with_a_usage_error_naming_the_flags(argv: list[str], message: str, capsys) -> None:
    parser = _launcher_parser()
    args = parser.parse_args(argv)
    with pytest.raises(SystemExit) as info:
        check_args(args, parser)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_launcher_refuses_fused_group_mlp_with_expert_fc1(capsys) -> None:
    parser = _launcher_parser()
    args = parser.parse_args(["--chunk-offload-modules", "expert_fc1,fused_group_mlp"])
    with pytest.raises(SystemExit):
        check_args(args, parser)
    assert "fused_group_mlp is offloaded with expert_fc1" in capsys.readouterr().err


def test_the_launcher_allows_moe_offload_when_moe_is_not_recomputed() -> None:
    parser = _launcher_parser()
    argv = ["--chunk-offload-modules", "expert_fc1", "--recompute-granularity", "full", "--recompute-modules", "moe"]
    check_args(parser.parse_args(argv), parser)  # full recompute: the selective modules do not apply


def test_the_library_reads_the_models_recompute_modules() -> None:
    chunk = nn.Linear(2, 2)
    chunk.config = SimpleNamespace(recompute_granularity="selective", recompute_modules=["moe"])
    with pytest.raises(ChunkOffloadError, match=r"offload_modules expert_fc1 with config.recompute_modules moe: expert_fc1 cannot"):
        attach(chunk, "expert_fc1")
    with pytest.raises(ChunkOffloadError, match=r"offload_modules attn_proj: attn_proj is offloaded without core_attn"):
        attach(nn.Linear(2, 2), ["attn_proj"])


def test_the_planner_refuses_attn_proj_alone(capsys) -> None:
    argv = ["plan", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--num-microbatches", "2", "--modules", "attn_proj"]  # fmt: skip
    assert planner_main(argv) == 2
    assert "--modules attn_proj: attn_proj is offloaded without core_attn" in capsys.readouterr().err


def test_recommend_tries_only_allowed_sets(monkeypatch) -> None:
    dims = GPTDims(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=512, micro_batch_size=1)
    planner = StagePlanner(dims, PipelineConfig(pipeline_parallel=2, num_microbatches=4), min_offload_bytes=1)
    tried: list[list[str]] = []
    estimate = planner.estimate
    monkeypatch.setattr(planner, "estimate", lambda modules: tried.append(list(modules)) or estimate(modules))
    recommend(planner, budget_bytes=1 << 20, candidates=["core_attn", "attn_proj", "mlp_fc1"])
    assert sorted(map(sorted, tried)) == sorted(
        map(sorted, [[], ["core_attn"], ["mlp_fc1"], ["core_attn", "attn_proj"], ["core_attn", "mlp_fc1"], ["core_attn", "attn_proj", "mlp_fc1"]])
    )


def test_the_readme_table_lists_every_name_in_order() -> None:
    import re
    from pathlib import Path

    from chunk_offload.module_names import ALIASES, OFFLOAD_MODULE_NAMES

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### Offload-module names", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(\w+)`(?: \(alias `(\w+)`\))? \|", section, flags=re.M)
    assert [name for name, _ in rows] == list(OFFLOAD_MODULE_NAMES)
    assert {alias: name for name, alias in rows if alias} == ALIASES
