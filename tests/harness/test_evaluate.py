"""Gate 2 verdicts and the record evaluate() returns."""

import pytest

from conftest import FIXTURES, scripted_timing
from kforge.harness.evaluate import evaluate
from kforge.harness.roofline import Ceilings

VECTORIZED_ROW_SUMS = """
    import torch
    class ModelNew(torch.nn.Module):
        def forward(self, x):
            return x.sum(dim=1)
"""

@pytest.fixture
def run(write, problem_path, cpu, cpu_ceilings, fast_timing):
    def _run(problem: str, candidate_source: str, **kwargs):
        kwargs.setdefault("ceilings", cpu_ceilings)
        kwargs.setdefault("timing", fast_timing)
        return evaluate(problem_path(problem), write("candidate.py", candidate_source), device=cpu, **kwargs)

    return _run


def test_a_correct_faster_candidate_passes_both_gates(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS, size="full", timing=scripted_timing(speedup=2.0))
    assert record.status == "passed" and record.exit_status == 0, record.reason
    ref, cand = record.gate2["stats"]["reference"], record.gate2["stats"]["candidate"]
    assert record.speedup == pytest.approx(2.0, rel=0.01)
    assert ref["median_ms"] / cand["median_ms"] == pytest.approx(2.0, rel=0.01)
    verdict = record.gate2["verdict"]
    assert verdict["status"] == "faster" and 1.9 < verdict["low"] <= record.speedup <= verdict["high"] < 2.1
    assert verdict["aa_ratio"] == pytest.approx(1.0, abs=0.01) and verdict["noise_floor"] >= 0.01
    ratios = record.gate2["ratios"]
    assert len(ratios["candidate"]) == record.gate2["rounds"] == len(ratios["reference_aa"])
    assert record.gate2["stop_reason"] == "decided"
    assert record.gate2["clock"] == "host" and record.gate2["passed"]
    for side in ("reference", "candidate"):
        point = record.roofline[side]
        assert point["time_ms"] == record.gate2["stats"][side]["median_ms"]
        assert point["tflops"] == pytest.approx(256 * 512 / (point["time_ms"] * 1e-3) / 1e12)
    assert record.roofline["flops"] == 256 * 512
    assert any("CPU figures" in w for w in record.warnings)


def test_a_correct_but_slower_candidate_fails_gate_2(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS, timing=scripted_timing(speedup=0.5))
    assert record.status == "slower" and record.exit_status == 1
    assert record.gate1["passed"] and not record.gate2["passed"]
    assert record.speedup == pytest.approx(0.5, rel=0.01) and "slower: 0.5" in record.reason


def test_a_candidate_within_the_noise_floor_is_a_tie(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS, timing=scripted_timing(speedup=1.005))
    assert record.status == "tie" and record.exit_status == 1
    assert "not measurably different" in record.reason and "95% interval" in record.reason


def test_min_speedup_raises_the_bar(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS, timing=scripted_timing(speedup=1.3), min_speedup=1.5)
    assert record.status == "tie" and record.gate2["verdict"]["bar"] == 1.5, record.reason


def test_an_undecided_tie_says_the_budget_was_too_short(run):
    import random

    from kforge.harness.timing import TimingConfig

    def noisy(name, i):  # a 2% win buried in 40% noise, with half a second to find it
        return (1.0 if name != "candidate" else 0.98) * random.Random(f"{name}/{i}").lognormvariate(0.0, 0.4)

    record = run("row_sums", VECTORIZED_ROW_SUMS,
                 timing=TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=5, budget_s=0.5, script=noisy))
    assert record.status == "tie" and record.gate2["stop_reason"] == "budget"
    assert record.gate2["verdict"]["undecided"] and any("--time-budget" in w for w in record.warnings)


def test_metadata_that_overstates_the_work_disables_the_floor_check_with_a_warning(problem_path, cpu, fast_timing):
    absurd = Ceilings(device=cpu.name, kind="cpu", copy_gbps=1.0, matmul_tflops={"fp32": 1e-9}, measured_on="x")
    record = evaluate(problem_path("row_sums"), FIXTURES / "candidates" / "vectorized_row_sums.py", device=cpu,
                      ceilings=absurd, timing=scripted_timing(speedup=2.0), size="full")
    assert record.status == "passed" and "physical_floor" not in record.defences
    assert any("reference itself runs under the physical floor" in w for w in record.warnings)


def test_a_reference_beating_the_measured_roof_warns_that_the_ceilings_look_low(problem_path, cpu, fast_timing):
    # Measured ceilings far too low (copy at 1 KB/s), physics left alone (a high matmul rate):
    # the record must say its % of roof is suspect, not fail the candidate.
    low = Ceilings(device=cpu.name, kind="cpu", copy_gbps=1e-6, matmul_tflops={"fp32": 1e3}, measured_on="2026-11-21")
    record = evaluate(problem_path("row_sums"), FIXTURES / "candidates" / "vectorized_row_sums.py", device=cpu,
                      ceilings=low, timing=fast_timing, size="full")
    assert record.status in ("passed", "tie", "slower") and "physical_floor" not in record.defences
    assert any("beat the measured roof" in w and "2026-11-21" in w for w in record.warnings)
    sane = Ceilings(device=cpu.name, kind="cpu", copy_gbps=1e6, matmul_tflops={"fp32": 1e3}, measured_on="x")
    record = evaluate(problem_path("row_sums"), FIXTURES / "candidates" / "vectorized_row_sums.py", device=cpu,
                      ceilings=sane, timing=fast_timing, size="full")
    assert not any("beat the measured roof" in w for w in record.warnings)


def test_a_cpu_run_defaults_to_the_tiny_size(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS)
    assert record.problem["size"] == "tiny" and record.roofline["flops"] == 8 * 16


def test_the_same_seed_reproduces_a_run(run):
    one = run("row_sums", VECTORIZED_ROW_SUMS, seed=1234)
    two = run("row_sums", VECTORIZED_ROW_SUMS, seed=1234)
    three = run("row_sums", VECTORIZED_ROW_SUMS)
    assert one.seed == two.seed == 1234 and one.gate1["seeds"] == two.gate1["seeds"]
    assert one.gate1["max_abs_err"] == two.gate1["max_abs_err"]
    assert three.gate1["seeds"] != one.gate1["seeds"], "without --seed every run draws a secret new one"


def test_the_record_identifies_everything_it_measured(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS, size="full").to_dict()
    assert len(record["problem"]["sha256"]) == 64 and len(record["candidate"]["sha256"]) == 64
    assert record["problem"]["tags"] == ["reduction", "test"] and record["problem"]["size"] == "full"
    assert record["device"]["kind"] == "cpu"
    assert {"torch", "triton", "python", "kforge", "numpy"} <= set(record["versions"])
    assert record["roofline"]["ceilings"]["copy_gbps"] == 10.0
    assert record["baseline"] == "eager" and record["schema"] == 1


def test_record_paths_are_relative_to_the_working_directory_inside_it(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where `write` puts the candidate
    record = run("row_sums", VECTORIZED_ROW_SUMS)
    assert record.candidate["path"] == "candidate.py"
    assert record.problem["path"].endswith("fixtures/problems/row_sums.py") and record.problem["path"].startswith("/")


def test_at_least_five_trials(problem_path, cpu):
    from kforge.errors import KforgeError

    with pytest.raises(KforgeError, match="at least 5 trials"):
        evaluate(problem_path("add"), problem_path("add"), trials=4, device=cpu)


@pytest.mark.slow
def test_the_compile_baseline_times_torch_compile_of_the_reference(run):
    record = run("row_sums", VECTORIZED_ROW_SUMS, baseline="compile", size="tiny")
    assert record.baseline == "compile" and record.gate2 is not None, record.reason


def test_a_kernelbench_problem_without_metadata_evaluates_end_to_end(run):
    # add.py has only Model, get_inputs and get_init_inputs, as KernelBench writes them
    record = run("add", """
        import torch
        class ModelNew(torch.nn.Module):
            def forward(self, a, b):
                return torch.add(a, b)
    """)
    assert record.gate1["passed"] and record.gate2 is not None
    assert record.problem["size"] == "full" and record.problem["tags"] == []
    assert record.roofline["flops"] is None and record.roofline["bound"] == "memory"
    assert record.roofline["bytes"] == 3 * 4096 * 4  # two inputs read, one output written


# --- a "faster" verdict on host-bound calls whose device work is slower -------------------------

def _host_bound_run(reference_device_ms: float, candidate_device_ms: float, *, host_bound_frac: float = 1.0,
                    candidate_host_bound_frac: float | None = None, clock: str = "cuda_events"):
    """A timing run whose calls the host bounds (per call: 0.100 ms reference, 0.090 candidate,
    as an eager caller waits), with each side's device time as given."""
    from types import SimpleNamespace

    from kforge.harness.timing import CallProfile, TimingRun, TimingStats
    from kforge.harness.verdict import judge_speed

    calls = {"reference": [0.100, 0.101, 0.099] * 10, "candidate": [0.090, 0.091, 0.089] * 10}
    run = TimingRun(stats={name: TimingStats.from_samples(times) for name, times in calls.items()}, clock=clock,
                    rounds=30, stop_reason="decided", pool_sets=2, pool_bytes=0, flush_bytes=0, cover_ms=None,
                    rechecked_rounds=0, sync_overhead_ms=None,
                    profile={"reference": CallProfile(reference_device_ms, 0.100, host_bound_frac, 0.0),
                             "candidate": CallProfile(candidate_device_ms, 0.090, host_bound_frac
                                                      if candidate_host_bound_frac is None
                                                      else candidate_host_bound_frac, 0.0)})
    roof = SimpleNamespace(physical_floor_ms=None, floor_ms=None)
    return run, roof, judge_speed(calls["reference"], calls["candidate"])


def test_a_host_bound_win_with_slower_kernels_passes_with_a_warning():
    from kforge.harness.evaluate import gate2_verdict

    # the reference's calls host-bound, the candidate's not: either side suffices
    run, roof, verdict = _host_bound_run(0.020, 0.045, candidate_host_bound_frac=0.2)
    assert verdict.status == "faster"
    warnings, defences = [], []
    status, reason = gate2_verdict(run, roof, None, "eager", warnings, defences, verdict)
    assert status == "passed" and reason is None and len(warnings) == 1
    assert "device time is 2.25x the reference's" in warnings[0] and "CUDA graph" in warnings[0]


@pytest.mark.parametrize("reference_ms, candidate_ms, host_bound_frac, clock", [
    (0.020, 0.015, 1.0, "cuda_events"),  # the kernels are faster too
    (0.020, 0.0201, 1.0, "cuda_events"),  # slower by less than the noise floor
    (0.020, 0.045, 0.2, "cuda_events"),  # not host-bound: the per-call time is the device's
    (0.020, 0.045, 1.0, "host"),  # a CPU device: no device time to compare
])
def test_no_warning_where_the_devices_agree_or_cannot_be_compared(reference_ms, candidate_ms, host_bound_frac,
                                                                  clock):
    from kforge.harness.evaluate import device_disagrees

    run, _, verdict = _host_bound_run(reference_ms, candidate_ms, host_bound_frac=host_bound_frac, clock=clock)
    assert verdict.status == "faster" and device_disagrees(run, verdict) is None
