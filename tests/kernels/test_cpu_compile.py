"""The compiled CPU path computes what the eager references compute."""

import pytest
import torch

from runtime.kernels import cpu_compile
from runtime.kernels.ssm_state_update import selective_state_update_ref


@pytest.fixture
def compiled(monkeypatch):
    monkeypatch.setenv(cpu_compile.ENV_VAR, "1")
    assert cpu_compile.enable(True)
    assert cpu_compile.works(), "torch.compile must work on the CI machine"
    yield
    cpu_compile.enable(False)


def ssu_inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    S, H, P, N, G = 5, 4, 8, 16, 2
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    states = r(12, H, P, N)
    return states, r(S, H, P), r(S, H), -torch.rand(H, generator=g), r(S, G, N), r(S, G, N), r(H), r(H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slots", [[7, 2, 9, 0, 4], [7, -1, 9, 0, -1]])
def test_compiled_state_update_equals_eager(compiled, dtype, slots):
    states, x, dt, A, B, C, D, dt_bias = ssu_inputs(dtype)
    slots = torch.tensor(slots)
    eager_states = states.clone()
    cpu_compile.enable(False)
    eager = selective_state_update_ref(eager_states, x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), slots,
                                       torch.empty_like(x))
    cpu_compile.enable(True)
    fused = selective_state_update_ref(states, x, dt, A, B, C, D, dt_bias, (0.0, float("inf")), slots,
                                       torch.empty_like(x))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused, eager, **tol)
    torch.testing.assert_close(states, eager_states, **tol)


def test_an_engine_with_compiled_kernels_gives_the_eager_tokens(compiled, tiny_checkpoint, monkeypatch):
    from runtime import LLM, SamplingParams

    # Tiny states never pay for compiling; make this one compile anyway.
    monkeypatch.setattr("runtime.runner.COMPILE_MIN_STATE_BYTES", 0)
    prompts = ["The", "A hybrid model mixes attention with state-space layers and the page pool holds"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    directory = tiny_checkpoint("bamba")[0]
    fused = [o.outputs[0].token_ids for o in LLM(directory, dtype="float32").generate(prompts, params, use_tqdm=False)]
    assert cpu_compile._enabled
    monkeypatch.setenv(cpu_compile.ENV_VAR, "0")
    eager_llm = LLM(directory, dtype="float32")
    assert not cpu_compile._enabled
    eager = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params, use_tqdm=False)]
    assert fused == eager


def test_the_environment_switch_keeps_the_references_eager(monkeypatch):
    monkeypatch.setenv(cpu_compile.ENV_VAR, "0")
    assert not cpu_compile.enable(True)


def test_compiling_is_kept_for_states_large_enough_to_pay(tiny_checkpoint):
    from pathlib import Path

    from runtime.config import EngineConfig
    from runtime.runner import compile_pays

    configs = Path(__file__).parents[2] / "docs" / "configs"
    assert not compile_pays(EngineConfig(str(tiny_checkpoint("bamba")[0])).cache)
    assert compile_pays(EngineConfig(str(configs / "ibm-ai-platform__Bamba-9B")).cache)
    assert not compile_pays(EngineConfig(str(configs / "meta-llama__Llama-3.2-1B")).cache)


def test_a_cpu_engine_imports_neither_the_compiler_nor_triton(tiny_checkpoint):
    """torch.compile's import (torch._dynamo, 145 MiB resident) waits for a fused core to run, and with the native
    kernels bound none does; Triton (71 MiB) is imported only where its kernels can run (a GPU, or its interpreter).
    In a fresh process without TRITON_INTERPRET, since the suite's own process imports both."""
    import os
    import subprocess
    import sys

    from runtime.kernels import cpu_native

    if not cpu_native.available():
        pytest.skip("the native kernels are not built here")
    directory = tiny_checkpoint("bamba")[0]
    script = (
        "import sys\n"
        "from runtime import LLM, SamplingParams\n"
        f"llm = LLM({str(directory)!r}, dtype='float32')\n"
        "llm.generate(['The hybrid', 'A'], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n"
        "print('torch._dynamo' in sys.modules, 'triton' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (cpu_compile.ENV_VAR, "TRITON_INTERPRET")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False False", out.stdout + out.stderr[-3000:]
