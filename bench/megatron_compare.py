"""chunk-offload side by side with megatron-core's fine-grained activation offloading (issue 26).

One GPT on one device, trained through megatron's own no-pipelining schedule (PP=1,
``get_forward_backward_func()`` in a one-process world), which is how both offloads are meant
to be used. For each ``--modules`` set, three runs or more one after another, each on a fresh
build of the model from the same seed (so the same weights and inputs):

- none: no offload (one run, shown in every set: it offloads nothing, whatever the modules);
- chunk-offload: `chunk_offload.integrations.megatron.attach` with its defaults (at PP=1 every
  backward follows its forward at once: the default plan copies all but a chunk's last groups,
  NOTE [Kept tail] in chunk_offload/core/ordering.py; on CUDA each chunk's reload-ahead budget
  comes from the copy timing its last iteration measured, NOTE [Timed reload ahead by default]
  in chunk_offload/integrations/plan_tracking.py);
- chunk-offload budget: the same with ``device_budget_bytes`` (``--budget-bytes``; default:
  megatron's measured peak for these modules on CUDA, i.e. the same memory, else half of
  chunk-offload's saved peak; where reloads are timed its chunks reload ahead by the timing as
  far as the predicted peak stays within the budget; where the default layer groups cannot reach
  it they are split during the warm-up, NOTE [Budget splits layer groups] in
  chunk_offload/integrations/layer_split.py);
- chunk-offload reload-ahead (only with ``--reload-ahead-bytes``): the default run with that
  `PlanPolicy` reload-ahead budget (in backward, earlier groups are reloaded while their bytes fit);
- chunk-offload module (only with ``--module-groups``): the default run with
  ``OffloadConfig(group_by="module")``: each offload module's call a group of its own, where the
  default joins a layer's calls into one group while it holds under 16 MiB (NOTE [Bounded layer
  groups] in chunk_offload/core/marks.py);
- megatron: megatron-core's built-in offload (``fine_grained_activation_offloading``, same
  modules, same minimum size), with a stand-in for Transformer Engine's flag where TE is
  missing (NOTE [ Transformer Engine stand-in ] in ``chunk_offload/replay/megatron_builtin.py``);
- none again (only with ``--none-again``): the run without offload once more, last: the
  overheads are then over the mean of both runs' median steps (and the faster of their fastest
  steps), and the two rows' own overheads show how far the host drifted during the set.

Each run trains in a fresh process of its own (``--processes per-run``, the default): it starts
with no device memory another run left allocated, no allocator cache another model shaped, no
megatron singleton and no profiler residue, so each row measures that run alone. A run that
fails (out of memory, say) is one ``failed`` row, the others still run, and the exit status is 1.
The run without offload saves its gradients to a file in a temporary folder; every other run
compares its own with them in its process, on its device, before any profiled step (no model's
worth copied to host and written per run); its results come back pickled; each row's
``process_s`` in the JSON is its process's whole time, interpreter start included.
``--processes one`` runs them one after another in this process instead (a few seconds less per
run): each run then measures what is still allocated before it builds its model, takes it off its
peak and adds it to its budget, and the table names it.

With ``--profile N``, each run trains N more steps under cProfile, and the table is followed by
what each run adds to the host time of a step over the run without offload, by function (own
time per layer call): where an engine's host path goes (issue 26 item 4); on CUDA then N more
under torch.profiler, for the CUDA runtime and driver calls each run adds (copies, events, stream
waits, allocations, synchronisations), which cProfile sees only inside the Python calls that make
them. In a run's own process the profiled steps follow its timed ones; with ``--processes one``
each run is built again once every run is timed, so that no profiler's residue slows the times.

NOTE [Copies on CPU]
On CPU, megatron's built-in copies synchronously on the calling thread; chunk-offload's default CPU
streams (`chunk_offload.CpuStreams`) run each copy on a worker thread, which takes the GIL and a
core from compute (2 cores; 16 layers, hidden 64, 8 microbatches, the five modules of issue 26:
chunk-offload's overhead 2.51x megatron's on worker threads, 0.92x inline:
bench/results/2026-11-28-cpu-b). So that the CPU table compares the two host paths alike, chunk-offload's runs copy
inline there (`bench/_inline_streams.py`: each copy issued at once on the calling thread, the
engine's whole host path otherwise); ``--cpu-copies threads`` measures its CPU streams instead.
On CUDA every run uses its engine's own CUDA streams, whatever the flag.

Each iteration is timed with the device synchronised before and after; the peak is
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, less what was still
allocated before the run built its model (on CPU: chunk-offload's accounting of saved bytes,
n/a for the others); each row's ``wall_s`` in the JSON is the run's time from its build to its
last measured iteration; the JSON is written after each run too (``"complete": false`` until
every set, and the profiles, ran; a set's overheads once all its runs ended), so that a
comparison a time limit stops leaves every run that ended before it. Losses are those of the first measured iteration; grads those of the last; both are
compared with ``torch.equal`` to the run without offload. On CUDA, flash attention's backward is
not deterministic, so grads may differ without any offload; the losses (forward only) are the
fair check there, or every run on deterministic kernels (``--deterministic``,
`chunk_offload.devkit.deterministic`; the step times are then those kernels').

    python bench/megatron_compare.py --layers 8 --hidden 4096 --heads 32 --seq 4096 --microbatches 4 \\
        --dtype bf16 --modules core_attn,qkv_linear --modules attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from chunk_offload.core.errors import ChunkOffloadError
from chunk_offload.devkit.gpt import ATTENTIONS, GPTShape
from chunk_offload.devkit.host_profile import over
from chunk_offload.module_names import canonical_modules
from chunk_offload.replay import megatron_builtin as builtin

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare_text import format_profiles, format_table, write_json  # noqa: E402  (this bench's text and JSON)
from _compare_run import DTYPES, TIMED, run_alone, run_once  # noqa: E402  (one run)
from _own_process import RunFailed, in_own_process  # noqa: E402

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; usage errors exit with status 2."""
    p = argparse.ArgumentParser(prog="bench/megatron_compare.py", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2, help="transformer layers")
    p.add_argument("--hidden", type=int, default=64, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch")
    p.add_argument("--microbatches", type=int, default=2, help="microbatches per iteration")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the whole model is cast to it")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa", help="core attention (default sdpa)")
    p.add_argument("--modules", action="append", default=None, help="comma-separated offload modules; repeat for several sets")
    p.add_argument("--min-offload-bytes", type=int, default=1 << 20, help="saved tensors below this stay on device")
    p.add_argument("--budget-bytes", type=int, default=None, help="device budget of the budget run (default: see above)")
    p.add_argument("--reload-ahead-bytes", type=int, default=None, help="also run chunk-offload with this reload-ahead budget")
    p.add_argument("--timed-reload-ahead", choices=sorted(TIMED), nargs="?", const="on", default="auto",
                   help="every chunk-offload run's timed_reload_ahead (default auto: the library's, on CUDA only; alone: on)")
    p.add_argument("--module-groups", action="store_true",
                   help="also run chunk-offload with group_by='module' (the default groups small modules by layer)")
    p.add_argument("--none-again", action="store_true",
                   help="run 'none' again after each set's other runs; overheads over both (a drifting host shows)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N more steps per run: host time by function over 'none' (0: none)")
    p.add_argument("--iterations", type=int, default=4, help="measured iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations per run (megatron's offload needs >= 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--processes", choices=("per-run", "one"), default="per-run",
                   help="each run in a fresh process of its own, or every run in this one (default per-run)")
    p.add_argument("--cpu-copies", choices=("inline", "threads"), default="inline",
                   help="CPU only: chunk-offload's copies inline, as megatron's run on CPU (default), or on the library's "
                        "CPU copy streams' worker threads (see NOTE [Copies on CPU] above)")
    p.add_argument("--deterministic", action="store_true", help="every run on deterministic kernels: grads compare bit for bit on CUDA too")
    p.add_argument("--json", type=Path, default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    for flag in ("layers", "hidden", "heads", "seq", "micro_batch_size", "microbatches", "vocab", "iterations"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be an integer >= 1, got {getattr(args, flag)}")
    if args.warmup < 1:
        p.error(f"--warmup must be an integer >= 1 (megatron's offload warms up in its first iteration), got {args.warmup}")
    for flag in ("min_offload_bytes", "budget_bytes", "reload_ahead_bytes", "profile"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            p.error(f"--{flag.replace('_', '-')} must be an integer >= 0, got {value}")
    if args.hidden % args.heads:
        p.error(f"--hidden must be divisible by --heads ({args.heads}), got {args.hidden}")
    try:
        args.modules = [canonical_modules(m) for m in (args.modules or ["core_attn,qkv_linear"])]
    except ChunkOffloadError as e:
        p.error(f"--modules: {e}")
    return args


@dataclass
class _Runs:
    """Where each run trains: each in a fresh process (``workdir``: where the run without offload's
    grads wait for the others to compare theirs with), or here (None)."""

    args: argparse.Namespace
    shape: GPTShape
    workdir: Path | None
    ran: list[dict[str, Any]] = field(default_factory=list)
    """Every row `compared` made, in the order the runs ended."""
    on_row: Callable[[], None] | None = None
    """Called after each row is added to `ran` (the JSON so far: a time limit that stops a run keeps those before it)."""

    def measured(self, modules: list[str], run: str, budget: int | None, *, is_base: bool = False) -> dict[str, Any]:
        """One run's row (``failed`` where its process raised or ended without an answer)."""
        if self.workdir is None:
            return run_once(self.args, self.shape, modules, run, budget)
        started = time.perf_counter()
        try:
            row = in_own_process(run_alone, self.args, self.shape, modules, run, budget, self.workdir / "grads-none.pt", is_base)
        except RunFailed as failure:
            print(f"{','.join(modules)} / {run} failed: {failure}", file=sys.stderr)
            return {"run": run, "modules": ",".join(modules), "failed": str(failure)}
        return {**row, "process_s": time.perf_counter() - started}

    def compared(self, modules: list[str], run: str, budget: int | None, base: dict[str, Any] | None) -> dict[str, Any]:
        """`measured`, and whether its losses and grads equal ``base``'s (None: it is the base,
        identical to itself). Measured here, the base keeps host copies of its grads and every
        other run's are let go once compared (at hidden 4096 a model's worth per run); in its own
        process a run compared its grads itself (`run_alone`)."""
        row = self._compared(modules, run, budget, base)
        self.ran.append(row)
        if self.on_row is not None:
            self.on_row()
        return row

    def _compared(self, modules: list[str], run: str, budget: int | None, base: dict[str, Any] | None) -> dict[str, Any]:
        row = self.measured(modules, run, budget, is_base=base is None)
        if "failed" in row:
            return row
        if base is None:
            return {**row, "losses_identical": True, "grads_identical": True}
        row["losses_identical"] = len(base["_losses"]) == len(row["_losses"]) and all(map(torch.equal, base["_losses"], row["_losses"]))
        if "_grads" in row:
            grads = row.pop("_grads")
            row["grads_identical"] = base["_grads"].keys() == grads.keys() and all(torch.equal(g, grads[k]) for k, g in base["_grads"].items())
        return row

    def profiled(self, modules: list[str], run: str, budget: int | None) -> dict[str, Any]:
        """``--profile`` steps of a run measured here: built again, once every run is timed."""
        return run_once(self.args, self.shape, modules, run, budget, measure=False, profile_steps=self.args.profile)


def _module_set(runs: _Runs, modules: list[str], none: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The four (five) runs of one module set (megatron's replaced by one skip row where it cannot run).

    ``none``: an earlier set's run without offload, shown again in this set (``same_run_as``: its
    set): a run that offloads nothing does not depend on the modules, so it runs once. Where the
    run without offload fails the set stops there: nothing could be compared with it.
    """
    args = runs.args
    base = runs.compared(modules, "none", None, None) if none is None else {**none, "modules": ",".join(modules), "same_run_as": none["modules"]}
    if "failed" in base:
        return [base]
    rows = [base]
    skip = builtin.builtin_unavailable(modules)
    megatron = None if skip else runs.compared(modules, "megatron", None, base)
    rows.append(runs.compared(modules, "chunk-offload", None, base))
    budget = args.budget_bytes
    if budget is None:
        budget = megatron["peak_bytes"] if megatron and megatron.get("peak_bytes") is not None and base["peak_bytes"] \
            else (rows[1].get("saved_peak_bytes") or 0) // 2  # fmt: skip
    rows.append(runs.compared(modules, "chunk-offload budget", budget, base))
    for run, wanted in (("reload-ahead", args.reload_ahead_bytes is not None), ("module", args.module_groups)):
        if wanted:
            rows.append(runs.compared(modules, f"chunk-offload {run}", None, base))
    rows.append(megatron if megatron is not None else {"run": "megatron", "modules": ",".join(modules), "skipped": skip})
    if args.none_again:
        rows.append(runs.compared(modules, "none again", None, base))
    ran = [r for r in rows if "skipped" not in r and "failed" not in r]
    nones = [r for r in ran if r["run"] in ("none", "none again")]
    # Over both runs without offload where there are two: a host whose speed drifts during the set
    # moves both, and their own overheads (one below 0, one above) show by how much.
    median, fastest = statistics.mean(r["median_step_s"] for r in nones), min(r["min_step_s"] for r in nones)
    for row in ran:
        row.update(overhead=row["median_step_s"] / median - 1, overhead_min=row["min_step_s"] / fastest - 1)
    if megatron is not None and "failed" not in megatron:
        for row in ran:
            if row["run"].startswith("chunk-offload"):
                row["vs_megatron"] = _against(row, megatron)
    return rows


def _against(row: dict[str, Any], megatron: dict[str, Any]) -> dict[str, float | bool | None]:
    """Issue 26's reading of a chunk-offload run against megatron's built-in in the same set: each
    overhead over megatron's (None where megatron's is not above 0) and whether its peak is at or
    below megatron's (None without a device peak)."""
    def ratio(key: str) -> float | None:
        return row[key] / megatron[key] if megatron[key] > 0 else None

    peaks = row["peak_bytes"], megatron["peak_bytes"]
    at_or_below = None if None in peaks else peaks[0] <= peaks[1]
    return {"overhead": ratio("overhead"), "overhead_min": ratio("overhead_min"), "peak_at_or_below": at_or_below}


def _add_profiles(runs: _Runs, rows: list[dict[str, Any]]) -> None:
    """``--profile``: each run's profiled steps (`_Runs.profiled` where its process did not take
    them) and what they add over its set's 'none'.

    Measured here, each run is profiled after every timed run, not inside them: a profiler may
    leave the process slower after it (torch.profiler's CUDA activity tracing), which would tilt
    the times of the runs after it. For the same reason each set's 'none' is profiled first and
    megatron's second: whatever a profiler leaves behind then counts against chunk-offload's runs,
    never for them.
    """
    sets, first = list(dict.fromkeys(r["modules"] for r in rows)), {"none": 0, "megatron": 1}
    base, nones = None, {}
    for row in sorted(rows, key=lambda r: (sets.index(r["modules"]), first.get(r["run"], 2))):
        if "skipped" in row or "failed" in row or row["run"] == "none again":
            continue
        if "same_run_as" in row:  # the run without offload of another set: profiled once, with it
            row.update({key: nones[row["same_run_as"]][key] for key in ("_profile", "_api")})
        elif "_profile" not in row:
            row.update(runs.profiled(row["modules"].split(","), row["run"], row["budget_bytes"]))
        if row["run"] == "none":
            base = nones[row["modules"]] = row
            continue
        (times, engine), (base_times, _) = row["_profile"], base["_profile"]
        row.update(_host_added=over(times, base_times), engine_host_ms=engine * 1e3, _api_added=over(row["_api"], base["_api"]))


def main(argv: list[str] | None = None) -> int:
    """Run every module set; print the table (and write the JSON). Returns the exit status (1 where a run failed)."""
    args = parse_args(argv)
    import megatron.core

    shape = GPTShape(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, vocab_size=args.vocab,
                     seq_length=args.seq, micro_batch_size=args.micro_batch_size, dtype=DTYPES[args.dtype],
                     attention=args.attention)  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="megatron_compare-") if args.processes == "per-run" else contextlib.nullcontext() as workdir:
        runs = _Runs(args, shape, None if workdir is None else Path(workdir))
        for modules in args.modules:
            # What a time limit that stops the comparison leaves: the finished sets, then each run of this one.
            runs.ran, done = [], list(rows)
            runs.on_row = lambda done=done: write_json(args, done + runs.ran, device, complete=False)
            rows += _module_set(runs, modules, rows[0] if rows else None)
            write_json(args, rows, device, complete=False)
            if "failed" in rows[0]:
                break
        if args.profile and "failed" not in rows[0]:
            _add_profiles(runs, rows)
        print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, micro batch "
              f"{args.micro_batch_size}, {args.microbatches} microbatches, {args.dtype}, {args.attention}; PP=1 "
              f"(megatron no-pipelining schedule); device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; "
              f"megatron-core {megatron.core.__version__}; {'each run in a process of its own' if workdir else 'every run in one process'}")  # fmt: skip
        print(format_table(rows, device, deterministic=args.deterministic, cpu_copies=args.cpu_copies))
        if args.profile:
            print("\n".join(format_profiles(rows, args.layers * args.microbatches)))
        write_json(args, rows, device, complete=True)
    return 1 if any("failed" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
