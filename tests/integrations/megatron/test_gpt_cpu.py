"""megatron-core trains a tiny GPTModel on CPU ranks (gloo) with its own schedules: PP, VPP, EP.

Each test spawns two ranks once and trains the same run twice in them; the two runs must agree
bit for bit (losses, gradients, parameters), every loss must be finite, and no tensor may leave
the CPU. A hang dumps every rank's stacks and fails the test (see ``tests._megatron.spawn_runs``); the last
test checks that guard.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from tests._megatron import NEEDS_MEGATRON_ON_CPU, Hooks, RankResult, Run, TinyGPTConfig, spawn_runs

pytestmark = NEEDS_MEGATRON_ON_CPU

# Hang guard for the children (faulthandler) and the parent's join; a normal test takes ~10-20 s.
_TIMEOUT_S = 90.0

_CONFIGS = {
    "pp2": TinyGPTConfig(pipeline_parallel=2),
    "pp2_vpp2": TinyGPTConfig(pipeline_parallel=2, virtual_pipeline=2),
    "ep2_moe4": TinyGPTConfig(expert_parallel=2, num_experts=4),
}


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: different names"
    differing = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differing, f"{what} differ: {differing[:5]}"


def _assert_on_cpu(result: RankResult) -> None:
    assert result.non_cpu_tensors == 0, f"rank {result.rank}: {result.non_cpu_tensors} tensors off the CPU"
    assert result.device_rewrites > 0, f"rank {result.rank}: cpu_compat redirected nothing; was it active?"
    tensors = [*result.params.values(), *result.grads.values(), *(l for it in result.losses for l in it)]
    assert all(t.device.type == "cpu" for t in tensors)


def _assert_reproducible(first: list[RankResult], second: list[RankResult]) -> None:
    for a, b in zip(first, second, strict=True):
        assert len(a.losses) == len(b.losses)
        for i, (la, lb) in enumerate(zip(a.losses, b.losses)):
            assert all(torch.equal(x, y) for x, y in zip(la, lb, strict=True)), (
                f"rank {a.rank} iteration {i}: losses {a.mean_losses()} vs {b.mean_losses()}"
            )
        _assert_same_tensors(a.grads, b.grads, f"rank {a.rank} gradients")
        _assert_same_tensors(a.params, b.params, f"rank {a.rank} parameters")
        assert a.param_digest() == b.param_digest()


def _check(
    name: str, expected_loss_ranks: set[int], extra: tuple[Run, ...] = ()
) -> list[list[RankResult]]:
    """Train ``name`` twice (plus ``extra`` runs) in one pair of ranks and check every run."""
    cfg = _CONFIGS[name]
    results = spawn_runs([Run(config=cfg), Run(config=cfg), *extra], world_size=2, timeout_s=_TIMEOUT_S)
    for run in results:
        assert {r.rank for r in run if r.is_last_stage} == expected_loss_ranks
        for r in run:
            _assert_on_cpu(r)
            if r.rank in expected_loss_ranks:
                assert len(r.losses) == cfg.iterations
                assert all(len(it) == cfg.num_microbatches for it in r.losses)
                assert all(math.isfinite(float(x)) for it in r.losses for x in it), r.mean_losses()
            else:
                assert r.losses == []
            assert r.grads, f"rank {r.rank}: no gradients"
    _assert_reproducible(results[0], results[1])
    return results


def test_pipeline_parallel_2():
    results = _check("pp2", expected_loss_ranks={1})
    # The first stage holds the embedding, the last the output layer.
    first, last = results[0]
    assert any("embedding" in n for n in first.params) and not any("output_layer" in n for n in first.params)
    assert any("output_layer" in n for n in last.params) and not any("embedding" in n for n in last.params)


class _CountingHooks:
    """Hooks that observe without changing anything: the shape of an offload-vs-baseline comparison."""

    def __init__(self) -> None:
        self.chunk_forwards = 0
        self.iterations = 0

    def wrap_model(self, chunks):
        for chunk in chunks:
            chunk.register_forward_pre_hook(self._count_forward)
        return chunks

    def _count_forward(self, module, args):
        self.chunk_forwards += 1

    def wrap_forward_backward(self, forward_backward):
        def counted(**kwargs):
            self.iterations += 1
            return forward_backward(**kwargs)

        return counted

    def report(self, chunks):
        return {"chunk_forwards": self.chunk_forwards, "iterations": self.iterations}


def test_interleaved_virtual_pipeline_2x2():
    cfg = _CONFIGS["pp2_vpp2"]
    counting = _CountingHooks()
    hooks = Hooks(
        wrap_model=counting.wrap_model,
        wrap_forward_backward=counting.wrap_forward_backward,
        report=counting.report,
    )
    results = _check("pp2_vpp2", expected_loss_ranks={1}, extra=(Run(config=cfg, hooks=hooks),))
    for r in results[0]:
        assert {n.split(".", 1)[0] for n in r.params} == {"chunk0", "chunk1"}
    # The hooks ran in the children, shared one object there, and changed nothing.
    for r in results[2]:
        assert r.extra == {
            "chunk_forwards": cfg.iterations * cfg.num_microbatches * cfg.virtual_pipeline,
            "iterations": cfg.iterations,
        }
    _assert_reproducible(results[0], results[2])


def test_expert_parallel_2_moe_allgather():
    # The extra run also backpropagates through torch.autograd.backward rather than megatron's
    # custom_backward (see NOTE [ Device mode in backward ] in devkit/_cpu_replacements.py);
    # neither changes numerics.
    alltoall = dataclasses.replace(
        _CONFIGS["ep2_moe4"], moe_token_dispatcher="alltoall", deallocate_pipeline_outputs=False
    )
    results = _check("ep2_moe4", expected_loss_ranks={0, 1}, extra=(Run(config=alltoall),))
    rank0, rank1 = results[0]
    experts = [n for n in rank0.params if ".experts." in n]
    assert experts, "no expert parameters; is the MoE layer built?"
    # Dense weights are data-parallel replicas and stay equal; each rank holds different experts.
    dense = {n: t for n, t in rank0.params.items() if ".experts." not in n}
    _assert_same_tensors(dense, {n: rank1.params[n] for n in dense}, "dense replicas")
    assert any(not torch.equal(rank0.params[n], rank1.params[n]) for n in experts)
    # The alltoall dispatcher (numpy split sizes, side stream) trains too. On this config it sends
    # the same tokens to the same experts and combines them in the same order as allgather, and
    # the results agree bit for bit; a difference here is a dispatcher change, not a CPU problem.
    for a, b in zip(results[0], results[2], strict=True):
        assert all(torch.equal(x, y) for la, lb in zip(a.losses, b.losses) for x, y in zip(la, lb)), (
            f"rank {a.rank}: allgather {a.mean_losses()} vs alltoall {b.mean_losses()}"
        )
        _assert_same_tensors(a.params, b.params, f"rank {a.rank} allgather vs alltoall parameters")


_HANG_TIMEOUT_S = 20.0


def _recv_forever_on_rank_0(forward_backward):
    """A ``wrap_forward_backward`` hook that makes rank 0 wait for a message nobody sends.

    Rank 1 then waits for rank 0 in its pipeline receive. Both ranks' watchdogs are armed for the
    same time, and if rank 1's fired first, rank 0's receive would fail on the closed connection
    instead of dumping its stack: rank 1's watchdog is pushed 15 s later so that rank 0's fires.
    """
    import faulthandler

    import torch.distributed as dist

    if dist.get_rank() != 0:
        faulthandler.dump_traceback_later(_HANG_TIMEOUT_S + 15.0, exit=True)
        return forward_backward

    def stuck(**kwargs):
        dist.recv(torch.empty(1), src=1)

    return stuck


def test_a_hang_dumps_stacks_and_fails(capfd):
    hang = Run(config=_CONFIGS["pp2"], hooks=Hooks(wrap_forward_backward=_recv_forever_on_rank_0))
    started = time.monotonic()
    # Rank 0 times out and exits; rank 1 then either errors out of its receive (the connection
    # closed) or is terminated, depending on timing, so the exception type is not fixed.
    with pytest.raises(Exception, match="exited with code|terminated with the following error"):
        spawn_runs([hang], world_size=2, timeout_s=_HANG_TIMEOUT_S)
    assert time.monotonic() - started < _HANG_TIMEOUT_S + 30.0
    err = capfd.readouterr().err
    assert "Timeout (0:00:20)!" in err, err[-2000:]
    assert "in stuck" in err, err[-2000:]  # the hung rank's stack shows where it waits
