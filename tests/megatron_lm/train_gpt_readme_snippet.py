"""The README's snippet for users who keep their own Megatron-LM script, run as written.

Takes the ``python`` block under "If you keep your own script" from README.md, runs it (all but
its last line, ``pretrain(...)``, whose arguments it elides) around `train_gpt_v019.model_provider`,
and trains with Megatron-LM's ``pretrain`` as that line says: ``offloading_model_provider`` as the
model provider, our flags through ``extra_args_provider``. No launcher: on a CPU-only host this
script enables the CPU rules itself. After training it writes the report and closes the manager,
as the launcher would. Run with ``torchrun``; the test compares its losses with the launcher's.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch
from megatron.core.enums import ModelType
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from train_gpt_v019 import _print_grad_norm, datasets_provider, forward_step, model_provider

import megatron.training.training as megatron_training
from chunk_offload.integrations.megatron import add_arguments, attach_from_args
from chunk_offload.integrations.megatron.reporting import write_rank_reports

README = Path(__file__).resolve().parents[2] / "README.md"
_MARKER = "If you keep your own script"


def readme_snippet() -> str:
    """The first ``python`` block after the marker sentence, without its final ``pretrain(...)`` line."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text[text.index(_MARKER) :], flags=re.DOTALL)
    lines = block.group(1).rstrip("\n").splitlines()
    assert lines[-1].startswith("pretrain("), lines[-1]
    return "\n".join(lines[:-1])


def cpu_rules() -> contextlib.AbstractContextManager:
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from chunk_offload.devkit import cpu_compat, megatron_training_cpu

    stack = contextlib.ExitStack()
    stack.enter_context(cpu_compat.megatron_on_cpu())
    stack.enter_context(megatron_training_cpu.training_on_cpu())
    return stack


if __name__ == "__main__":
    namespace = {"model_provider": model_provider, "get_args": get_args, "attach_from_args": attach_from_args}
    exec(compile(readme_snippet(), str(README), "exec"), namespace)
    megatron_training.train_step = _print_grad_norm(megatron_training.train_step)
    with cpu_rules():
        args = parse_and_validate_args(extra_args_provider=add_arguments, args_defaults={"tokenizer_type": "NullTokenizer"})
        pretrain(
            pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder, forward_step,
            model_provider=namespace["offloading_model_provider"],
        )
        (manager,) = namespace["managers"]
        write_rank_reports(manager, args.chunk_offload_report)
        manager.close()
