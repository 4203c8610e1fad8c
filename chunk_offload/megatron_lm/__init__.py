"""Run an unmodified Megatron-LM training script with chunk-offload.

::

    torchrun --nproc-per-node 2 -m chunk_offload.megatron_lm path/to/pretrain_gpt.py <Megatron-LM args> \
        --chunk-offload-modules core_attn,qkv_linear [--chunk-offload-report out/report]

The script runs as ``__main__`` with its folder on ``sys.path`` (as ``python script.py`` would).
Before it runs, `EntryPoints` wraps the public entry points of ``megatron.training`` that scripts
use (``parse_and_validate_args``, ``initialize_megatron``, ``pretrain``): our flags join whatever
``extra_args_provider`` the script passes, the rank's model chunks are attached wherever
Megatron-LM builds them (through the script's model provider, or from the config container of
core_v0.19), iterations are delimited automatically, and after ``pretrain`` returns every rank's
summary is gathered to rank 0, which writes the per-stage report (with ``--chunk-offload-report``)
and prints a summary per rank; the manager is closed.
Nothing in Megatron-LM is edited. Without CUDA, `chunk_offload.devkit.cpu_compat` and
`chunk_offload.devkit.megatron_training_cpu` make megatron-core and megatron.training run on gloo.

With ``--chunk-offload-verify N`` each rank runs the script twice instead, without and with
offload, as child runs that record their first N iterations, and the records are compared bit
for bit (`verify`, NOTE [Verify runs]).

Before anything runs the command line is checked (`preflight`: usage errors exit with status 2)
and so are Megatron's dataset helpers (compiled, or buildable by Megatron's ``make``:
`chunk_offload.devkit.megatron_dataset_helpers`).
"""

from .entry_points import EntryPoints
from .run import run_script

__all__ = ["EntryPoints", "run_script"]
