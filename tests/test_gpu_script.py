"""scripts/gpu_check.sh, the one GPU call, checked on the CPU: a device call must not be spent on a
syntax error, a renamed test file or an undocumented part."""

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def test_the_script_parses():
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_file_the_script_names_exists():
    named = set(re.findall(r"\b((?:tests|scripts)/[\w./-]+\.(?:py|cu|sh))\b", SCRIPT.read_text()))
    assert named, "the pattern finds the script's test and script paths"
    assert sorted(path for path in named if not (REPO / path).exists()) == []


def test_every_part_the_script_runs_is_in_its_header():
    text = SCRIPT.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    parts = set(re.findall(r'parts == \*" ([\w-]+) "\*', text))
    assert {"decode-fused", "moe-fp8-cuda", "flash-hopper", "machine", "harness"} <= parts
    assert sorted(part for part in parts if not re.search(rf"(?<![\w-]){re.escape(part)}(?![\w-])", header)) == []


def test_every_python_script_parses():
    for script in sorted((REPO / "scripts").glob("*.py")):
        ast.parse(script.read_text(), filename=str(script))


def test_on_a_machine_without_a_gpu_it_stops_at_once_with_one_line(tmp_path):
    import shutil

    import pytest

    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has nvidia-smi")
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PARTS": "examples"})
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "gpu_check.sh: no NVIDIA GPU on this machine (nvidia-smi finds none): it runs on the device machine"]
    assert not (tmp_path / "out").exists(), "nothing measured, nothing written"
