"""`EntryPoints` against core_v0.16's entry-point signatures, in one process.

The megatron-core 0.16.1 wheel has no ``megatron.training`` (Megatron-LM's checkout brings it),
so stand-in modules with core_v0.16's signatures take its place here: ``pretrain(datasets_provider,
model_provider, model_type, forward_step, process_non_loss_data_func=None, extra_args_provider=None,
args_defaults={})`` and ``initialize_megatron(extra_args_provider=None, ...)``, which parse the
command line with the provider as Megatron-LM does and call the model provider per virtual stage
with keywords. Megatron-LM's own ``pretrain`` (0.19) runs in test_launcher_v019.py.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

import pytest

from chunk_offload.megatron_lm import EntryPoints

_NAMES = ("megatron.training", "megatron.training.training", "megatron.training.arguments", "megatron.training.initialize")


class _StandIn:
    """core_v0.16-shaped entry points recording what they were given."""

    def __init__(self, argv: list[str], vp: int) -> None:
        self.argv, self.vp = argv, vp
        self.args: argparse.Namespace | None = None
        self.provider_calls: list[dict[str, Any]] = []

    def parse(self, extra_args_provider: Any) -> argparse.Namespace:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        parser.add_argument("--pipeline-model-parallel-size", type=int, default=2)
        parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=self.vp)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        self.args = parser.parse_args(self.argv)
        return self.args

    def initialize_megatron(self, extra_args_provider=None, args_defaults={}, ignore_unknown_args=False, allow_no_cuda=False):
        self.parse(extra_args_provider)

    def pretrain(self, train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                 process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}):  # fmt: skip
        self.initialize_megatron(extra_args_provider=extra_args_provider)
        return [model_provider(pre_process=i == 0, post_process=i == self.vp - 1, vp_stage=i, config="config", pg_collection="pgs") for i in range(self.vp)]

    def get_args(self) -> argparse.Namespace:
        return self.args


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    def make(argv: list[str], vp: int = 2) -> _StandIn:
        fake = _StandIn(argv, vp)
        for name in _NAMES:
            module = types.ModuleType(name)
            module.get_args = fake.get_args
            if name != "megatron.training.arguments":
                module.initialize_megatron = fake.initialize_megatron
            if name in ("megatron.training", "megatron.training.training"):
                module.pretrain = fake.pretrain
            monkeypatch.setitem(sys.modules, name, module)
        return fake

    return make


def _script_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--script-flag", default="unset")
    return parser


def test_pretrain_composes_the_scripts_provider_and_passes_provider_kwargs_through(stand_in) -> None:
    fake = stand_in(["--script-flag", "kept", "--chunk-offload-report", "out/r"])
    calls = []

    def model_provider(pre_process=True, post_process=True, vp_stage=None, **kwargs):
        calls.append({"vp_stage": vp_stage, **kwargs})
        return f"chunk{vp_stage}"

    with EntryPoints() as entry_points:
        pretrain = sys.modules["megatron.training"].pretrain
        assert pretrain is sys.modules["megatron.training.training"].pretrain is not fake.pretrain
        chunks = pretrain(None, model_provider, None, None, extra_args_provider=_script_args)
    assert chunks == ["chunk0", "chunk1"]
    assert calls == [{"vp_stage": 0, "config": "config", "pg_collection": "pgs"}, {"vp_stage": 1, "config": "config", "pg_collection": "pgs"}]
    assert fake.args.script_flag == "kept" and fake.args.chunk_offload_report == "out/r"
    assert fake.args.chunk_offload_modules is None and entry_points.manager is None  # nothing to attach
    assert sys.modules["megatron.training"].pretrain == fake.pretrain  # restored
    assert entry_points.wrapped == ()


def test_positional_provider_and_none_are_composed_too(stand_in) -> None:
    fake = stand_in(["--chunk-offload-min-offload-bytes", "1KiB"], vp=1)
    with EntryPoints():
        sys.modules["megatron.training.initialize"].initialize_megatron(None)
        assert fake.args.chunk_offload_min_offload_bytes == 1024
        sys.modules["megatron.training"].initialize_megatron(_script_args)
        assert fake.args.script_flag == "unset"


def test_a_provider_that_already_adds_our_flags_is_left_alone(stand_in) -> None:
    from chunk_offload.integrations.megatron import add_arguments

    fake = stand_in(["--chunk-offload-modules", "core_attn"], vp=1)
    with EntryPoints():
        sys.modules["megatron.training"].initialize_megatron(extra_args_provider=add_arguments)  # no "already defines"
    assert fake.args.chunk_offload_modules == ["core_attn"]
