#!/usr/bin/env bash
# The Megatron-dependent tests again, against the newest megatron-core (0.19.2), in a second
# virtual environment (the README's test command runs this after the main pytest).
#
# megatron-core 0.19.2 declares Python >= 3.12 and ships megatron.training. On Python 3.11 it is
# installed with --no-deps --ignore-requires-python, plus what megatron.core / megatron.training
# import (numpy, packaging, triton) and typing.override from typing_extensions (a .pth line in
# the venv; nothing in megatron-core is edited). The venv is made once and reused:
# ${CHUNK_OFFLOAD_MC019_VENV:-~/.cache/chunk-offload/venv-mc019}.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CHUNK_OFFLOAD_MC019_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/chunk-offload/venv-mc019}"
python="${PYTHON:-python}"

if ! "$venv/bin/python" -c "import megatron.training.training" >/dev/null 2>&1; then
    echo "+ creating $venv (megatron-core 0.19.2)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q --no-deps --ignore-requires-python megatron-core==0.19.2
    "$venv/bin/pip" install -q numpy "packaging>=24.2" triton typing_extensions "pytest>=8" pytest-timeout matplotlib
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo 'import typing, typing_extensions; typing.override = getattr(typing, "override", typing_extensions.override)' \
        > "$site/chunk_offload_typing_override.pth"
    "$venv/bin/python" -c "import megatron.training.training"
fi

cd "$repo"
# The Megatron-dependent subset; the 20-step run and the DDP/optimizer matrix are left to the main
# run (0.16.1): Megatron-LM's pretrain in tests/megatron_lm trains through its DDP and optimizer.
echo "+ megatron-core $("$venv/bin/python" -c 'import megatron.core; print(megatron.core.__version__)' 2>/dev/null): tests/megatron_lm tests/devkit tests/integrations/megatron tests/replay/test_compare.py"
CHUNK_OFFLOAD_REQUIRE_MEGATRON_TRAINING=1 PYTHONPATH="$repo" \
    "$venv/bin/python" -m pytest -q tests/megatron_lm tests/devkit tests/integrations/megatron tests/replay/test_compare.py \
    --ignore=tests/integrations/megatron/test_long_run.py --ignore=tests/integrations/megatron/test_megatron_ddp.py
