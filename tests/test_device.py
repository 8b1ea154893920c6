from kforge.device import current_device, library_versions


def test_the_cpu_describes_itself(cpu):
    assert cpu.kind == "cpu" and not cpu.is_cuda and cpu.name
    assert cpu.torch_device.type == "cpu"
    assert cpu.slug and all(c.isalnum() or c == "-" for c in cpu.slug)


def test_an_unknown_kind_is_refused():
    import pytest

    with pytest.raises(ValueError):
        current_device("tpu")


def test_versions_name_the_libraries_that_change_results():
    versions = library_versions()
    assert {"kforge", "python", "torch", "numpy", "triton"} <= set(versions)


def test_sm_count_reads_a_device_once_and_resolves_the_current_one(monkeypatch):
    import types

    import pytest
    import torch

    from kforge import device

    asked = []

    def properties(index):
        asked.append(index)
        return types.SimpleNamespace(multi_processor_count=100 + index)

    device._sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    try:
        assert device.sm_count(torch.device("cuda", 0)) == 100
        assert device.sm_count(torch.device("cuda")) == 101  # no index: the current device
        assert device.sm_count(1) == 101 and device.sm_count(torch.device("cuda", 0)) == 100
        assert asked == [0, 1], "each device's properties are read once"
        with pytest.raises(ValueError, match="needs a CUDA device"):
            device.sm_count(torch.device("cpu"))
    finally:
        device._sm_count.cache_clear()  # no made-up count outlives the test
