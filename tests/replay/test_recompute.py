"""The stage replay of a co-planned stage on CPU: megatron's selective recompute with offload.

Core attention recomputed (``--recompute-modules core_attn``), ``qkv_linear`` offloaded, tiny GPT
in fp32, every saved tensor above one byte offloaded:

- last stage of PP=2, every chunk offloaded (group-start policy): losses, parameter gradients and
  the gradients of the received activations equal those of the same recomputing model without
  offload bit for bit; core attention runs inside megatron's checkpoint without grad, so it opens
  no group and only qkv_linear's groups move;
- stage 0 of PP=2 (the plan's policy, module groups): on CPU the peak is the accounting of the offload groups'
  saved bytes. qkv_linear saves the same bytes with and without the recompute and the recomputed
  core attention saves nothing in a group, so the saved peak equals that of the run without
  recompute offloading qkv_linear alone, and is below that of the run without recompute that
  offloads core attention as well, with and without offload. What megatron's checkpoint keeps
  (core attention's inputs: query, key, value) is outside this accounting; on CUDA the device
  peak counts it;
- the command line: the JSON and the table name the recompute; bad names and combinations are
  usage errors (exit 2) naming the flag, the value and what is accepted.
"""

from __future__ import annotations

import pytest

from chunk_offload import OffloadConfig
from chunk_offload.devkit.gpt import GPTShape

from ._common import assert_equal_tensors, needs_megatron_on_cpu, run_cli

pytestmark = needs_megatron_on_cpu

_SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, micro_batch_size=1, attention="sdpa")
_RECOMPUTE = dict(recompute_granularity="selective", recompute_modules=("core_attn",))


def _replay(stage: int, modules: str, *, recompute: bool, policy="plan", **config: object):
    """``config``: `OffloadConfig` fields besides ``min_offload_bytes=1``."""
    from chunk_offload.replay import megatron_stage, replay

    shape = GPTShape(**_SHAPE, **(_RECOMPUTE if recompute else {}))
    with megatron_stage(shape, pp_size=2, pp_rank=stage) as built:
        assert built.recompute_modules == (["core_attn"] if recompute else [])
        return replay(built, modules=modules, num_microbatches=4, schedule_policy=policy, config=OffloadConfig(min_offload_bytes=1, **config), keep_tensors=True)


def test_recompute_with_offload_is_bit_identical() -> None:
    result = _replay(1, "qkv_linear", recompute=True, policy=None)
    base, off = result.baseline, result.offload
    assert result.recompute_modules == ["core_attn"] and result.modules == ["qkv_linear"]
    assert len(base.losses) == len(off.losses) == 4
    assert all(x.equal(y) for x, y in zip(base.losses, off.losses, strict=True))
    assert_equal_tensors(base.grads, off.grads, "parameter gradients")
    assert sum(int(g.count_nonzero()) for g in base.grads.values()) > 0
    assert_equal_tensors(base.input_grads, off.input_grads, "gradients of the received activations")
    assert set(off.last.groups) == {"qkv_linear"}
    assert off.bytes_offloaded == sum(sum(b) for b in base.last.group_bytes.values()) > 0
    assert result.measured_drop == result.theoretical_drop  # 1F1B on the last stage: no chunk waits, no drop


def test_recompute_lowers_the_saved_peak() -> None:
    # Module groups, one per offload module call (the default joins a layer's calls into one group).
    recomputed = _replay(0, "qkv_linear", recompute=True, group_by="module")
    qkv_only = _replay(0, "qkv_linear", recompute=False, group_by="module")
    both = _replay(0, "core_attn,qkv_linear", recompute=False, group_by="module")
    qkv, core = both.baseline.last.group_bytes[(0, 0)][:2]
    # Per layer, in call order: qkv_linear then core_attn without recompute; qkv_linear alone with it.
    assert both.baseline.last.group_bytes[(0, 0)] == [qkv, core] * 2 and core > 0
    assert recomputed.baseline.last.group_bytes == qkv_only.baseline.last.group_bytes
    assert recomputed.baseline.last.group_bytes[(0, 0)] == [qkv] * 2
    assert (recomputed.baseline.peak_bytes, recomputed.offload.peak_bytes) == (qkv_only.baseline.peak_bytes, qkv_only.offload.peak_bytes)
    assert recomputed.baseline.peak_bytes < both.baseline.peak_bytes
    assert recomputed.offload.peak_bytes < both.offload.peak_bytes
    assert recomputed.measured_drop == recomputed.theoretical_drop > 0


def test_cli_names_the_recompute(tmp_path, capsys) -> None:
    printed, summary = run_cli(capsys, tmp_path / "r.json", "--pp", "2", "--stage", "0", "--modules", "qkv_linear",
                               "--recompute-modules", "core_attn")  # fmt: skip
    assert summary["recompute_modules"] == ["core_attn"] and summary["modules"] == ["qkv_linear"]
    assert summary["args"]["recompute_modules"] == ["core_attn"] and summary["R"] == 1.0
    assert "sdpa attention, recompute core_attn" in printed
    assert "offloaded modules: qkv_linear; recomputed: core_attn (both columns); policy: " in printed


_CLI = ["--pp", "2", "--stage", "0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modules", "qkv_linear", "--recompute-modules", "mlp"],
         "argument --recompute-modules: 'mlp' cannot be recomputed in the replay: megatron-core 0.16.1's mlp recompute "
         "hangs on CPU even without offload, and the planner does not model it; choose from ['core_attn']"),
        (["--modules", "qkv_linear", "--recompute-modules", "moe"],
         "argument --recompute-modules: 'moe' cannot be recomputed in the replay: it recomputes MoE layers, and the "
         "replay builds a dense GPT (no MoE layers); choose from ['core_attn']"),
        (["--modules", "qkv_linear", "--recompute-modules", "core_attn", "attention"],
         "argument --recompute-modules: invalid choice: 'attention' (choose from 'core_attn')"),
        (["--modules", "core_attn,qkv_linear", "--recompute-modules", "core_attn"],
         "argument --recompute-modules: core_attn is offloaded too (--modules core_attn,qkv_linear): a recomputed "
         "module's forward saves nothing to offload; drop it from --modules or from --recompute-modules"),
        (["--modules", "attn_proj"], "chunk_offload: --modules attn_proj: attn_proj is offloaded without core_attn"),
        (["--modules", "qkv_linear", "--recompute-modules", "core_attn", "--modules", "mlp_fc2"],
         "--modules: chunk_offload: unknown offload module 'mlp_fc2'"),
    ],
    ids=["mlp", "moe", "unknown", "recomputed_and_offloaded", "attn_proj_alone", "unknown_offload"],
)
def test_cli_usage_errors(argv: list[str], message: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "chunk_offload.replay", *_CLI, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_attn_proj_with_recomputed_core_attn_is_allowed() -> None:
    from chunk_offload.replay.__main__ import parse_args

    args = parse_args([*_CLI, "--modules", "attn_proj", "--recompute-modules", "core_attn"])
    assert (args.modules, args.recompute_modules) == ("attn_proj", ["core_attn"])
