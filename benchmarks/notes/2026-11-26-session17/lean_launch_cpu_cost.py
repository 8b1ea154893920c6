"""Python cost of one LeanLaunch call on the CPU, the driver replaced by a no-op (run with PYTHONPATH=src).

    python benchmarks/notes/2026-11-26-session17/lean_launch_cpu_cost.py
"""
import time

from kforge.runtime import driver


class NoDriver:
    @staticmethod
    def cuLaunchKernelEx(*args):
        return 0


driver.libcuda = lambda: NoDriver()
for kinds in [("ptr",) * 4 + ("i32",) * 8, ("ptr",) * 4 + ("i32",) * 4, ("map", "ptr", "map", "i32", "i32")]:
    launch = driver.LeanLaunch(1, (1, 1, 1), (32, 1, 1), 0, None, kinds)
    args = tuple(range(1, len(kinds) + 1))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(100_000):
            launch(0, *args)
        best = min(best, (time.perf_counter() - start) * 10)
    print(f"{len(kinds):3d} arguments ({', '.join(sorted(set(kinds)))}): {best:.2f} us a call")
