"""cpu_compat in one process: what it redirects, that it undoes all of it, and that it is inert with CUDA."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason='megatron-core is not installed (pip install "chunk-offload[megatron]")',
)

# The attributes cpu_compat may replace, read fresh each time (they are module attributes).
_WATCHED = [
    (torch.cuda, "current_device"),
    (torch.cuda, "Stream"),
    (torch.cuda, "Event"),
    (torch.cuda, "current_stream"),
    (torch.cuda, "default_stream"),
    (torch.cuda, "stream"),
    (torch.cuda, "synchronize"),
    (torch.cuda, "get_rng_state"),
    (torch.cuda, "set_rng_state"),
    (torch.cuda, "manual_seed"),
    (torch.autograd, "_engine_run_backward"),
    (torch.autograd.graph, "_engine_run_backward"),
    (torch.distributed, "isend"),
    (torch.distributed.distributed_c10d, "isend"),
]

_MISSING = object()


@pytest.fixture(scope="module")
def cpu_compat():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron warns that Apex / TE are missing
        from chunk_offload.devkit import cpu_compat as module
    return module


@pytest.fixture(scope="module")
def mcore(cpu_compat):
    import megatron.core.tensor_parallel.random as random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    return random, moe_utils, token_dispatcher


def _snapshot(mcore):
    random, moe_utils, token_dispatcher = mcore
    watched = _WATCHED + [
        (random, "_get_cuda_rng_state"),
        (random, "_set_cuda_rng_state"),
        (moe_utils, "te_general_gemm"),
        (token_dispatcher, "maybe_move_tensor_to_cpu"),
    ]
    return {(owner.__name__, name): getattr(owner, name, _MISSING) for owner, name in watched}


@pytest.fixture(autouse=True)
def no_leaked_handle(cpu_compat, mcore):
    before = _snapshot(mcore)
    yield
    assert cpu_compat._active_handle is None, "a test left cpu_compat enabled"
    assert torch.overrides._get_current_function_mode_stack() == []
    assert _snapshot(mcore) == before, "a test left an attribute patched"


@pytest.fixture
def cuda_absent():
    if torch.cuda.is_available():
        pytest.skip("cpu_compat is inert on a CUDA host; these tests exercise the CPU redirection")


def test_enable_patches_and_disable_restores(cpu_compat, mcore, cuda_absent):
    before = _snapshot(mcore)
    handle = cpu_compat.enable()
    try:
        assert handle.active
        assert torch.cuda.current_device() == 0
        changed = {k for k, v in _snapshot(mcore).items() if v is not before[k]}
        # megatron-core 0.19 binds te_general_gemm (None without TE) itself: nothing to patch there.
        bound = before[(mcore[1].__name__, "te_general_gemm")] is not _MISSING
        expected = set(before) - ({(mcore[1].__name__, "te_general_gemm")} if bound else set())
        assert changed == expected, f"not patched: {expected - changed}"
        assert len(handle.patched) == len(expected)
    finally:
        handle.disable()
    assert not handle.active and handle.patched == ()
    assert _snapshot(mcore) == before
    handle.disable()  # idempotent


def test_inert_when_cuda_is_available(cpu_compat, mcore, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _snapshot(mcore)
    with cpu_compat.megatron_on_cpu() as handle:
        assert not handle.active
        assert handle.patched == ()
        assert _snapshot(mcore) == before
        assert torch.overrides._get_current_function_mode_stack() == []


def test_factories_and_moves_land_on_cpu(cpu_compat, cuda_absent):
    with cpu_compat.megatron_on_cpu() as handle:
        made = [
            torch.empty(2, device=torch.cuda.current_device()),
            torch.ones(2, device="cuda"),
            torch.zeros(2, device=torch.device("cuda", 0)),
            torch.arange(3, device="cuda:0"),
            torch.tensor([1.0], device=0),
            torch.zeros(2).cuda(),
            torch.zeros(2).to("cuda"),
            torch.zeros(2).to(torch.cuda.current_device()),
            torch.zeros(2).to(device="cuda", dtype=torch.float64),
            torch.zeros(2).new_zeros(3, device="cuda"),
            torch.empty(2, pin_memory=True),
            torch.zeros(2).pin_memory(),
        ]
        assert all(t.device.type == "cpu" for t in made)
        assert handle.device_rewrites == 10
        # A move "to the device" never aliases its source, as on a GPU; a move within the CPU may.
        src = torch.zeros(2)
        for moved in (src.cuda(), src.to("cuda"), src.to(0), src.to(device="cuda"), src.pin_memory()):
            assert moved.data_ptr() != src.data_ptr() and torch.equal(moved, src)
        assert src.to("cpu") is src
        assert handle.device_rewrites == 14
        # Requests that were not for CUDA are left alone.
        assert torch.zeros(2, device="cpu").device.type == "cpu"
        assert torch.zeros(2).to(torch.float64).dtype == torch.float64
        assert handle.device_rewrites == 14


def test_default_causal_mask_is_built_on_cpu(cpu_compat, cuda_absent):
    # The local attention builds it with device="cuda" when no mask is passed.
    from megatron.core.transformer.utils import get_default_causal_mask

    with cpu_compat.megatron_on_cpu():
        mask = get_default_causal_mask(4)
    assert torch.equal(mask, torch.ones(4, 4).triu(diagonal=1).bool())


def test_alltoall_split_sizes_become_numpy(cpu_compat, mcore, cuda_absent):
    token_dispatcher = mcore[2]
    splits = torch.tensor([3, 1])
    with cpu_compat.megatron_on_cpu():
        as_numpy = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
        kept = token_dispatcher.maybe_move_tensor_to_cpu(splits)
    assert as_numpy.tolist() == [3, 1] and not torch.is_tensor(as_numpy)
    assert kept is splits


class _AllocatesInBackward(torch.autograd.Function):
    """Like megatron's `_GatherFromSequenceParallelRegion`: allocates on the current device in backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
        return out.copy_(grad * 2)


@pytest.mark.parametrize("entry", ["tensor.backward", "autograd.backward", "autograd.grad"])
def test_backward_runs_with_the_device_rewrite(cpu_compat, cuda_absent, entry):
    # See NOTE [ Device mode in backward ]: these entries are torch functions themselves.
    with cpu_compat.megatron_on_cpu():
        x = torch.ones(3, requires_grad=True)
        loss = _AllocatesInBackward.apply(x).sum()
        if entry == "tensor.backward":
            loss.backward()
            grad = x.grad
        elif entry == "autograd.backward":
            torch.autograd.backward(loss)
            grad = x.grad
        else:
            (grad,) = torch.autograd.grad(loss, x)
    assert torch.equal(grad, torch.full((3,), 2.0))


def test_rng_tracker_forks_the_cpu_generator(cpu_compat, mcore, cuda_absent, caplog):
    random = mcore[0]
    with cpu_compat.megatron_on_cpu():
        random.initialize_rng_tracker(force_reset=True)
        tracker = random.get_cuda_rng_tracker()
        torch.manual_seed(7)
        tracker.add("forked", 11)
        torch.manual_seed(7)
        expected_outer = torch.rand(4)

        torch.manual_seed(7)
        with caplog.at_level(logging.WARNING, logger=random.__name__):
            with tracker.fork("forked"):
                first = torch.rand(4)
            outer = torch.rand(4)
            with tracker.fork("forked"):
                second = torch.rand(4)
        # The fork draws from its own state, continues it on the next fork, and leaves the
        # outer sequence where it was. See NOTE [ One generator on CPU ].
        torch.manual_seed(11)
        assert torch.equal(torch.cat([first, second]), torch.rand(8))
        assert torch.equal(outer, expected_outer)
        assert not caplog.records, "megatron's RNG-fork warning should be filtered"
        random.initialize_rng_tracker(force_reset=True)


def test_model_parallel_seed_needs_no_cuda(cpu_compat, mcore, cuda_absent):
    random = mcore[0]
    with cpu_compat.megatron_on_cpu():
        random.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True)
        states = random.get_cuda_rng_tracker().get_states()
        assert set(states) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
        assert all(s.device.type == "cpu" for s in states.values())
        random.initialize_rng_tracker(force_reset=True)


def test_streams_and_events_are_synchronous_stand_ins(cpu_compat, cuda_absent):
    with cpu_compat.megatron_on_cpu():
        side = torch.cuda.Stream()
        default = torch.cuda.current_stream()
        assert torch.cuda.default_stream() is default
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
            side.wait_stream(default)
            event = side.record_event()
        assert torch.cuda.current_stream() is default
        default.wait_event(event)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        end.record()
        assert start.query() and end.elapsed_time(end) == 0.0 and start.elapsed_time(end) >= 0.0
        torch.cuda.synchronize()
        with torch.cuda.stream(None):
            assert torch.cuda.current_stream() is default


def test_te_general_gemm_is_bound_only_while_enabled(cpu_compat, mcore, cuda_absent):
    moe_utils = mcore[1]
    had_it = hasattr(moe_utils, "te_general_gemm")
    with cpu_compat.megatron_on_cpu():
        assert hasattr(moe_utils, "te_general_gemm")
        if not had_it:
            assert moe_utils.te_general_gemm is None
    assert hasattr(moe_utils, "te_general_gemm") == had_it


def test_second_enable_is_refused(cpu_compat, cuda_absent):
    from chunk_offload.core.errors import ChunkOffloadError

    with cpu_compat.megatron_on_cpu():
        with pytest.raises(ChunkOffloadError, match="already enabled"):
            cpu_compat.enable()


def test_disable_refuses_to_pop_a_later_mode(cpu_compat, cuda_absent):
    from chunk_offload.core.errors import ChunkOffloadError

    class Later(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    handle = cpu_compat.enable()
    try:
        with Later():
            with pytest.raises(ChunkOffloadError, match="exit that mode first"):
                handle.disable()
            assert handle.active
    finally:
        handle.disable()


def test_import_without_megatron_names_the_extra():
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "import chunk_offload.integrations.megatron  # the package itself stays importable\n"
        "import chunk_offload.devkit.cpu_compat\n"
    )
    repo_root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=repo_root
    )
    assert proc.returncode != 0
    assert 'pip install "chunk-offload[megatron]"' in proc.stderr
    assert "ImportError" in proc.stderr


def test_isend_sends_a_private_copy_of_a_cpu_tensor(cuda_absent):
    """NOTE [ Sends own their buffer ]: what gloo reads later is not the caller's (freed) buffer."""
    from chunk_offload.devkit._cpu_replacements import isend_owning_buffer

    sent = []
    isend = isend_owning_buffer(lambda tensor, *args, **kwargs: sent.append((tensor, args, kwargs)) or "work")
    x = torch.arange(6.0)
    assert isend(x, 1, group=None, tag=3) == "work"
    (copy, args, kwargs), = sent
    assert args == (1,) and kwargs == {"group": None, "tag": 3}
    assert copy is not x and copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    x.data = torch.empty(1)  # what Megatron's deallocate_output_tensor does after the send
    assert torch.equal(copy, torch.arange(6.0))


def test_isend_is_patched_at_both_bindings_so_p2pop_accepts_it(cpu_compat, cuda_absent):
    import torch.distributed as dist

    with cpu_compat.megatron_on_cpu():
        assert dist.isend is dist.distributed_c10d.isend
        op = dist.P2POp.__new__(dist.P2POp, dist.isend, torch.zeros(1), 0)  # validates op against c10d's isend
        assert op is not None
