"""Static checks: each flag on code that does the trick, and none on honest code that comes close."""

import textwrap

import pytest
from replay_server import reply_text

from kforge.machine.checks import static_flags
from kforge.machine.extract import extract_code, fenced_blocks

# A Triton kernel that ModelNew launches: no torch_fallback flag. Each case adds lines to it.
KERNEL = '''
import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def add_kernel(out_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(a_ptr + offsets) + tl.load(b_ptr + offsets))


class ModelNew(nn.Module):
    def forward(self, a, b):
        out = torch.empty_like(a)
        add_kernel[(triton.cdiv(a.numel(), 1024),)](out, a, b, a.numel(), BLOCK=1024)
        {extra}
        return out
'''


def flags_of(extra: str = "pass", header: str = "", forbidden=()) -> list[tuple[str, str]]:
    code = textwrap.dedent(header) + KERNEL.replace("{extra}", extra)
    return [(f.code, f.message) for f in static_flags(code, forbidden)]


def codes(extra: str = "pass", header: str = "", forbidden=()) -> set[str]:
    return {code for code, _ in flags_of(extra, header, forbidden)}


def test_honest_kernels_raise_no_flag():
    assert static_flags(KERNEL.replace("{extra}", "pass")) == []
    assert static_flags(extract_code(reply_text("correct")).code, ["aten::mm"]) == []


@pytest.mark.parametrize("extra, header", [
    ("s = torch.cuda.Stream()", ""),
    ("with torch.cuda.stream(self.s): pass", ""),
    ("torch.cuda.set_stream(self.s)", ""),
    ("s = Stream()", "from torch.cuda import Stream\n"),
])
def test_side_streams_are_flagged(extra, header):
    assert codes(extra, header) == {"side_stream"}


def test_the_current_stream_is_not_a_side_stream():
    assert codes("torch.cuda.current_stream().synchronize()") == set()


@pytest.mark.parametrize("extra, header", [
    ("threading.Thread(target=print).start()", "import threading\n"),
    ("Pool(2)", "from multiprocessing import Pool\n"),
    ("subprocess.run(['true'])", "import subprocess\n"),
    ("os.fork()", "import os\n"),
    ("os.system('true')", "import os\n"),
    ("ThreadPoolExecutor(2)", "from concurrent.futures import ThreadPoolExecutor\n"),
])
def test_threads_and_processes_are_flagged(extra, header):
    assert codes(extra, header) == {"concurrency"}


def test_other_os_calls_are_not_concurrency():
    assert codes("os.environ.get('X'); os.path.join('a', 'b')", "import os\n") == set()


@pytest.mark.parametrize("extra, header", [
    ("t = time.perf_counter()", "import time\n"),
    ("t = perf_counter()", "from time import perf_counter\n"),
    ("e = torch.cuda.Event(enable_timing=True)", ""),
    ("time.perf_counter = lambda: 0.0", "import time\n"),
    ("setattr(time, 'perf_counter_ns', lambda: 0)", "import time\n"),
])
def test_clocks_and_their_patching_are_flagged(extra, header):
    assert codes(extra, header) == {"timer"}


def test_a_local_name_that_shadows_no_clock_is_not_a_timer():
    assert codes("time = 3; t = time + 1") == set()


@pytest.mark.parametrize("extra", ["torch.cuda.synchronize = lambda *a: None", "torch.add = torch.sub",
                                   "setattr(torch, 'add', torch.sub)", "del torch.nn.functional.gelu"])
def test_assigning_into_a_module_is_a_monkeypatch(extra):
    assert codes(extra) == {"monkeypatch"}


def test_assigning_to_self_or_a_local_object_is_not_a_monkeypatch():
    assert codes("self.cache = out; out.grad = None; setattr(self, 'n', 1)") == set()


@pytest.mark.parametrize("extra, header", [
    ("torch.backends.cuda.matmul.allow_tf32 = True", ""),
    ("torch.set_default_dtype(torch.float16)", ""),
    ("torch.set_flush_denormal(True)", ""),
    ("torch.manual_seed(0)", ""),
    ("np.random.seed(0)", "import numpy as np\n"),
    ("torch.set_float32_matmul_precision('medium')", ""),
])
def test_global_torch_state_is_flagged(extra, header):
    assert codes(extra, header) == {"global_state"}


def test_reading_dtypes_and_no_grad_is_not_global_state():
    assert codes("x = torch.get_default_dtype()\n        with torch.no_grad(): pass") == set()


@pytest.mark.parametrize("header", [
    "from torch.overrides import TorchFunctionMode\nclass Spy(TorchFunctionMode):\n    pass\n",
    "from torch.utils._python_dispatch import TorchDispatchMode\nclass Spy(TorchDispatchMode):\n    pass\n",
    "class Lazy(torch.Tensor):\n    @classmethod\n    def __torch_function__(cls, *a, **k):\n        pass\n",
    "lib = torch.library.Library('aten', 'IMPL')\n",
])
def test_dispatch_interception_is_flagged(header):
    assert codes(header="import torch\n" + header) == {"dispatch_mode"}


def test_an_ordinary_tensor_method_is_not_dispatch_interception():
    assert codes(header="class Helper:\n    def __call__(self, x):\n        return x\n") == set()


@pytest.mark.parametrize("extra, header", [
    ("sys.setprofile(None)", "import sys\n"),
    ("f = sys._getframe(1)", "import sys\n"),
    ("g = self.forward.__globals__", ""),
    ("gc.get_objects()", "import gc\n"),
    ("inspect.stack()", "import inspect\n"),
    ("ctypes.memmove(0, 0, 0)", "import ctypes\n"),
    ("sys.modules['kforge'] = None", "import sys\n"),
])
def test_reaching_into_the_interpreter_is_flagged(extra, header):
    assert codes(extra, header) == {"introspection"}


def test_sys_for_ordinary_reasons_is_not_introspection():
    assert codes("v = sys.version_info; m = sys.maxsize", "import sys\n") == set()


@pytest.mark.parametrize("extra", ["c = torch.mm(a, b)", "c = a.mm(b)", "c = a @ b",
                                   "c = torch.ops.aten.mm.default(a, b)", "c = F.linear(a, b)"])
def test_calls_to_a_forbidden_op_are_flagged(extra):
    forbidden = ["aten::mm", "aten::matmul", "aten::linear"]
    assert codes(extra, "import torch.nn.functional as F\n", forbidden) == {"forbidden_op"}


def test_a_forbidden_op_that_is_not_called_or_is_tritons_own_is_not_flagged():
    forbidden = ["aten::mm", "aten::sum", "aten::_log_softmax"]
    assert codes("c = torch.add(a, b); s = a.mean(); m = 'mm'", forbidden=forbidden) == set()
    # tl.sum and tl.dot inside a kernel are Triton's, whatever the problem forbids of torch
    assert static_flags(KERNEL.replace("{extra}", "pass").replace("+ tl.load(b_ptr + offsets)",
                                                                  "+ tl.sum(tl.load(b_ptr + offsets))"),
                        forbidden) == []


def test_a_module_named_like_a_forbidden_op_is_flagged_where_it_is_called_not_where_it_is_built():
    # the reference's own nn.Linear kept as the weights' holder is no call of aten::linear
    holder = """
        import torch
        from torch import nn

        class ModelNew(nn.Module):
            def __init__(self, n):
                super().__init__()
                self.c_fc = nn.Linear(n, n)
                self.scale = nn.Parameter(torch.ones(n))

            def forward(self, x):
                return {call}
        """
    forbidden = ["aten::linear", "aten::mm"]
    weights_only = textwrap.dedent(holder.format(call="mine(x, self.c_fc.weight, self.c_fc.bias)"))
    assert [f.code for f in static_flags(weights_only, forbidden)] == ["torch_fallback"]  # no forbidden_op
    called = static_flags(textwrap.dedent(holder.format(call="self.c_fc(x) * self.scale")), forbidden)
    [flag] = [f for f in called if f.code == "forbidden_op"]
    assert flag.line == 12 and "self.c_fc(): a nn.Linear, reaches aten::linear" in flag.message
    local = "lin = torch.nn.Linear(4, 4)\n        y = lin(a)"
    assert codes(local, forbidden=forbidden) == {"forbidden_op"}
    assert codes("lin = torch.nn.Linear(4, 4)", forbidden=forbidden) == set()


def test_a_forbidden_op_is_flagged_by_its_name_without_underscores():
    assert codes("y = torch.log_softmax(a, -1)", forbidden=["aten::_log_softmax"]) == {"forbidden_op"}


def test_forward_in_plain_pytorch_is_a_fallback():
    code = "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, a, b):\n        return a + b\n"
    (flag,) = static_flags(code)
    assert (flag.code, flag.line) == ("torch_fallback", 3) and "no custom kernel" in flag.message
    for block in fenced_blocks(reply_text("two_model_new")):  # torch.add, with and without out=
        assert [f.code for f in static_flags(block.code)] == ["torch_fallback"]


def test_a_kernel_defined_but_never_launched_is_a_fallback():
    code = KERNEL.replace("add_kernel[(triton.cdiv(a.numel(), 1024),)](out, a, b, a.numel(), BLOCK=1024)",
                          "out = a + b").replace("{extra}", "pass")
    (flag,) = static_flags(code)
    assert flag.code == "torch_fallback" and "never launches" in flag.message


def test_a_cuda_source_loaded_through_kforge_or_a_kforge_kernel_is_not_a_fallback():
    cuda = ("from kforge.runtime.cuda import CudaKernel, compile_cuda\nimport torch\n"
            "class ModelNew(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
            "        self.k = CudaKernel(compile_cuda('k.cu', cache=False), 'add')\n"
            "    def forward(self, a, b):\n        out = torch.empty_like(a)\n"
            "        self.k.launch(grid=4, block=256, args=(out, a, b, a.numel()))\n        return out\n")
    assert static_flags(cuda) == []
    library = ("import torch\nfrom kforge.kernels.reductions.cumsum import cumsum_forward\n"
               "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return cumsum_forward(x)\n")
    assert static_flags(library) == []


def test_code_that_does_not_parse_is_flagged_once_with_its_line():
    (flag,) = static_flags("import torch\nclass ModelNew(:\n    pass\n")
    assert (flag.code, flag.line) == ("unparsed", 2)


def test_the_recorded_cheat_is_flagged_for_its_stream_and_its_clock():
    flags = static_flags(extract_code(reply_text("cheat")).code)
    assert {f.code for f in flags} == {"timer", "side_stream"}
    assert any(f.message.startswith("assigns time.perf_counter") and f.line == 9 for f in flags)
