"""The red-team attacks through `kforge eval` on two trees (before the fixes, c18f6d7, and after), one
process per evaluation; prints one line each. Run from the repo root: python lab/redteam/run.py OLD NEW"""
import json
import os
import subprocess
import sys

OLD, NEW = sys.argv[1:3]
ATTACKS = [  # (file, problem, extra options)
    ("lab/redteam/memo_second_call.py", "examples/problems/vector_add.py", ["--size", "full", "--time-budget", "5"]),
    ("lab/redteam/lazy_named_tensor.py", "examples/problems/vector_add.py", ["--size", "full", "--time-budget", "3"]),
    ("lab/redteam/helper_in_prepare.py", "examples/problems/vector_add.py", ["--size", "full", "--time-budget", "5"]),
    ("tests/fixtures/candidates/identity_vector_add.py", "examples/problems/vector_add.py",
     ["--size", "full", "--time-budget", "5"]),  # an honest identity, for scale
    ("lab/redteam/warm_inf_calls.py", "examples/problems/vector_add.py", ["--time-budget", "1"]),
    ("lab/redteam/truncate_arena.py", "examples/problems/vector_add.py", ["--time-budget", "1"]),
    ("tests/fixtures/candidates/outlive_collapse_arena.py", "tests/fixtures/problems/add.py", ["--time-budget", "1"]),
    ("lab/redteam/markup_reason.py", "examples/problems/vector_add.py", ["--time-budget", "1"]),
    ("lab/redteam/matmul_fp16_unless_exposed.py", "tests/fixtures/problems/matmul_rand.py", ["--time-budget", "2"]),
]
for attack, problem, extra in ATTACKS:
    for name, tree in (("before", OLD), ("after", NEW)):
        done = subprocess.run([sys.executable, "-m", "kforge", "eval", os.path.abspath(problem),
                               os.path.abspath(attack), "--json", "--no-save", *extra],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": f"{tree}/src"})
        try:
            r = json.loads(done.stdout)
            speedup = f"{r['gate2']['speedup']:.3f}x" if (r.get("gate2") or {}).get("speedup") else "-"
            line = f"{r['status']:<12} {speedup:>8}  {','.join(r['defences']) or '-':<14} {(r['reason'] or '')[:90]}"
        except (json.JSONDecodeError, KeyError):
            tail = (done.stderr.strip().splitlines() or ["(nothing)"])[-1]
            line = f"no record, exit {done.returncode}: {tail[:110]}"
        print(f"{os.path.basename(attack):<34} {name:<7} {line}", flush=True)
        if "markup" in attack:  # the console view, where the markup was read
            shown = subprocess.run([sys.executable, "-m", "kforge", "eval", os.path.abspath(problem),
                                    os.path.abspath(attack), "--no-save", *extra], capture_output=True, text=True,
                                   env={**os.environ, "PYTHONPATH": f"{tree}/src"})
            print(f"{'  (console view)':<34} {name:<7} exit {shown.returncode}, "
                  f"{'a traceback' if 'Traceback' in shown.stderr else 'no traceback'}", flush=True)
