"""How the native CPU kernels' library is found, built and refused (runtime/kernels/native_build.py): a library
built for a CPU with more features is never loaded on one with fewer; without a compiler, or where the build
fails, the engine warns once and runs on the references."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from runtime.kernels import cpu_native, native_build


def run_python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with a cache directory of its own and the given environment."""
    environment = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache"), **env}
    for name in ("TANDEM_CPU_NATIVE", "CC", "CXX"):
        if name not in env:
            environment.pop(name, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environment, capture_output=True,
                          text=True, timeout=300)


def no_compilers(tmp_path) -> str:
    """A PATH with no C or C++ compiler on it."""
    empty = tmp_path / "bin"
    empty.mkdir(exist_ok=True)
    return str(empty)


@pytest.mark.skipif(not cpu_native.available(), reason="needs a built library to copy")
@pytest.mark.parametrize("fewer", [False, True])
def test_a_library_built_for_more_features_is_not_loaded(tmp_path, fewer):
    """The library built here, put in a fresh cache where a CPU without one of our features (simulated) would
    look for its own: that CPU does not load it (and, with no compiler, runs on the references); this CPU,
    with every feature the library was built for, loads it from the cache without a compiler."""
    built = native_build.library_path(native_build.cpu_features())
    dropped = sorted(native_build.cpu_features() - {"x86_64", "aarch64"})[-1]
    code = f"""
        from runtime.kernels import native_build, cpu_native
        import shutil, torch
        features = native_build.cpu_features() - ({{{dropped!r}}} if {fewer} else set())
        native_build.cpu_features = lambda: features
        target = native_build.library_path(features)
        target.parent.mkdir(parents=True)
        shutil.copy({str(built)!r}, target)
        shutil.copy({str(built.with_suffix('.json'))!r}, target.with_suffix('.json'))
        print(native_build.usable(target, features), cpu_native.available(), hasattr(torch.ops.tandem, 'gemv'))
    """
    result = run_python(code, tmp_path, PATH=no_compilers(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == (["False", "False", "False"] if fewer else ["True", "True", "True"])
    assert ("no C/C++ compiler found" in result.stderr) == fewer
    manifest = json.loads(built.with_suffix(".json").read_text())
    assert dropped in manifest["features"]


def test_without_a_compiler_the_engine_warns_once_and_runs_the_references(tmp_path):
    code = """
        from runtime import LLM, SamplingParams
        from runtime.kernels import cpu_native
        llm = LLM()
        print(cpu_native.available(), cpu_native.panel_dtypes(), cpu_native.amx_ready())
        out = llm.generate(["Tandem is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        print(len(out[0].outputs[0].token_ids))
    """
    result = run_python(code, tmp_path, PATH=no_compilers(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "()", "False", "4"]
    warnings = [line for line in result.stderr.splitlines() if "no C/C++ compiler found" in line]
    assert len(warnings) == 1 and "run on their torch references" in warnings[0]
    assert not (tmp_path / "cache" / "native").exists() or not any((tmp_path / "cache" / "native").iterdir())


def test_a_failed_build_logs_the_compilers_message_and_falls_back(tmp_path):
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'broken-cc: error: no such instruction: vfoo' >&2\nexit 1\n")
    compiler.chmod(0o755)
    code = """
        import logging
        logging.basicConfig()
        from runtime.kernels import cpu_native
        print(cpu_native.available(), cpu_native.available())
    """
    result = run_python(code, tmp_path, CC=str(compiler), CXX=str(compiler))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    assert result.stderr.count("the native CPU kernels did not build") == 1
    assert "broken-cc: error: no such instruction: vfoo" in result.stderr
    assert "run on their torch references" in result.stderr
    leftovers = list((tmp_path / "cache" / "native").iterdir())
    assert leftovers == [], leftovers  # no half-written library, no scratch directory


def test_switched_off_it_never_builds(tmp_path):
    result = run_python("from runtime.kernels import cpu_native; print(cpu_native.available())", tmp_path,
                        TANDEM_CPU_NATIVE="0")
    assert result.stdout.split() == ["False"] and not (tmp_path / "cache").exists()
    assert "compiler" not in result.stderr


@pytest.mark.parametrize("machine, present, absent", [
    ("x86_64", ["-march=native", "-mprefer-vector-width=512"], ["-mcpu=native"]),
    ("aarch64", ["-mcpu=native"], ["-march=native", "-mprefer-vector-width=512"]),
    ("riscv64", [], ["-march=native", "-mcpu=native", "-mprefer-vector-width=512"]),
])
def test_flags_are_chosen_per_architecture(monkeypatch, machine, present, absent):
    monkeypatch.setattr(native_build.platform, "machine", lambda: machine)
    c_flags, cxx_flags = native_build.flags()
    assert all(flag in c_flags for flag in present)
    assert not any(flag in c_flags + cxx_flags for flag in absent)
    assert "-fopenmp" in c_flags and "-std=c++20" in cxx_flags


def test_the_cache_key_follows_the_cpu_features():
    features = native_build.cpu_features()
    assert native_build.library_path(features) == native_build.library_path(frozenset(sorted(features)))
    # Toggle one feature, whether or not this CPU has it.
    assert native_build.library_path(features) != native_build.library_path(features ^ {"amx_tile"})


def test_cpu_features_are_instruction_sets_only():
    features = native_build.cpu_features()
    assert features  # the machine name at least
    assert not {"hypervisor", "constant_tsc", "fpu"} & features
    if shutil.which("cc") and "avx2" in open("/proc/cpuinfo").read():
        assert "avx2" in features
