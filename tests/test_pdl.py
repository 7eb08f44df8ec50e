"""kernels/pdl.py: which kernels launch as programmatic dependents (the choice, not the GPU
behaviour: tests/test_triton_compile.py checks the compiled kernels, test_kernels_linear.py the
launches on a GPU)."""
import pytest
import torch

pytest.importorskip("triton")
from graphexec.kernels import pdl  # noqa: E402


@pytest.mark.parametrize("value,mode", [("ALL", "all"), (" all ", "all"), ("off", "off")])
def test_mode_from_env(monkeypatch, value, mode):
    monkeypatch.setenv("GRAPHEXEC_PDL", value)
    assert pdl.mode_from_env() == mode


def test_default_is_all(monkeypatch):
    monkeypatch.delenv("GRAPHEXEC_PDL", raising=False)
    assert pdl.mode_from_env() == "all"


@pytest.mark.parametrize("value", ["sometimes", "projections", "1"])
def test_bad_mode_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("GRAPHEXEC_PDL", value)
    with pytest.raises(ValueError, match=f"GRAPHEXEC_PDL='{value}'"):
        pdl.mode_from_env()


@pytest.mark.parametrize("mode", pdl.MODES)
def test_never_on_cpu_tensors(monkeypatch, mode):
    monkeypatch.setattr(pdl, "mode", mode)
    x = torch.empty(2)
    assert not pdl.enabled(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.gpu
def test_modes_pick_kernels_on_the_gpu(monkeypatch):
    x = torch.empty(2, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9 and pdl.AVAILABLE
    monkeypatch.setattr(pdl, "mode", "all")
    assert pdl.enabled(x) == hopper
    monkeypatch.setattr(pdl, "mode", "off")
    assert not pdl.enabled(x)
