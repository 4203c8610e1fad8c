"""``python -m chunk_offload.megatron_lm``: usage errors, and a script run as ``__main__``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _launch(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "chunk_offload.megatron_lm", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_missing_script_is_a_usage_error(tmp_path: Path) -> None:
    proc = _launch(cwd=tmp_path)
    assert proc.returncode == 2
    assert "the following arguments are required: script" in proc.stderr


def test_script_that_is_not_a_file_is_a_usage_error(tmp_path: Path) -> None:
    proc = _launch("no_such_pretrain_gpt.py", "--num-layers", "2", cwd=tmp_path)
    assert proc.returncode == 2
    assert "script 'no_such_pretrain_gpt.py' is not a file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_script_runs_as_main_with_its_folder_on_path_and_its_arguments(tmp_path: Path) -> None:
    folder = tmp_path / "megatron_lm_checkout"
    folder.mkdir()
    (folder / "helper_next_to_script.py").write_text("VALUE = 'imported from the script folder'\n")
    (folder / "train.py").write_text(
        "import sys\n"
        "from helper_next_to_script import VALUE\n"
        "if __name__ == '__main__':\n"
        "    print(VALUE, sys.argv[1:], sys.argv[0].endswith('train.py'))\n"
    )
    proc = _launch(str(folder / "train.py"), "--num-layers", "2", "--chunk-offload-modules", "core_attn", cwd=tmp_path)
    if importlib.util.find_spec("megatron.training") is None:  # megatron-core 0.16.1: no megatron.training
        assert proc.returncode == 1, proc.stderr
        assert "the launcher needs Megatron-LM's megatron.training" in proc.stderr
        assert "Traceback" not in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert "imported from the script folder ['--num-layers', '2', '--chunk-offload-modules', 'core_attn'] True" in proc.stdout
