"""Cross-process placement study: is an identity's run-level bias per process (CPU placement,
address layout) or per model copy? Two child processes of the same code, each with two copies of
the same KernelBench model (same seed), timed alternately by the parent; affinity modes vary.
usage: python benchmarks/studies/cpu_placement.py KB_DIR OUT.jsonl --pairs 3 --rounds 40 --modes free,same1,same2,split PROB..."""
import json
import os
import random
import statistics
import subprocess
import sys
import time


def child():
    import importlib.util

    import torch
    dev = torch.device(os.environ.get("XDEV", "cuda"))
    if dev.type == "cpu":  # local smoke test of the protocol only
        class _E:
            def __init__(self, **k): self.t = 0
            def record(self): self.t = time.perf_counter()
            def synchronize(self): pass
            def elapsed_time(self, e): return (e.t - self.t) * 1e3
        torch.cuda.Event = _E
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a: None
    flush = torch.empty((256 if dev.type == "cuda" else 1) * 2**20, dtype=torch.uint8, device=dev)
    models = inputs = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "load":
            models = inputs = None
            torch.cuda.empty_cache()
            spec = importlib.util.spec_from_file_location("p", cmd["path"])
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            models = []
            pad = []
            for c in range(2):
                torch.manual_seed(0)
                models.append(mod.Model(*mod.get_init_inputs()).to(dev).eval())
                pad.append(torch.empty((c + 1) * (37 if dev.type == "cuda" else 1) * 2**20 + 4096 * (c + 3), dtype=torch.uint8, device=dev))
            torch.manual_seed(1)
            inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
            with torch.no_grad():
                for _ in range(5):
                    for m in models:
                        m(*inputs)
            torch.cuda.synchronize()
            reply = {"ok": True}
        elif cmd["op"] == "time":
            m = models[cmd["copy"]]
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.no_grad():
                flush.fill_(cmd.get("v", 1))
                torch.cuda.synchronize()
                torch.ones(4).add_(1)
                h0 = time.perf_counter()
                s.record()
                m(*inputs)
                e.record()
                e.synchronize()
                h1 = time.perf_counter()
            reply = {"dev": s.elapsed_time(e), "host": (h1 - h0) * 1e3}
        elif cmd["op"] == "where":
            with open("/proc/self/stat") as f:
                cpu = int(f.read().rsplit(")", 1)[1].split()[36])
            with open("/proc/self/maps") as f:
                base = f.readline().split("-")[0]
            reply = {"cpu": cpu, "affinity": sorted(os.sched_getaffinity(0)), "base": base}
        else:
            break
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


class Proc:
    def __init__(self, cpus, fixed=False):
        env = dict(os.environ, PYTHONHASHSEED="0") if fixed else None

        def pin():
            if fixed:
                import ctypes
                ctypes.CDLL(None).personality(0x0040000)  # ADDR_NO_RANDOMIZE, inherited across exec
            if cpus:
                os.sched_setaffinity(0, {c % os.cpu_count() for c in cpus})
        self.p = subprocess.Popen([sys.executable, __file__, "child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  preexec_fn=pin, text=True, env=env)

    def ask(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.p.stdin.flush()
        self.p.wait()


def boot_ci(ratios, n=2000, rng=random.Random(0)):
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n)]


MODES = {"free": (None, None), "same1": ({3}, {3}), "same2": ({3, 4}, {3, 4}), "split": ({3}, {9}),
         "same4": ({3, 4, 5, 6}, {3, 4, 5, 6}), "fixed1": ({3}, {3})}


def main():
    args = sys.argv[1:]
    kb, out = args[0], args[1]
    opts = {"--pairs": "3", "--rounds": "40", "--modes": "free,same1,split"}
    probs = []
    i = 2
    while i < len(args):
        if args[i] in opts:
            opts[args[i]] = args[i + 1]
            i += 2
        else:
            probs.append(args[i])
            i += 1
    rounds = int(opts["--rounds"])
    f = open(out, "a")
    print(f"{'mode':6} {'pair':4} {'problem':24} {'A/B':>7} {'95% CI':>15} {'A0/A1':>7} {'B0/B1':>7} {'A ms':>8} {'cpuA':>5} {'cpuB':>5}",
          flush=True)
    for mode in opts["--modes"].split(","):
        ca, cb = MODES[mode]
        for pair in range(int(opts["--pairs"])):
            A, B = Proc(ca, mode == "fixed1"), Proc(cb, mode == "fixed1")
            for prob in probs:
                path = os.path.join(kb, prob if prob.endswith(".py") else prob + ".py")
                A.ask(op="load", path=path)
                B.ask(op="load", path=path)
                t = {(w, c): [] for w in "AB" for c in (0, 1)}
                for r in range(rounds):
                    seq = [("A", 0), ("B", 0), ("B", 1), ("A", 1)]
                    if r % 2:
                        seq = [("B", 0), ("A", 0), ("A", 1), ("B", 1)]
                    for w, c in seq:
                        t[(w, c)].append((A if w == "A" else B).ask(op="time", copy=c, v=r % 200)["dev"])
                ab = [(t["A", 0][r] + t["A", 1][r]) / (t["B", 0][r] + t["B", 1][r]) for r in range(rounds)]
                a01 = [t["A", 0][r] / t["A", 1][r] for r in range(rounds)]
                b01 = [t["B", 0][r] / t["B", 1][r] for r in range(rounds)]
                lo, hi = boot_ci(ab)
                wa, wb = A.ask(op="where"), B.ask(op="where")
                rec = dict(mode=mode, pair=pair, problem=prob, ab=statistics.median(ab), ci=[lo, hi],
                           a01=statistics.median(a01), b01=statistics.median(b01),
                           a_ms=statistics.median(t["A", 0]), cpu_a=wa["cpu"], cpu_b=wb["cpu"],
                           times={f"{w}{c}": v for (w, c), v in t.items()})
                f.write(json.dumps(rec) + "\n")
                f.flush()
                print(f"{mode:6} {pair:4} {prob[:24]:24} {rec['ab']:7.4f} {lo:7.4f}-{hi:7.4f} {rec['a01']:7.4f} "
                      f"{rec['b01']:7.4f} {rec['a_ms']:8.3f} {wa['cpu']:5} {wb['cpu']:5} {wa['base']} {wb['base']}", flush=True)
            A.close()
            B.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child()
    else:
        main()
