"""The executors' parts that need no cluster: resources, placement, the refusal to score
several devices in one fast_p, and the command's executor options."""

import sys

import pytest
from typer.testing import CliRunner

from kforge.cli import app
from kforge.errors import KforgeError
from kforge.harness.executors import Placement, harness_fingerprint, parse_resources, suite_device
from kforge.harness.suite import Pair, check_devices, summarize


def test_resources_parse_into_what_a_pairs_task_holds():
    assert parse_resources("GPU=1") == {"GPU": 1.0}
    assert parse_resources("GPU=1, CPU=4,h100") == {"GPU": 1.0, "CPU": 4.0, "h100": 1.0}
    for bad in ("GPU=0", "GPU=many", "=1", ""):
        with pytest.raises(KforgeError, match="--ray-resources"):
            parse_resources(bad)


def test_a_placement_names_the_gpu_the_node_and_a_retry():
    assert str(Placement()) == "the CPU"
    assert str(Placement(gpu=1, node="10.0.0.7")) == "GPU 1 of 10.0.0.7"
    assert str(Placement(gpu=0, node="10.0.0.7", attempt=2)) == "GPU 0 of 10.0.0.7 (attempt 2)"


def test_a_cluster_of_one_device_keys_the_suite_by_it_and_a_mixed_one_is_refused_unless_asked():
    assert suite_device({"10.0.0.1": "NVIDIA H100", "10.0.0.2": "NVIDIA H100"}, False) == "NVIDIA H100"
    mixed = {"10.0.0.1": "NVIDIA H100", "10.0.0.2": "NVIDIA A100"}
    with pytest.raises(KforgeError, match="mixes devices.*NVIDIA A100: 10.0.0.2.*--mix-devices"):
        suite_device(mixed, False)
    assert suite_device(mixed, True) == "NVIDIA A100 + NVIDIA H100"
    with pytest.raises(KforgeError, match="no node"):
        suite_device({}, False)


def _record(device: dict) -> dict:
    return {"status": "passed", "defences": [], "reason": None, "roofline": None, "device": device,
            "gate2": {"speedup": 2.0, "verdict": {"low": 1.8},
                      "stats": {"reference": {"median_ms": 2.0}, "candidate": {"median_ms": 1.0}}}}


def test_records_from_two_devices_are_not_scored_together_unless_asked(tmp_path):
    pairs = [Pair(name, tmp_path / f"{name}.py", tmp_path / f"s_{name}.py") for name in ("a", "b", "c")]
    records = {"ka": _record({"kind": "cuda", "name": "NVIDIA H100"}),
               "kb": _record({"kind": "cuda", "name": "NVIDIA A100"}),
               "kc": {**_record({"kind": "unknown", "name": "NVIDIA H100"}), "status": "crash", "gate2": None}}
    summary = summarize(pairs, {"a": "ka", "b": "kb", "c": "kc"}, records)
    assert summary.devices == ["NVIDIA A100", "NVIDIA H100"]  # a crash before any device is known names none
    assert [row.device for row in summary.rows] == ["NVIDIA H100", "NVIDIA A100", None]
    with pytest.raises(KforgeError, match=r"several devices \(NVIDIA A100: b; NVIDIA H100: a\).*--mix-devices"):
        check_devices(summary, mix_devices=False)
    check_devices(summary, mix_devices=True)
    one = summarize(pairs[:1], {"a": "ka"}, records)
    check_devices(one, mix_devices=False)
    assert one.fast_p[1.0] == 1.0


def test_the_harness_fingerprint_changes_with_any_of_the_judges_files(tmp_path):
    import shutil

    import kforge.harness

    copy = tmp_path / "harness"
    shutil.copytree(kforge.harness.__path__[0], copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert harness_fingerprint(copy) == harness_fingerprint()
    judge = copy / "judge.py"
    judge.write_text(judge.read_text().replace("COVER_MS = (1.0, 1.5)", "COVER_MS = (0.5, 1.5)"))
    assert harness_fingerprint(copy) != harness_fingerprint()


def test_without_ray_the_ray_executor_says_how_to_install_it(monkeypatch):
    from kforge.harness.executors import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(KforgeError, match=r"pip install 'kforge\[ray\]'"):
        RayExecutor()


@pytest.mark.parametrize("args, message", [
    (["--executor", "ray", "--gpus", "0"], "--gpus picks this machine's GPUs"),
    (["--address", "10.0.0.1:6379"], "are for --executor ray"),
    (["--ray-resources", "GPU=1"], "are for --executor ray"),
])
def test_executor_options_that_contradict_each_other_are_refused(args, message):
    done = CliRunner().invoke(app, ["suite", "level1", "--solutions", "builtin", "--only", "transpose_bf16", *args])
    assert isinstance(done.exception, KforgeError), done.output
    assert message in done.exception.reason
