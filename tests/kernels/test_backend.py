"""The kernel dispatcher: which backend an engine gets, the override, and the binding of the ops."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import runtime.kernels as kernels
from runtime.hf_config import ConfigError
from runtime.kernels import cpu_native
from runtime.kernels.paged_attention import paged_attention_triton

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BAMBA_CONFIG = Path(__file__).parents[2] / "docs" / "configs" / "ibm-ai-platform__Bamba-9B"


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)


def test_auto_picks_triton_for_cuda_and_the_references_elsewhere():
    assert kernels.resolve_backend("auto", CUDA) == "triton"
    assert kernels.resolve_backend("auto", CPU) == "torch"
    assert kernels.resolve_backend("torch", CUDA) == "torch"


def test_the_environment_overrides_auto_only(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.resolve_backend("auto", CUDA) == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "Triton")
    assert kernels.resolve_backend("auto", CPU) == "triton"  # the interpreter is on in the tests
    assert kernels.resolve_backend("torch", CPU) == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ConfigError, match=kernels.ENV_VAR):
        kernels.resolve_backend("auto", CPU)


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        kernels.resolve_backend("triton", CPU)
    assert kernels.resolve_backend("triton", CUDA) == "triton"


def test_bind_rebinds_every_op():
    try:
        assert kernels.bind("triton", torch.device("cpu")) == "triton"
        assert kernels.paged_attention is paged_attention_triton and kernels.backend == "triton"
        assert all(getattr(kernels, op) is impl[1] for op, impl in kernels.IMPLEMENTATIONS.items())
    finally:
        kernels.bind("torch", torch.device("cpu"))
    # On a CPU, the ops with a native kernel run it where the library builds; the others their references.
    native = kernels.NATIVE if cpu_native.available() else {}
    assert all(getattr(kernels, op) is native.get(op, impl[0]) for op, impl in kernels.IMPLEMENTATIONS.items())


def test_the_config_refuses_an_unknown_backend():
    from runtime.config import EngineConfig

    with pytest.raises(ConfigError, match="kernel_backend"):
        EngineConfig(model=str(BAMBA_CONFIG), kernel_backend="cuda")


def test_declarations_and_plan_do_not_import_triton():
    code = "import sys, runtime, runtime.config, runtime.plan; print('triton' in sys.modules, 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
