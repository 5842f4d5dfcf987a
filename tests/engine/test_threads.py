"""The CPU thread count: the option, its environment variable and its default reach torch's thread pool."""

import argparse
import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime import LLM
from runtime.config import MIN_THREADED_HIDDEN, EngineConfig, default_threads, usable_cores
from runtime.hf_config import ConfigError
from runtime.llm import DEFAULT_MODEL
from runtime.options import add_config_options, config_kwargs

ROOT = Path(__file__).parents[2]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_option_sets_torch_threads(restore_threads, threads):
    torch.set_num_threads(3)
    LLM(threads=threads, max_model_len=64)
    assert torch.get_num_threads() == threads


def test_environment_variable_sets_threads(restore_threads, monkeypatch):
    monkeypatch.setenv("TANDEM_NUM_THREADS", "2")
    torch.set_num_threads(1)
    LLM(max_model_len=64)
    assert torch.get_num_threads() == 2
    # The option wins over the environment.
    assert EngineConfig(str(DEFAULT_MODEL), threads=1).derived_threads == 1


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_environment_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("TANDEM_NUM_THREADS", value)
    with pytest.raises(ConfigError, match="TANDEM_NUM_THREADS"):
        EngineConfig(str(DEFAULT_MODEL)).derived_threads


def test_bad_option_value_is_refused():
    with pytest.raises(ConfigError, match="threads must be a positive integer"):
        EngineConfig(str(DEFAULT_MODEL), threads=0)


def test_default_follows_omp_num_threads_when_set(monkeypatch):
    monkeypatch.delenv("TANDEM_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert EngineConfig(str(DEFAULT_MODEL)).derived_threads is None  # torch's own count stays
    monkeypatch.delenv("OMP_NUM_THREADS")
    # The shipped model is narrow: one thread, which does not stall when another process takes a core.
    assert EngineConfig(str(DEFAULT_MODEL)).derived_threads == 1


def test_default_uses_every_core_for_wide_models():
    wide = MIN_THREADED_HIDDEN
    assert default_threads(wide, cores=8) == 8
    assert default_threads(wide, cores=1) == 1
    assert default_threads(wide - 1, cores=8) == 1  # narrow: one thread even with cores to spare
    assert usable_cores() >= 1


def test_command_line_option_maps_to_the_field():
    parser = argparse.ArgumentParser()
    add_config_options(parser, EngineConfig)
    assert config_kwargs(parser.parse_args(["--threads", "3"]), EngineConfig) == {"threads": 3}
    assert config_kwargs(parser.parse_args([]), EngineConfig) == {}


def test_importing_tandem_first_bounds_how_long_openmp_threads_spin(tmp_path):
    """Set before torch loads libgomp, unless the user chose a wait policy or a spin count."""
    probe = "import os, runtime, torch; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = functools.partial(subprocess.run, [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run(env=env).stdout.split() == ["10000", "None"]
    assert run(env={**env, "OMP_WAIT_POLICY": "PASSIVE"}).stdout.split() == ["None", "PASSIVE"]
    assert run(env={**env, "GOMP_SPINCOUNT": "0"}).stdout.split() == ["0", "None"]
