"""``python -m chunk_offload.megatron_lm SCRIPT [ARGS...]``: see `chunk_offload.megatron_lm`."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
