"""Helpers shared by the tests/core/test_errors_*.py files."""

from __future__ import annotations

import re


CHUNK0 = re.escape("(microbatch=0, vp_stage=0)")
