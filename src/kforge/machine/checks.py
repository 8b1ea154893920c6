"""Static checks: an AST pass over machine-written code that flags known tricks.

    flags = static_flags(code, forbidden_ops=problem.forbidden_ops)   # [Flag(code, line, message)]

The flags are recorded and fed back to the model; they never decide a verdict. A flag is
a pattern, not a proof (a side stream can be honest, an aliased clock can hide from any
AST walk); what judges a candidate is the harness's runtime defences, which run whether
or not a flag fired (docs/harness.md). Flags exist so that a reader of the records, and
the model, see the attempt at once rather than infer it from a timing.

Codes:
    side_stream     creates or enters a CUDA stream other than torch's current one
    concurrency     threads, processes, executors, os.fork / system / spawn / exec
    timer           reads or touches a clock: time.*, timeit, CUDA events
    monkeypatch     assigns to (or setattr on) an attribute of an imported module
    global_state    torch.backends.*, default dtype or device, denormals, seeds, matmul precision
    dispatch_mode   TorchFunctionMode / TorchDispatchMode, __torch_function__, torch.library, torch._C
    introspection   sys.setprofile / settrace / modules, frames, gc, inspect, ctypes, builtins
    forbidden_op    calls an op the problem forbids (its `forbidden_ops`), by name; or calls a
                    module built from a class of that name (`self.fc = nn.Linear(...)` is
                    no call of aten::linear, `self.fc(x)` is)
    torch_fallback  no custom kernel: no @triton.jit function launched, no CUDA source loaded
    unparsed        the code is not valid Python; nothing else was checked
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Flag:
    code: str
    line: int
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


SIDE_STREAM = {"torch.cuda.Stream", "torch.cuda.ExternalStream", "torch.cuda.stream", "torch.cuda.set_stream",
               "torch.cuda.StreamContext", "torch.cuda.streams.Stream", "torch.cuda.streams.ExternalStream",
               "torch.Stream", "torch.cuda.Stream.wait_stream"}
TIMER = {"torch.cuda.Event", "torch.Event", "torch.cuda.Event.elapsed_time"}
TIMER_MODULES = ("time", "timeit")
CONCURRENCY_MODULES = ("threading", "_thread", "multiprocessing", "subprocess", "concurrent", "asyncio",
                       "torch.multiprocessing", "pty")
CONCURRENCY_OS = ("os.fork", "os.forkpty", "os.system", "os.popen", "os.spawn", "os.exec", "os.posix_spawn",
                  "os.kill", "os.setsid")
GLOBAL_STATE = {"torch.set_default_dtype", "torch.set_default_device", "torch.set_default_tensor_type",
                "torch.set_flush_denormal", "torch.manual_seed", "torch.seed", "torch.set_rng_state",
                "torch.cuda.manual_seed", "torch.cuda.manual_seed_all", "torch.cuda.seed", "torch.cuda.seed_all",
                "torch.cuda.set_rng_state", "torch.set_float32_matmul_precision", "torch.use_deterministic_algorithms",
                "torch.set_num_threads", "torch.set_num_interop_threads", "random.seed", "numpy.random.seed"}
GLOBAL_STATE_MODULES = ("torch.backends", "torch.random")
DISPATCH_MODULES = ("torch.overrides", "torch.utils._python_dispatch", "torch.library", "torch._C")
DISPATCH_NAMES = ("TorchFunctionMode", "TorchDispatchMode")
DISPATCH_METHODS = ("__torch_function__", "__torch_dispatch__")
INTROSPECTION = {"sys.setprofile", "sys.settrace", "sys._getframe", "sys._current_frames", "sys.modules",
                 "threading.setprofile", "threading.settrace"}
INTROSPECTION_MODULES = ("gc", "inspect", "ctypes", "builtins")
FRAME_ATTRIBUTES = {"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame", "gi_frame", "cr_frame",
                    "__globals__", "__builtins__"}
CUDA_LOADERS = ("kforge.runtime.cuda.compile_cuda", "kforge.runtime.cuda.CudaKernel",
                "torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline", "cupy.RawKernel",
                "cupy.RawModule", "cuda.core", "numba.cuda.jit")
KFORGE_KERNELS = ("kforge.kernels", "kforge.ops")
MATMUL_OPS = {"matmul", "mm", "bmm"}  # what `a @ b` reaches at the dispatcher


def static_flags(code: str, forbidden_ops: list[str] | tuple[str, ...] = ()) -> list[Flag]:
    """Every flag the code raises, in line order (module docstring); [] for clean code."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [Flag("unparsed", exc.lineno or 0, f"not valid Python: {exc.msg}; nothing else was checked")]
    checker = _Checker(_aliases(tree), forbidden_ops)
    checker.find_forbidden_modules(tree)
    checker.visit(tree)
    checker.check_fallback(tree)
    return sorted(checker.flags.values(), key=lambda f: (f.line, f.code))


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the module path it stands for, from every import in the file."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _under(name: str, modules) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


class _Checker(ast.NodeVisitor):
    def __init__(self, aliases: dict[str, str], forbidden_ops):
        self.aliases = aliases
        self.flags: dict[tuple[str, int], Flag] = {}
        self.forbidden = {}  # the name a call would use -> the op
        for op in forbidden_ops:
            base = op.split("::", 1)[-1].split(".")[0].strip("_").lower()
            self.forbidden.setdefault(base, op)
        self.modules = {}  # a name bound to a module whose class is named like a forbidden op -> (class, op)
        self.in_kernel = False  # inside a @triton.jit function: its calls are Triton's, not torch's
        self.seen: set[str] = set()  # every module path the code refers to

    def flag(self, code: str, node: ast.AST, message: str) -> None:
        self.flags.setdefault((code, node.lineno), Flag(code, node.lineno, message))

    def qualified(self, node: ast.AST) -> str | None:
        """The dotted module path an expression names (torch.cuda.Stream), or None for local objects."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualified(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def category(self, name: str) -> tuple[str, str] | None:
        """(code, why) for a module path that is a known trick."""
        if name in SIDE_STREAM:
            return "side_stream", "work on another CUDA stream"
        if name in TIMER or _under(name, TIMER_MODULES):
            return "timer", "a clock or timing event in the candidate"
        if _under(name, CONCURRENCY_MODULES) or name.startswith(CONCURRENCY_OS):
            return "concurrency", "threads or processes beside the timed call"
        if name in GLOBAL_STATE or _under(name, GLOBAL_STATE_MODULES):
            return "global_state", "global torch state"
        if _under(name, DISPATCH_MODULES) or name.endswith(DISPATCH_NAMES):
            return "dispatch_mode", "intercepts torch's dispatch"
        if name in INTROSPECTION or _under(name, INTROSPECTION_MODULES):
            return "introspection", "reaches into the interpreter"
        return None

    # --- references, calls and assignments -------------------------------------------------

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in FRAME_ATTRIBUTES:
            self.flag("introspection", node, f".{node.attr}: reaches into frames or globals")
        self.reference(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == "__builtins__":
            self.flag("introspection", node, "__builtins__: reaches into the interpreter")
        self.reference(node)

    def reference(self, node: ast.Attribute | ast.Name) -> None:
        name = self.qualified(node)
        if name:
            self.seen.add(name)
        found = self.category(name) if name else None
        if found and not isinstance(node.ctx, ast.Store):
            self.flag(found[0], node, f"{name}: {found[1]}")
        if isinstance(node, ast.Attribute):
            self.visit(node.value)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self.assigned(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.assigned(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.assigned(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self.assigned(target)
        self.generic_visit(node)

    def assigned(self, target: ast.AST, via: str = "assigns") -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for item in target.elts:
                self.assigned(item, via)
            return
        if not isinstance(target, ast.Attribute):
            return
        name = self.qualified(target)
        if name is None:
            return
        found = self.category(name)
        if found:
            self.flag(found[0], target, f"{via} {name}: {found[1]}")
        else:
            self.flag("monkeypatch", target, f"{via} {name}: patches a module other code relies on")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            owner = self.qualified(node.args[0])
            if owner is not None:
                attr = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
                self.assigned(ast.Attribute(value=node.args[0], attr=str(attr), ctx=ast.Store(),
                                            lineno=node.lineno), via=func.id)
        if self.forbidden and not self.in_kernel:
            self.forbidden_call(node)
        self.generic_visit(node)

    def forbidden_class(self, call: ast.AST) -> tuple[str, str] | None:
        """(class, op) when `call` constructs a class named like a forbidden op (nn.Linear)."""
        if not isinstance(call, ast.Call):
            return None
        name = ast.unparse(call.func).split(".")[-1]
        op = self.forbidden.get(name.strip("_").lower()) if name[:1].isupper() else None
        return (ast.unparse(call.func), op) if op else None

    def find_forbidden_modules(self, tree: ast.AST) -> None:
        """Every name (self.fc, fc) bound to such a module, wherever it is called from."""
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                found = self.forbidden_class(node.value)
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if found:
                    self.modules.update((ast.unparse(t), found) for t in targets)

    def forbidden_call(self, node: ast.Call) -> None:
        name = self.qualified(node.func)
        if name is not None and name.startswith("triton."):
            return
        called = ast.unparse(node.func)
        if called in self.modules:
            cls, op = self.modules[called]
            self.flag("forbidden_op", node, f"{called}(): a {cls}, reaches {op}, which the problem forbids (the "
                                            f"harness rejects it at run time)")
            return
        for part in called.split("."):
            if part[:1].isupper():  # a class: constructing a module calls no op (calling it does, above)
                continue
            op = self.forbidden.get(part.strip("_").lower())
            if op:
                self.flag("forbidden_op", node, f"{called}(): reaches {op}, which the problem "
                                                f"forbids (the harness rejects it at run time)")
                return

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, ast.MatMult) and not self.in_kernel:
            op = next((self.forbidden[name] for name in MATMUL_OPS if name in self.forbidden), None)
            if op:
                self.flag("forbidden_op", node, f"`@` reaches {op}, which the problem forbids")
        self.generic_visit(node)

    # --- definitions ----------------------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if node.name in DISPATCH_METHODS:
            self.flag("dispatch_mode", node, f"defines {node.name}: intercepts torch's dispatch")
        for decorator in node.decorator_list:
            self.visit(decorator)
        kernel, self.in_kernel = self.in_kernel, self.in_kernel or self.is_triton_kernel(node)
        for item in [node.args, *node.body]:
            self.visit(item)
        self.in_kernel = kernel

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = self.qualified(base) or ast.unparse(base)
            if name.endswith(DISPATCH_NAMES):
                self.flag("dispatch_mode", node, f"class {node.name}({name}): intercepts torch's dispatch")
        self.generic_visit(node)

    def is_triton_kernel(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            name = self.qualified(target)
            if name is not None and name.startswith("triton."):
                return True
        return False

    # --- a bare PyTorch fallback ------------------------------------------------------------

    def check_fallback(self, tree: ast.Module) -> None:
        model_new = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelNew"), None)
        if model_new is None:
            return
        forward = next((n for n in model_new.body if isinstance(n, ast.FunctionDef) and n.name == "forward"),
                       model_new)
        if any(name.startswith(CUDA_LOADERS) or _under(name, KFORGE_KERNELS) for name in self.seen):
            return
        kernels = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and self.is_triton_kernel(n)]
        if not kernels:
            self.flag("torch_fallback", forward, "no custom kernel: no @triton.jit function and no CUDA source "
                                                 "loaded; ModelNew.forward runs PyTorch's own ops")
            return
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        if not used & set(kernels):
            self.flag("torch_fallback", forward, f"defines @triton.jit {', '.join(kernels)} but never launches "
                                                 "it; ModelNew.forward runs PyTorch's own ops")
