"""Shared fixtures. kforge is imported first: on a machine with no GPU it turns on
Triton's interpreter, which must happen before anything imports triton."""

import textwrap
from pathlib import Path

import pytest
import torch

import kforge  # noqa: F401  (before triton)
from kforge.device import current_device
from kforge.harness.roofline import Ceilings
from kforge.harness.timing import TimingConfig

FIXTURES = Path(__file__).parent / "fixtures"
EXAMPLES = Path(__file__).parent.parent / "examples"


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow (what .ci/run does)")


def pytest_collection_modifyitems(config, items):
    # `pytest` alone leaves the slow tests out (CONTRIBUTING.md); they run with --run-slow, with
    # -m (e.g. -m slow), or when a test file or test is named on the command line
    named = config.args_source is not pytest.Config.ArgsSource.TESTPATHS
    if not (config.getoption("--run-slow") or config.option.markexpr or named):
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Never read or write the user's cache of measured ceilings, nor leave result files in
    the working directory: a command's default result files land in the test's tmp_path."""
    monkeypatch.setenv("KFORGE_CACHE_DIR", str(tmp_path / "kforge-cache"))
    monkeypatch.setenv("KFORGE_RESULTS_DIR", str(tmp_path))


@pytest.fixture
def cpu():
    return current_device("cpu")


@pytest.fixture
def cpu_ceilings(cpu):
    """Stand-in ceilings, so tests do not spend seconds measuring the CPU."""
    return Ceilings(device=cpu.name, kind="cpu", copy_gbps=10.0, matmul_tflops={"fp32": 0.5},
                    measured_on="2026-11-21")


# Compile-only checks of the SASS a Triton kernel becomes hold for the compiler the device
# machines run (Triton 3.6). Triton 3.7.1, PyPI's pair for torch 2.13, spills 48 bytes in
# an NVFP4 GEMV tile and adds loop instructions to the W4A16 GEMM's: a different compiler,
# not a change of ours.
codegen_of_triton_3_6 = pytest.mark.skipif(
    not __import__("triton").__version__.startswith("3.6."),
    reason="SASS expectations are Triton 3.6's, the device machines' compiler")


@pytest.fixture
def fast_timing():
    return TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=5, budget_s=0.3)


def scripted_timing(speedup: float, reference_ms: float = 2.0, budget_s: float = 5.0) -> TimingConfig:
    """Gate 2 on known timings: every reference call takes `reference_ms`, every candidate
    call `reference_ms / speedup`, give or take a deterministic 0.2%. A shared CPU's real
    timings would make any speed assertion flaky (and prove nothing)."""
    def script(name: str, round_index: int) -> float:
        jitter = 1.0 + 0.001 * ((round_index * 7 + len(name)) % 5 - 2)
        return (reference_ms if name not in ("candidate", "candidate_bb") else reference_ms / speedup) * jitter

    return TimingConfig(warmup_s=0.0, min_warmup_calls=1, min_reps=30, min_time_s=0.0, budget_s=budget_s,
                        script=script)


@pytest.fixture
def write(tmp_path):
    """write("name.py", source) -> path: a candidate or problem file, dedented."""

    def _write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source).lstrip())
        return path

    return _write


@pytest.fixture
def problem_path():
    return lambda name: FIXTURES / "problems" / f"{name}.py"


@pytest.fixture(scope="session")
def gpu_ceilings():
    """The GPU's measured ceilings, measured once per test session."""
    from kforge.harness.roofline import measure_ceilings

    return measure_ceilings(current_device("cuda"))


@pytest.fixture
def nan_outputs(monkeypatch):
    """For the test's duration, torch.empty and torch.empty_like hand out floating-point
    tensors filled with NaN (integer ones as they come): an output element a kernel forgets
    to write shows instead of passing as leftover zeros or stale values."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:  # (not the leaves autograd tracks: torch.compile makes some)
        return t.fill_(float("nan")) if t.is_floating_point() and not t.requires_grad else t

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(empty_like(*args, **kwargs)))


# --- the tiny Llama checkpoint of tests/models: Hugging Face's own model, saved by
# `save_pretrained` into a temporary directory (no download) ---------------------------------

def hf_config():
    """transformers' LlamaConfig of the tiny preset."""
    transformers = pytest.importorskip("transformers")
    from kforge.models.llama import preset
    from kforge.models.llama.export import to_hf_config

    return transformers.LlamaConfig(**to_hf_config(preset("tiny")))


def save_tiny_checkpoint(folder):
    """A random tiny LlamaForCausalLM saved in `folder`; returns the Hugging Face model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config()).eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded into the wrong place shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """(folder, the Hugging Face model) of the tiny Llama checkpoint."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_tiny_checkpoint(folder)


@pytest.fixture(scope="module")
def one_thread():
    """Tensors of a few KB: threads only add waiting, and a shared CPU makes it 40x slower.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
