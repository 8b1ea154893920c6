"""The profile feedback (kforge.harness.profile): ncu's raw page parsed (units, grouped thousands,
tensor pipes, stall reasons), the summary's arithmetic, the feedback lines, the commands, and the
whole plumbing on the CPU with a stand-in `ncu` that runs the real profile worker and returns a
canned report; the worker alone on a good and a failing candidate. No GPU here: what a real
ncu reports on an H100 is for the GPU run."""

from __future__ import annotations

import stat
import sys
import textwrap

import pytest
import torch
from conftest import FIXTURES

from kforge.harness import profile as profile_module
from kforge.harness.profile import (KernelProfile, ProfileSummary, ncu_commands, parse_raw_csv, profile_candidate,
                                    profile_lines)
from kforge.harness.profile_worker import main as worker_main

HEADER = ['"ID"', '"Process ID"', '"Kernel Name"', '"gpu__time_duration.sum"', '"dram__bytes_read.sum"',
          '"dram__bytes_write.sum"', '"dram__throughput.avg.pct_of_peak_sustained_elapsed"',
          '"sm__throughput.avg.pct_of_peak_sustained_elapsed"',
          '"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"',
          '"sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active"',
          '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"',
          '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"',
          '"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio"',
          '"smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio"']
UNITS = ['""', '""', '""', '"nsecond"', '"byte"', '"byte"', '"%"', '"%"', '"%"', '"%"', '"ratio"', '"ratio"',
         '"ratio"', '"ratio"']
RAW = "\n".join([
    "==PROF== Connected to process 4242",  # ncu's own lines come first
    ",".join(HEADER), ",".join(UNITS),
    '"0","4242","gemm_kernel","1,500,000","600,000,000","200,000,000","30.5","88.1","0","91.2","0.5","0.1","1.0","2.5"',
    '"1","4242","softmax_kernel","500,000","1,000,000,000","1,000,000,000","92","20","0","0","4.0","0","1.0","0"',
])


def test_the_raw_page_becomes_kernels_in_milliseconds_and_bytes():
    gemm, softmax = parse_raw_csv(RAW)
    assert gemm.name == "gemm_kernel" and gemm.duration_ms == pytest.approx(1.5)
    assert gemm.dram_bytes == 8e8 and gemm.dram_pct == 30.5 and gemm.sm_pct == 88.1
    assert gemm.tensor_pct == 91.2, "the busiest tensor pipe"
    assert gemm.stalls == {"long scoreboard": 0.5, "barrier": 0.1, "math pipe throttle": 2.5}, "'selected' is no stall"
    assert softmax.stalls == {"long scoreboard": 4.0}, "reasons at 0 are left out"


def test_the_summary_totals_the_call_and_weights_stalls_by_time():
    summary = ProfileSummary(parse_raw_csv(RAW))
    assert summary.total_ms == pytest.approx(2.0)
    assert summary.dram_gbps == pytest.approx((8e8 + 2e9) / 2e-3 / 1e9)  # 1400 GB/s
    (first, weight), *_ = summary.top_stalls()
    assert first == "math pipe throttle" and weight == pytest.approx(2.5 * 0.75)
    assert dict(summary.top_stalls())["long scoreboard"] == pytest.approx(0.5 * 0.75 + 4.0 * 0.25)
    assert summary.to_dict()["kernels"][0]["name"] == "gemm_kernel"


def test_feedback_lines_name_the_longest_kernels_first():
    summary = ProfileSummary(parse_raw_csv(RAW) + [KernelProfile(f"k{i}", 0.01, None, None, None, None)
                                                   for i in range(3)])
    lines = profile_lines(summary, copy_gbps=2800.0, top=2)
    assert lines[0].startswith("Profile (Nsight Compute") and "5 kernel(s)" in lines[0]
    assert "DRAM 1.4e+03 GB/s (50% of the measured copy bandwidth)" in lines[0]
    assert lines[1].startswith("- gemm_kernel: 1.5 ms (74%)") and "tensor pipe 91%" in lines[1]
    assert "math pipe throttle (2.5)" in lines[1] and lines[2].startswith("- softmax_kernel")
    assert lines[3] == "- and 3 more kernel(s)."
    assert profile_lines(summary.to_dict(), top=2)[1] == lines[1], "a stored profile reads the same"
    assert profile_lines("no CUDA device: a profile needs a GPU") == [
        "Profile: none (no CUDA device: a profile needs a GPU)."]


@pytest.mark.parametrize("text", ["", "==PROF== nothing profiled\n", ",".join(HEADER) + "\n" + ",".join(UNITS)])
def test_a_report_without_kernels_is_a_reason_not_a_crash(text):
    with pytest.raises(ValueError, match="kernel table"):
        parse_raw_csv(text)


def test_the_commands_profile_only_the_range_with_the_clocks_left_alone(tmp_path):
    profile, export = ncu_commands("ncu", tmp_path / "r", FIXTURES / "problems" / "add.py", tmp_path / "c.py",
                                   size="tiny", seed=3)
    assert profile[:3] == ["ncu", "--clock-control", "none"]
    assert profile[profile.index("--nvtx-include") + 1] == "kforge_profile/"
    assert [profile[i + 1] for i, a in enumerate(profile) if a == "--section"] == list(profile_module.SECTIONS)
    asked = profile[profile.index("--metrics") + 1].split(",")
    assert set(profile_module.DRAM_BYTES) | {profile_module.SM_PCT} <= set(asked)
    worker = profile.index("kforge.harness.profile_worker")
    assert profile[worker - 2:worker] == [sys.executable, "-m"] and profile[-4:] == ["--size", "tiny", "--seed", "3"]
    assert export == ["ncu", "--import", f"{tmp_path / 'r'}.ncu-rep", "--page", "raw", "--csv", "--print-units",
                      "base"]


FAKE_NCU = '''
    #!{python}
    """A stand-in for ncu: runs the profiled command (the real worker, on the CPU), writes the
    report it names, and prints a canned raw page when asked to import one."""
    import subprocess, sys
    args = sys.argv[1:]
    if "--import" in args:
        print(open({raw!r}).read())
        sys.exit(0)
    report = args[args.index("--export") + 1]
    command = args[args.index("--force-overwrite") + 1:]
    done = subprocess.run(command)
    if done.returncode == 0:
        open(report + ".ncu-rep", "w").write("report")
    sys.exit(done.returncode)
'''


@pytest.fixture
def fake_ncu(tmp_path, monkeypatch):
    raw = tmp_path / "raw.csv"
    raw.write_text(RAW)
    ncu = tmp_path / "ncu"
    ncu.write_text(textwrap.dedent(FAKE_NCU).lstrip().format(python=sys.executable, raw=str(raw)))
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # here; the worker itself runs on the CPU
    return str(ncu)


@pytest.mark.slow
def test_the_plumbing_runs_the_worker_under_ncu_and_reads_the_report(fake_ncu, write):
    good = write("good.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return a + b
    """)
    found = profile_candidate(FIXTURES / "problems" / "add.py", good, ncu=fake_ncu, size="full")
    assert isinstance(found, ProfileSummary) and [k.name for k in found.kernels] == ["gemm_kernel", "softmax_kernel"]
    broken = write("broken.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                raise RuntimeError("no kernel today")
    """)
    failed = profile_candidate(FIXTURES / "problems" / "add.py", broken, ncu=fake_ncu, size="full")
    assert isinstance(failed, str) and failed.startswith("the profiling run failed (exit 1): kforge profile:")
    assert "no kernel today" in failed


def test_without_ncu_or_a_gpu_there_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(profile_module.shutil, "which", lambda name: None)
    assert profile_candidate(tmp_path / "p.py", tmp_path / "c.py") == "Nsight Compute (ncu) is not on this " \
                                                                      "machine's PATH"
    # an "ncu" that writes nothing: without a GPU the device is named as the reason; with one,
    # the empty run is (as on the H200 machines, where this test also runs)
    reason = profile_candidate(tmp_path / "p.py", tmp_path / "c.py", ncu="/bin/true")
    if torch.cuda.is_available():
        assert reason == "the profiling run failed (exit 0): no output"
    else:
        assert reason == "no CUDA device: a profile needs a GPU"


@pytest.mark.slow
def test_the_worker_runs_a_good_candidate_and_names_a_failing_one(write, capsys):
    good = write("good.py", "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n"
                            "        return a + b\n")
    assert worker_main([str(FIXTURES / "problems" / "add.py"), str(good), "--size", "full"]) == 0
    bad = write("bad.py", "import torch\nclass ModelNew(torch.nn.Module):\n    def __init__(self, x):\n"
                           "        super().__init__()\n")
    assert worker_main([str(FIXTURES / "problems" / "add.py"), str(bad), "--size", "full"]) == 1
    assert capsys.readouterr().err.startswith("kforge profile: constructor mismatch")


@pytest.mark.gpu
def test_nsight_compute_profiles_one_real_call(write):
    import shutil

    if shutil.which("ncu") is None:
        pytest.skip("Nsight Compute (ncu) is not on the PATH")
    candidate = write("scaled.py", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return torch.mm(a.float().view(64, 64), b.float().view(64, 64)).view(-1) + a
    """)
    found = profile_candidate(FIXTURES / "problems" / "add.py", candidate, gpu=0)
    assert isinstance(found, ProfileSummary), found
    assert found.total_ms > 0 and all(k.duration_ms for k in found.kernels)
    assert any(k.dram_bytes for k in found.kernels) and any(k.sm_pct is not None for k in found.kernels), found
    print("\n".join(profile_lines(found)))
