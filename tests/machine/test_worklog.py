"""`kforge worklog DIR`: every figure on the page comes from DIR's records and files."""

import json
import random
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kforge.cli as cli
from conftest import FIXTURES
from kforge.harness.evaluate import identity
from kforge.harness.record import EvalRecord, append_record, read_store, sealed_line
from kforge.harness.roofline import Ceilings, roofline_for, save_ceilings
from kforge.harness.verdict import judge_speed
from kforge.machine import worklog
from kforge.machine.estimators import pass_at_k

H100 = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "index": 0, "capability": "9.0", "multiprocessors": 132,
        "cache_bytes": 52428800, "memory_bytes": 85017493504}
A100 = {**H100, "name": "NVIDIA A100-SXM4-80GB", "capability": "8.0", "multiprocessors": 108}
CEILINGS = Ceilings(device=H100["name"], kind="cuda", copy_gbps=3000.0, matmul_tflops={"fp32": 51.0},
                    measured_on="2026-11-21")
FLOPS, BYTES = 3.21e9, 123_000_000  # not what problem.py computes: the page must show the records' own
PLAN = "Memory-bound at this size: one read of x, one write of the sums.\nFirst: vectorize the loop over rows.\n"
SUM_ROWS = '"""Vectorized: one sum over dim 1 instead of a Python loop over rows."""\nimport torch\n\n\n' \
           'class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return x.sum(dim=1)\n'
NAIVE = '"""Naive: the reference\'s loop, to have a baseline of my own.\n\nMore words here."""\nimport torch\n\n\n' \
        'class ModelNew(torch.nn.Module):\n    def forward(self, x):\n' \
        '        return torch.stack([r.sum() for r in x])\n'


def eval_record(problem: Path, candidate: Path, status: str, *, speedup: float | None = None, reason=None,
                device=H100, created="2026-11-28T10:00:00+00:00", seed=0) -> EvalRecord:
    """An EvalRecord as the judge writes it: gate 2's verdict from paired per-round times, the
    roofline from the ceilings."""
    gate1 = None  # a candidate that did not load never reached gate 1
    if status != "candidate_error":
        gate1 = {"passed": status != "incorrect", "trials": 7, "trials_passed": 7 if status != "incorrect" else 3,
                 "failure": None if status != "incorrect" else "values", "reason": reason}
    gate2 = roofline = None
    if speedup is not None:
        rng = random.Random(seed)
        reference = [1.0 + 0.01 * rng.random() for _ in range(40)]
        again = [1.0 + 0.01 * rng.random() for _ in range(40)]
        candidate_ms = [r / speedup * (1 + 0.005 * rng.random()) for r in reference]
        verdict = judge_speed(reference, candidate_ms, again)
        stats = {"reference": {"median_ms": statistics.median(reference), "n": 40},
                 "candidate": {"median_ms": statistics.median(candidate_ms), "n": 40}}
        gate2 = {"passed": status == "passed", "speedup": verdict.speedup, "verdict": verdict.to_dict(),
                 "stats": stats}
        roof = roofline_for(FLOPS, BYTES, "fp32", CEILINGS)
        roofline = {**roof.to_dict(), "reference": asdict(roof.point(stats["reference"]["median_ms"])),
                    "candidate": asdict(roof.point(stats["candidate"]["median_ms"])), "ceilings": CEILINGS.to_dict()}
    return EvalRecord(status=status, problem={**identity(problem), "size": "full", "tags": []},
                      candidate=identity(candidate), device=device, versions={}, reason=reason, gate1=gate1,
                      gate2=gate2, roofline=roofline, created=created)


PROMPT = [{"role": "system", "content": "You are an expert GPU kernel engineer."},
          {"role": "user", "content": "# Task\n\nWrite `ModelNew`.\n\n```python\nclass Model: ...\n```\n"}]


def machine_attempt(folder: Path, sample: int, turn: int, status: str, record: EvalRecord | None = None,
                    reason=None, flags=()) -> dict:
    problem = folder / "problem.py"
    run = "run0001"
    return {"kind": "machine_attempt", "schema": 1, "id": f"{run}/s{sample}/t{turn}", "run": run,
            "problem": {"name": "problem", "path": str(problem), "sha256": identity(problem)["sha256"]},
            "sample": sample, "turn": turn, "parent": f"{run}/s{sample}/t{turn - 1}" if turn else None,
            "model": "qwen2.5-coder-32b", "backend": "triton", "endpoint": "http://localhost:8000/v1",
            "prompt": PROMPT, "reply": "```python\n...\n```", "code": "...", "code_sha256": "0" * 64,
            "status": status, "reason": reason if record is None else record.reason,
            "record": None if record is None else record.to_dict(),
            "static_flags": [{"code": code, "line": 3, "message": "..."} for code in flags], "feedback": "...",
            "usage": None, "elapsed_s": 12.5, "created": "2026-11-28T11:00:00+00:00"}


@pytest.fixture
def folder(tmp_path) -> Path:
    """A worklog folder: the problem, the plan, two hand versions and their records, no machine records."""
    folder = tmp_path / "rowsums"
    (folder / "hand").mkdir(parents=True)
    (folder / "problem.py").write_text((FIXTURES / "problems" / "row_sums.py").read_text())
    (folder / "plan.md").write_text(PLAN)
    (folder / "hand" / "v1_naive.py").write_text(NAIVE)
    (folder / "hand" / "v2_vector.py").write_text(SUM_ROWS)
    problem = folder / "problem.py"
    append_record(folder / "hand.jsonl", eval_record(problem, folder / "hand" / "v1_naive.py", "slower", speedup=0.55,
                                                     reason="slower: 0.550x"))
    append_record(folder / "hand.jsonl", eval_record(problem, folder / "hand" / "v2_vector.py", "passed",
                                                     speedup=1.8, seed=1))
    return folder


def add_machine(folder: Path) -> list[dict]:
    """Two samples: one fixed in three turns, one that never got past a tie."""
    code = folder / "machine"
    code.mkdir()
    problem = folder / "problem.py"
    for name, text in (("wrong", SUM_ROWS.replace("dim=1", "dim=0")), ("good", SUM_ROWS), ("tied", NAIVE)):
        (code / f"{name}.py").write_text(text)
    attempts = [
        machine_attempt(folder, 0, 0, "candidate_error", eval_record(
            problem, code / "wrong.py", "candidate_error", reason="ModelNew() raised: NameError: tl is not defined\n"
            "  File candidate.py, line 4")),
        machine_attempt(folder, 0, 1, "incorrect", eval_record(problem, code / "wrong.py", "incorrect",
                                                                reason="gate 1 failed: wrong shape"),
                        flags=("torch_fallback",)),
        machine_attempt(folder, 0, 2, "passed", eval_record(problem, code / "good.py", "passed", speedup=1.4, seed=2)),
        machine_attempt(folder, 1, 0, "no_code", reason="no fenced block defines ModelNew"),
        machine_attempt(folder, 1, 1, "tie", eval_record(problem, code / "tied.py", "tie", speedup=1.0, seed=3,
                                                          reason="not measurably different")),
    ]
    with open(folder / "machine.jsonl", "w") as handle:
        handle.writelines(sealed_line(a) + "\n" for a in attempts)
    return attempts


def section(text: str, number: int) -> str:
    start = text.index(f"## {number}.")
    end = text.find(f"## {number + 1}.", start)
    return text[start:] if end < 0 else text[start:end]


def hand_row(text: str, name: str) -> list[str]:
    line = next(line for line in section(text, 2).splitlines() if line.startswith(f"| {name} "))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_every_section_comes_from_the_records(folder):
    attempts = add_machine(folder)
    written = worklog.write_worklog(folder)
    text = written.path.read_text()
    assert written.path == folder / "worklog.md" and not written.fallback
    assert text.splitlines()[0] == worklog.MARKER
    assert all(f"## {n}." in text for n in range(1, 6))

    one = section(text, 1)
    assert "3.21 GFLOP (fp32)" in one and "123 MB" in one and f"{FLOPS / BYTES:.3g} FLOP/B" in one
    assert "compute-bound" in one and H100["name"] in one  # 26 FLOP/B, over the ridge of 17
    assert f"{51.0 * 1e3 / 3000.0:.3g} FLOP/B" in one  # the ridge point of the record's ceilings
    assert PLAN.rstrip() in one, "plan.md verbatim"

    records = {r["candidate"]["name"]: r for r in read_store(folder / "hand.jsonl").records}
    for name in ("v1_naive", "v2_vector"):
        row = hand_row(text, f"{name}.py")
        gate2 = records[name]["gate2"]
        verdict = gate2["verdict"]
        assert row[2] == records[name]["status"]
        assert row[4] == f"{gate2['speedup']:.3f}x ({verdict['low']:.3f}-{verdict['high']:.3f})"
        assert row[5] == f"{records[name]['roofline']['candidate']['pct_of_roof']:.1f}%"
    assert hand_row(text, "v1_naive.py")[1] == "Naive: the reference's loop, to have a baseline of my own."
    assert (folder / "worklog-hand.png").is_file() and (folder / "worklog-head-to-head.png").is_file()
    assert "](worklog-hand.png)" in text and "](worklog-head-to-head.png)" in text

    three = section(text, 3)
    assert "qwen2.5-coder-32b" in three and "http://localhost:8000/v1" in three
    details = three[three.index("<details>"):three.index("</details>")]
    assert all(message["content"].rstrip() in details for message in PROMPT), "the exact first prompt"
    assert "````\n# Task" in details, "a fence longer than the prompt's own"
    assert "compiled and ran to gate 1's verdict in 0/2, passed gate 1 in 0/2, passed both gates in 0/2" in three
    assert f"candidate_error → incorrect → passed {attempts[2]['record']['gate2']['speedup']:.2f}x" in three
    pass_1, fast_1 = pass_at_k(2, 2, 1), pass_at_k(2, 1, 1)  # both samples correct (a tie is); one fast_1
    assert f"| 1 | {pass_1:.3f} | {fast_1:.3f} |" in three
    assert f"| 2 | {pass_at_k(2, 2, 2):.3f} | {pass_at_k(2, 1, 2):.3f} |" in three

    four = section(text, 4)
    best_hand, best_machine = records["v2_vector"], attempts[2]["record"]
    assert "| best by hand | v2_vector.py | passed |" in four
    assert f"| best by the machine | {attempts[2]['id']} | passed |" in four
    for record in (best_hand, best_machine):
        assert f"{record['gate2']['speedup']:.3f}x" in four

    five = section(text, 5)
    assert "| slower | slower: 0.550x | 1 |" in five
    for status, reason in (("candidate_error", "ModelNew() raised: NameError: tl is not defined"),
                           ("incorrect", "gate 1 failed: wrong shape"), ("no_code", "no fenced block defines ModelNew"),
                           ("tie", "not measurably different")):
        assert f"| {status} | {reason} | 1 |" in five
    assert "torch_fallback 1" in five


def test_a_worklog_the_person_wrote_is_never_overwritten(folder):
    mine = "# My worklog\n\nwritten by hand\n"
    (folder / "worklog.md").write_text(mine)
    written = worklog.write_worklog(folder)
    assert written.fallback and written.path == folder / "worklog.generated.md"
    assert (folder / "worklog.md").read_text() == mine
    assert (folder / "worklog.generated-hand.png").is_file()
    assert worklog.write_worklog(folder).path == folder / "worklog.generated.md", "its own page it rewrites"
    (folder / "worklog.md").unlink()
    assert worklog.write_worklog(folder).path == folder / "worklog.md"
    assert worklog.write_worklog(folder).path == folder / "worklog.md", "a page it generated it rewrites"


def test_missing_machine_records_are_said_plainly(folder):
    text = worklog.write_worklog(folder).path.read_text()
    assert "No machine records yet: run `kforge machine" in section(text, 3)
    assert f"--results {folder / 'machine.jsonl'}" in section(text, 3)
    assert "| best by the machine | no correct attempt | - |" in section(text, 4)
    assert "No attempts yet." in section(text, 5)


def test_an_edited_hand_file_and_another_device_are_not_mixed_in(folder):
    problem = folder / "problem.py"
    (folder / "hand" / "v3_new.py").write_text(SUM_ROWS.replace("Vectorized", "Newer"))
    append_record(folder / "hand.jsonl", eval_record(problem, folder / "hand" / "v3_new.py", "passed", speedup=3.0,
                                                     device=A100, created="2026-11-27T10:00:00+00:00"))
    (folder / "hand" / "v1_naive.py").write_text(NAIVE + "# edited\n")
    text = worklog.write_worklog(folder).path.read_text()
    assert hand_row(text, "v1_naive.py")[2].startswith("edited since its last record")
    assert hand_row(text, "v3_new.py")[2].startswith("not evaluated")  # its record is the A100's
    assert "records from NVIDIA A100-SXM4-80GB are left out" in text
    assert "v3_new" not in section(text, 4)
    text = worklog.write_worklog(folder, device=A100["name"]).path.read_text()
    assert hand_row(text, "v3_new.py")[2] == "passed" and "| best by hand | v3_new.py | passed |" in text


def test_a_tampered_line_is_reported_and_left_out(folder):
    lines = (folder / "hand.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"passed"', '"slower"', 1)
    (folder / "hand.jsonl").write_text("\n".join(lines) + "\n")
    written = worklog.write_worklog(folder)
    assert any("line 2: checksum mismatch" in note for note in written.notes)
    assert hand_row(written.path.read_text(), "v2_vector.py")[2].startswith("not evaluated")


def test_with_no_record_section_1_is_computed_from_the_problem(tmp_path, cpu, cpu_ceilings):
    folder = tmp_path / "fresh"
    folder.mkdir()
    (folder / "problem.py").write_text((FIXTURES / "problems" / "row_sums.py").read_text())
    one = section(worklog.write_worklog(folder).path.read_text(), 1)
    assert "128 FLOP" in one and "544 B" in one  # row_sums at its tiny size: 8 x 16 fp32 in, 8 out
    assert "not measured" in one and "No plan.md yet" in one
    save_ceilings(cpu, cpu_ceilings)
    one = section(worklog.write_worklog(folder).path.read_text(), 1)
    assert "cached ceilings" in one and "memory-bound" in one


def test_no_problem_is_one_error_line_and_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["kforge", "worklog", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and stderr.startswith("error: no problem.py in") and stderr.count("\n") == 1


@pytest.mark.slow
def test_evaluate_appends_the_missing_hand_version(tmp_path, cpu, cpu_ceilings):
    save_ceilings(cpu, cpu_ceilings)  # nothing is measured: the test's cache (conftest)
    folder = tmp_path / "rowsums"
    (folder / "hand").mkdir(parents=True)
    (folder / "problem.py").write_text((FIXTURES / "problems" / "row_sums.py").read_text())
    (folder / "hand" / "v1_vector.py").write_text(SUM_ROWS)
    args = ["worklog", str(folder), "--evaluate", "--time-budget", "0.2"]
    done = CliRunner().invoke(cli.app, args)
    assert done.exit_code == 0, done.output
    reading = read_store(folder / "hand.jsonl")
    [record] = reading.records
    assert not reading.rejected and record["device"]["name"] == cpu.name
    row = hand_row((folder / "worklog.md").read_text(), "v1_vector.py")
    assert row[2] == record["status"] and row[1] == "Vectorized: one sum over dim 1 instead of a Python loop over rows."
    if record["gate2"]:
        assert row[4].startswith(f"{record['gate2']['speedup']:.3f}x")
    assert CliRunner().invoke(cli.app, args).exit_code == 0
    assert len((folder / "hand.jsonl").read_text().splitlines()) == 1, "evaluated once: the record is there"
    assert json.loads((folder / "hand.jsonl").read_text())["checksum"].startswith("sha256:")


def test_each_model_is_scored_apart(folder):
    attempts = add_machine(folder)
    other = [{**a, "id": a["id"].replace("run0001", "run0002"), "run": "run0002", "model": "llama-3.1-70b",
              "created": "2026-11-28T12:00:00+00:00"} for a in attempts[3:]]
    failed = {**attempts[3], "id": "run0003/s0/t0", "run": "run0003", "model": "gone", "status": "request_failed",
              "reason": "connection refused", "record": None}
    with open(folder / "machine.jsonl", "a") as handle:
        handle.writelines(sealed_line(a) + "\n" for a in [*other, failed])
    three = section(worklog.write_worklog(folder).path.read_text(), 3)
    assert "### qwen2.5-coder-32b" in three and "### llama-3.1-70b" in three and "### gone" in three
    by_model = {part.split("\n", 1)[0]: part for part in three.split("### ")[1:]}
    assert "Over 2 sample(s): 2 correct" in by_model["qwen2.5-coder-32b"]
    assert "Over 1 sample(s): 1 correct" in by_model["llama-3.1-70b"], "its own samples only"
    assert "No attempt got a reply (1 failed request(s))" in by_model["gone"]


def test_the_committed_capstone_page_is_what_its_records_say(tmp_path):
    """docs/capstone/gpt2-mlp: a real model's replies (manual mode) and kforge's hand versions, judged on an
    H200. The page must be exactly what `kforge worklog` makes of the records beside it, and every record
    line must still pass its checksum (a hand-edited figure or record fails here)."""
    folder = Path(__file__).parents[2] / "docs" / "capstone" / "gpt2-mlp"
    inputs = worklog.load_inputs(folder)
    assert inputs.notes == []  # nothing left out: no damaged line, no other device or problem
    assert len(inputs.attempts) == 8 and all(a["status"] == "passed" for a in inputs.attempts)
    text, _charts = worklog.render(inputs, tmp_path / "worklog.md")
    assert text == (folder / "worklog.md").read_text()
    # every judged attempt's code is the candidate file kept beside the store, and its reply is kept too
    for attempt in inputs.attempts:
        run, sample, turn = attempt["id"].split("/")
        assert (folder / "machine" / run / sample / turn / "candidate.py").read_text() == attempt["code"]
        reply = folder / "replies" / f"{run}-{sample}-{turn}.reply.md"
        assert reply.read_text() == attempt["reply"]
