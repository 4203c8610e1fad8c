"""A small GPT pretraining script in Megatron-LM's core_v0.19 style, for the launcher's tests.

As Megatron-LM's own ``pretrain_gpt.py`` at core_v0.19: arguments parsed by
``parse_and_validate_args``, a ``PretrainConfigContainer`` built from them, and
``pretrain(cfg_container, datasets_provider, model_type, forward_step)`` with no model provider
(the model is built from the config inside ``pretrain``); with ``--test-model-from provider``
(a flag of the script's own ``extra_args_provider``) a container without a model config and a
model provider instead, which Megatron-LM's ``get_model`` calls with ``config=`` and
``pg_collection=``. Mock data (``--mock-data``), a null
tokenizer, and a loss that every rank prints with full precision so tests can compare runs.
Runs only under megatron-core >= 0.19 (whose wheel ships ``megatron.training``), e.g.::

    torchrun --nproc-per-node 2 -m chunk_offload.megatron_lm tests/megatron_lm/train_gpt_v019.py \
        --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 ... \
        --chunk-offload-modules core_attn
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
import megatron.training.training as megatron_training
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

LOSS_PREFIX = "chunk-offload-test loss"
"""Each training microbatch loss is printed as ``LOSS_PREFIX rank=R value=V`` with V as float.hex()."""
GRAD_NORM_PREFIX = "chunk-offload-test grad-norm"
"""Each step's gradient norm, printed as ``GRAD_NORM_PREFIX rank=R value=V`` (float.hex())."""


def _print_line(text: str) -> None:
    """One write per line: torchrun runs the ranks unbuffered (``python -u``), where ``print`` writes
    the text and its newline separately and the ranks' lines could interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def datasets_provider(num_samples, vp_stage=None):
    """Mock GPT datasets of the requested sizes, built on every rank (no broadcast needed)."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split="1,1,1",
        tokenizer=get_tokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


datasets_provider.is_distributed = True  # every rank builds its own copy


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Mean token loss, in the ``(loss, num_tokens, logged)`` form Megatron-LM's schedules reduce."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    if torch.is_grad_enabled():
        _print_line(f"{LOSS_PREFIX} rank={torch.distributed.get_rank()} value={(loss / tokens).item().hex()}")
    report = torch.cat([loss.detach().view(1), tokens.view(1).float()])
    return loss, tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One microbatch through one model chunk: every chunk reads the batch, the last stage scores it."""
    batch = next(data_iterator)
    tokens = batch["tokens"].long()
    labels = batch["labels"].long()
    output = model(
        tokens, batch["position_ids"].long(), None, labels=labels
    )
    return output, partial(loss_func, batch["loss_mask"])


def script_arguments(parser):
    """The script's own ``extra_args_provider`` (the launcher adds its flags after these)."""
    parser.add_argument_group("train_gpt_v019").add_argument(
        "--test-model-from", choices=("config", "provider"), default="config",
        help="build the model from the config container (core_v0.19) or through model_provider",
    )
    return parser


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """A GPT chunk with the local layer spec, called by Megatron-LM's ``get_model`` with keywords."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(args.num_experts, moe_grouped_gemm=False),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def _print_grad_norm(train_step):
    """Megatron-LM's ``train_step`` that also prints the step's gradient norm with full precision."""

    def step(*args, **kwargs):
        result = train_step(*args, **kwargs)
        grad_norm = result[5]  # (losses, skipped, checkpoint, exit, code, grad_norm, ...) in core_v0.19
        _print_line(f"{GRAD_NORM_PREFIX} rank={torch.distributed.get_rank()} value={float(grad_norm).hex()}")
        return result

    return step


if __name__ == "__main__":
    megatron_training.train_step = _print_grad_norm(megatron_training.train_step)
    args = parse_and_validate_args(extra_args_provider=script_arguments, args_defaults={"tokenizer_type": "NullTokenizer"})
    if args.test_model_from == "provider":
        container = pretrain_cfg_container_from_args(args)
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    else:
        container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)
