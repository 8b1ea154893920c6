"""`kforge machine` as a user runs it: manual mode end to end, resuming, and one-line errors."""

import os
import socket
import subprocess
import sys

import pytest
from conftest import FIXTURES
from replay_server import reply_text

from kforge.harness.record import read_store

PROBLEM = FIXTURES / "problems" / "add.py"


@pytest.fixture
def cli(tmp_path, cpu, cpu_ceilings):
    """Runs kforge in tmp_path, with the CPU's ceilings already cached (no measuring)."""
    from kforge.harness.roofline import save_ceilings

    save_ceilings(cpu, cpu_ceilings)  # into the test's KFORGE_CACHE_DIR (tests/conftest.py)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "kforge", *map(str, args)], cwd=tmp_path, env=dict(os.environ),
                              capture_output=True, text=True, timeout=600)

    return run


@pytest.mark.slow
def test_manual_mode_writes_the_prompt_waits_judges_the_reply_and_resumes(cli, tmp_path):
    args = ("machine", PROBLEM, "--manual", "replies", "--turns", "1", "--time-budget", "0.3")
    waiting = cli(*args)
    assert waiting.returncode == 0, waiting.stderr
    (line,) = [x for x in waiting.stdout.splitlines() if x.startswith("waiting:")]
    prompts = list((tmp_path / "replies").glob("*-s0-t0.prompt.md"))
    assert len(prompts) == 1 and "## The reference: add.py" in prompts[0].read_text()
    reply = prompts[0].with_name(prompts[0].name.replace(".prompt.md", ".reply.md"))
    assert f"write the reply to replies/{reply.name}" in line
    store = tmp_path / "machine-add.jsonl"
    assert not store.exists(), "nothing is stored until a reply is there"

    reply.write_text(reply_text("correct"))
    judged = cli(*args)
    (attempt,) = read_store(store).records
    assert attempt["status"] in ("passed", "slower", "tie") and attempt["record"]["gate1"]["passed"]
    assert judged.returncode == (0 if attempt["status"] == "passed" else 1), judged.stdout + judged.stderr
    assert attempt["endpoint"] == "manual" and attempt["model"] == "manual"
    assert attempt["record"]["command"].startswith("kforge machine")
    assert "1 sample(s): 1 correct" in judged.stdout and "pass@1 1.00" in judged.stdout
    assert "1 new attempt(s)" in judged.stdout and attempt["status"] in judged.stdout
    assert (tmp_path / "machine-add" / attempt["run"] / "s0" / "t0" / "candidate.py").is_file()

    again = cli(*args)
    assert again.returncode == judged.returncode and "0 new attempt(s)" in again.stdout
    assert len(read_store(store).records) == 1


@pytest.mark.slow
def test_an_unreachable_endpoint_is_one_line_and_exit_2_and_the_store_keeps_the_attempt(cli, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = cli("machine", PROBLEM, "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m")
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"cannot reach http://127.0.0.1:{port}/v1" in errors[0]
    (attempt,) = read_store(tmp_path / "machine-add.jsonl").records
    assert attempt["status"] == "request_failed" and attempt["endpoint"] == f"http://127.0.0.1:{port}/v1"


@pytest.mark.slow
def test_a_problem_that_does_not_load_is_one_line_and_exit_2_with_nothing_stored(cli, write, tmp_path):
    broken = write("broken.py", "import torch\nraise RuntimeError('no such dataset')\n")
    result = cli("machine", broken, "--manual", "replies")
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == ("error: problem failed to import: RuntimeError: no such dataset "
                                             "(broken.py:2)")
    assert not (tmp_path / "machine-broken.jsonl").exists() and not (tmp_path / "replies").exists()


@pytest.mark.parametrize("args, message", [
    (("--manual", "replies", "--base-url", "http://127.0.0.1:1/v1"), "--manual and --base-url contradict"),
    (("--base-url", "http://127.0.0.1:1/v1"), "give --model"),
    (("--manual", "replies", "--address", "auto"), "--address and --ray-resources are for --executor ray"),
    (("--manual", "replies", "--executor", "ray", "--gpus", "0"), "--gpus picks this machine's GPUs"),
    (("--manual", "replies", "--executor", "ray", "--profile"), "--profile runs Nsight Compute on this machine's"),
])
def test_contradictory_or_missing_options_are_one_line_errors(cli, args, message):
    result = cli("machine", PROBLEM, *args)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {message}")


@pytest.mark.gpu
def test_a_cuda_backend_reply_compiles_in_the_confined_worker_and_passes_gate_1(tmp_path, gpu_ceilings):
    # the prompt's CUDA API (kforge's runtime: NVRTC, a source written to the worker's own scratch
    # folder) followed by a reply, then judged on the GPU as any candidate
    from kforge.device import current_device
    from kforge.harness.roofline import save_ceilings

    save_ceilings(current_device("cuda"), gpu_ceilings)  # into the test's KFORGE_CACHE_DIR

    def run():
        return subprocess.run([sys.executable, "-m", "kforge", "machine", str(PROBLEM), "--backend", "cuda",
                               "--manual", "replies", "--turns", "1", "--time-budget", "0.5"], cwd=tmp_path,
                              env=dict(os.environ), capture_output=True, text=True, timeout=600)

    waiting = run()
    assert waiting.returncode == 0, waiting.stderr
    (prompt,) = (tmp_path / "replies").glob("*-s0-t0.prompt.md")
    assert "compile_cuda" in prompt.read_text() and "sm_90a" in prompt.read_text()
    prompt.with_name(prompt.name.replace(".prompt.md", ".reply.md")).write_text(reply_text("cuda_add"))
    judged = run()
    (attempt,) = read_store(tmp_path / "machine-add.jsonl").records
    assert attempt["backend"] == "cuda" and attempt["record"]["gate1"]["passed"], attempt["reason"]
    assert attempt["status"] in ("passed", "tie", "slower") and attempt["static_flags"] == []
    assert judged.returncode == (0 if attempt["status"] == "passed" else 1), judged.stdout + judged.stderr
