"""The command line as a newcomer meets it: --version, help, one spelling per option, one-line errors.

Everything here runs `tandem` (as `python -m runtime`) in a subprocess, or reads the parser it builds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.cli import SUBCOMMANDS, build_parser
from runtime.config import EngineConfig
from runtime.options import OPTION, flag_of

ROOT = Path(__file__).parents[2]
BAMBA = ROOT / "docs/configs/ibm-ai-platform__Bamba-9B"
ENGINE_COMMANDS = ("plan", "generate", "serve", "chat")


def tandem(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, **kwargs)


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(only=name)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_version():
    result = tandem("--version")
    assert result.returncode == 0 and result.stdout.strip().startswith("tandem 0."), result.stdout


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_help_has_a_description_examples_and_help_for_each_option(name):
    parser = subparser(name)
    assert parser.description and len(parser.description) > 40
    assert parser.epilog.startswith("examples:") and f"tandem {name}" in parser.epilog
    for action in parser._actions:
        assert action.help, f"tandem {name}: {action.option_strings or action.dest} has no help text"
    result = tandem(name, "--help")
    assert result.returncode == 0 and "examples:" in result.stdout


def test_the_top_level_help_has_examples():
    result = tandem("--help")
    assert result.returncode == 0 and "examples:" in result.stdout and "tandem chat" in result.stdout


def engine_flags(name: str) -> dict[str, tuple[str, ...]]:
    parser = subparser(name)
    fields = {f.name for f in dataclasses.fields(EngineConfig) if OPTION in f.metadata}
    return {a.dest: tuple(a.option_strings) for a in parser._actions
            if a.dest in fields and a.option_strings and a.help != argparse.SUPPRESS}


def test_every_engine_option_is_spelled_once_the_same_in_every_subcommand():
    declared = {f.name: flag_of(f, f.metadata[OPTION]) for f in dataclasses.fields(EngineConfig)
                if OPTION in f.metadata}
    assert {"kv_cache_memory", "device", "kernel_backend", "max_model_len"} <= set(declared)
    assert all(flag == "--" + name.replace("_", "-") for name, flag in declared.items())
    flags = {name: engine_flags(name) for name in ENGINE_COMMANDS}
    for name, found in flags.items():
        wanted = set(PLAN_OPTIONS) if name == "plan" else set(declared)
        assert set(found) == wanted, f"tandem {name}: {set(found) ^ wanted}"
        for dest, spelling in found.items():
            assert spelling[0] == declared[dest], (name, dest, spelling)
    assert len({json.dumps(found, sort_keys=True) for name, found in flags.items() if name != "plan"}) == 1
    assert flags["plan"] == {dest: spelling for dest, spelling in flags["generate"].items() if dest in PLAN_OPTIONS}


# The options that change what `tandem plan` prints; the others (--seed, --threads, ...) only change a run.
PLAN_OPTIONS = ("dtype", "tensor_parallel_size", "pipeline_parallel_size", "block_size", "enable_prefix_caching",
                "mamba_ssm_dtype", "max_model_len", "kv_cache_memory", "speculative_config", "enable_lora", "max_loras",
                "max_lora_rank", "quantization")


def test_plan_lists_only_options_that_change_a_plan_with_help_that_fits_it():
    result = tandem("plan", "--help")
    assert result.returncode == 0
    for flag in ("--seed", "--threads", "--kernel-backend", "--enforce-eager", "--max-logprobs", "--device",
                 "--num-pages", "--max-num-seqs"):
        assert flag not in result.stdout, flag
    assert "this command starts them" not in result.stdout
    assert "the plan shows one rank's cache shapes" in " ".join(result.stdout.split())
    assert_one_line_error(tandem("plan", str(BAMBA), "--seed", "1"), "unrecognized arguments: --seed 1")


def test_llm_takes_the_same_names_as_keywords(tiny_checkpoint):
    from runtime.llm import LLM

    with pytest.raises(TypeError, match="takes EngineConfig's: .*kv_cache_memory, mamba_ssm_dtype"):
        LLM(kv_cache_memory_bytes=1)
    directory = tiny_checkpoint("bamba")[0]
    # The page pool's size as the command line writes it, or in bytes: the same pool.
    as_text = LLM(directory, dtype="float32", device="cpu", kv_cache_memory="1MiB").engine.runner.num_pages
    assert as_text == LLM(directory, dtype="float32", device="cpu", kv_cache_memory=2**20).engine.runner.num_pages
    assert EngineConfig(str(directory), kv_cache_memory="8GiB").kv_cache_memory == 8 * 2**30
    with pytest.raises(ValueError, match="kv_cache_memory: invalid size 'lots'; write it like 8GiB"):
        EngineConfig(str(directory), kv_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive integer, got 0"):
        EngineConfig(str(directory), kv_cache_memory=0)


BAD_OPTIONS = [
    (["--device", "gpu"], "invalid choice: 'gpu'"),
    (["--kernel-backend", "cuda"], "invalid choice: 'cuda'"),
    (["--kv-cache-memory", "0"], "invalid size '0'"),
    (["--kv-cache-memory", "lots"], "invalid size 'lots'"),
    (["--max-num-seqs", "0"], "must be a positive integer"),
    (["--block-size", "x"], "invalid integer 'x'"),
    (["--dtype", "int3"], "int3"),
    (["--mamba-ssm-dtype", "float8"], "float8"),
    (["--no-such-option"], "tandem plan: error: unrecognized arguments: --no-such-option (see `tandem plan --help`)"),
]


@pytest.mark.parametrize("args, fragment", BAD_OPTIONS)
def test_a_bad_option_is_one_line_and_exit_2(args, fragment):
    # An option that changes no plan is not plan's: generate checks it, before it loads anything.
    known_to_plan = args[0] in subparser("plan")._option_string_actions or args[0] == "--no-such-option"
    command = ["plan", str(BAMBA)] if known_to_plan else ["generate", "hi"]
    assert_one_line_error(tandem(*command, *args), fragment)


# The options are the same objects in every subcommand; these check that the engine commands,
# which import torch, fail as early and as briefly (a value checked by the parser, one by the config).
@pytest.mark.parametrize("args, fragment", [BAD_OPTIONS[0], BAD_OPTIONS[6]])
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_bad_option_of_an_engine_command_is_one_line_and_exit_2(command, args, fragment):
    assert_one_line_error(tandem(command, *args, input="hi\n"), fragment)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_an_unknown_option_points_to_the_subcommands_help(command):
    assert_one_line_error(tandem(command, "--no-such-option", input="hi\n"),
                          f"tandem {command}: error: unrecognized arguments: --no-such-option "
                          f"(see `tandem {command} --help`)")


def test_serve_defaults_to_the_shipped_model_as_generate_and_chat_do():
    from runtime.config import DEFAULT_MODEL

    # A block size the shipped model refuses: the error proves which model serve resolved, before it listens.
    smallest = EngineConfig(str(DEFAULT_MODEL)).cache.block_size
    assert_one_line_error(tandem("serve", "--block-size", "8"), "--block-size 8 is invalid",
                          f"the smallest valid value is {smallest}")
    assert "default: the small model shipped with Tandem" in " ".join(tandem("serve", "--help").stdout.split())


def test_the_threads_help_says_what_the_default_is():
    from runtime.config import MIN_THREADED_HIDDEN, default_threads, usable_cores

    shown = " ".join(tandem("generate", "--help").stdout.split())
    assert "else every core this process may run on, shared among tensor-parallel ranks, for models of hidden size " \
           f"{MIN_THREADED_HIDDEN} or more, and one thread for narrower ones" in shown
    assert "idle" not in shown
    # ... which is what the code does, whatever else runs on the machine.
    assert default_threads(MIN_THREADED_HIDDEN, usable_cores()) == len(os.sched_getaffinity(0))
    assert default_threads(MIN_THREADED_HIDDEN - 1, usable_cores()) == 1


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA, so --device cuda works")
def test_device_cuda_without_cuda_is_one_line_and_exit_2():
    assert_one_line_error(tandem("generate", "--device", "cuda", "hi"), "no CUDA device", "--device cpu")


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA, so a CUDA engine does not fail")
def test_device_cuda_without_cuda_in_llm_names_the_keyword():
    from runtime.llm import LLM

    with pytest.raises(ValueError, match="no CUDA device is available here; use device='cpu' \\(or auto\\)"):
        LLM(device="cuda")


LONG_PROMPT = "The page pool holds the attention pages and the Mamba states of every running sequence"
# (command-line arguments, what the error says there, what LLM(...) says for the same keywords)
ENGINE_ERRORS = [
    (["--max-model-len", "100000000"],
     "--max-model-len 100000000 is more than the model was built for (max_position_embeddings=2048 in config.json); "
     "pass --max-model-len 2048 or less",
     "max_model_len=100000000 is more than the model was built for (max_position_embeddings=2048 in config.json); "
     "pass max_model_len=2048 or less"),
    (["--num-pages", "1", "--max-model-len", "64"],
     "the page pool (1 page) cannot hold one sequence of 64 tokens (--max-model-len 64), which needs 3 pages: "
     "raise --kv-cache-memory or --num-pages",
     "the page pool (1 page) cannot hold one sequence of 64 tokens (max_model_len=64), which needs 3 pages: "
     "raise kv_cache_memory or num_pages"),
    (["--max-model-len", "8"],
     "more than fits in --max-model-len 8 with room for one new token; shorten the prompt or raise --max-model-len",
     "more than fits in max_model_len=8 with room for one new token; shorten the prompt or raise max_model_len"),
]


@pytest.mark.parametrize("args, on_the_command_line, in_llm", ENGINE_ERRORS, ids=["max-model-len", "pool", "prompt"])
def test_an_engine_error_names_options_as_the_user_wrote_them(args, on_the_command_line, in_llm):
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    result = tandem("generate", LONG_PROMPT, "--max-tokens", "1", *args)
    assert_one_line_error(result, on_the_command_line)
    assert result.stdout == "", "the prompt was printed before the error"
    keywords = {args[i][2:].replace("-", "_"): int(args[i + 1]) for i in range(0, len(args), 2)}
    with pytest.raises(ValueError) as refused:
        LLM(**keywords).generate([LONG_PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)
    assert in_llm in str(refused.value)


@pytest.mark.skipif(cuda_available(), reason="this machine has CUDA, so a CUDA engine does not fail")
def test_a_failed_cuda_engine_leaves_an_earlier_cpu_engine_working(tiny_checkpoint):
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    directory = tiny_checkpoint("bamba")[0]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    cpu = LLM(directory, dtype="float32", device="cpu")
    before = cpu.generate(["The page"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="no CUDA device"):
        LLM(directory, dtype="float32", device="cuda")
    after = cpu.generate(["The page"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_plan_with_no_memory_is_an_error_not_zero_sequences():
    assert_one_line_error(tandem("plan", str(BAMBA), "--kv-cache-memory", "0", "--max-model-len", "4096"),
                          "invalid size '0'")


def test_plan_with_a_tiny_pool_names_the_memory_it_needs():
    result = tandem("plan", str(BAMBA), "--dtype", "bfloat16", "--kv-cache-memory", "1MiB", "--max-model-len", "4096")
    assert_one_line_error(result, "holds 0 page ids", "raise --kv-cache-memory to at least")
    assert "-" not in result.stderr.split("lower")[-1] or "lower" not in result.stderr
    assert "sequences fit" not in result.stdout


def test_plan_with_a_small_pool_suggests_a_positive_max_model_len():
    result = tandem("plan", str(BAMBA), "--dtype", "bfloat16", "--kv-cache-memory", "80MiB",
                    "--max-model-len", "4096")
    assert_one_line_error(result, "raise --kv-cache-memory to at least", "lower --max-model-len to ")
    suggested = int(result.stderr.split("lower --max-model-len to ")[1].split()[0].replace(",", ""))
    assert 0 < suggested < 4096


def test_plan_says_one_kv_head_one_sequence_and_one_page_id_in_the_singular():
    shown = json.loads(tandem("plan", str(BAMBA), "--tp", "8", "--json", "--kv-cache-memory", "1GiB",
                              "--max-model-len", "4096").stdout)
    one_sequence = shown["fit"]["pages_per_sequence"] * shown["bytes_per_page_id"]
    result = tandem("plan", str(BAMBA), "--tp", "8", "--kv-cache-memory", str(one_sequence), "--max-model-len", "4096")
    assert result.returncode == 0, result.stderr
    assert "attention      1 KV head x 128 per rank" in result.stdout
    assert ": 1 sequence fits" in result.stdout.splitlines()[-1]
    assert "KV heads" not in result.stdout and "1 sequences" not in result.stdout
    assert "1 page id," in tandem("plan", str(BAMBA), "--tp", "8", "--kv-cache-memory", str(shown["bytes_per_page_id"]),
                                  "--max-model-len", "4096").stderr


def test_plan_says_which_dtype_it_assumed():
    # Bamba-9B's published config.json names no dtype; Falcon-H1's names bfloat16.
    assert "dtype" not in json.loads((BAMBA / "config.json").read_text())
    result = tandem("plan", str(BAMBA))
    assert result.returncode == 0, result.stderr
    assert "float32 (assumed: config.json names no dtype; pass --dtype)" in result.stdout
    assert json.loads(tandem("plan", str(BAMBA), "--json").stdout)["dtype_source"] == "assumed"
    assert "assumed" not in tandem("plan", str(BAMBA), "--dtype", "bfloat16").stdout
    named = tandem("plan", str(ROOT / "docs/configs/tiiuae__Falcon-H1-0.5B-Instruct"))
    assert "bfloat16" in named.stdout and "assumed" not in named.stdout


def planned_configs(folder: Path = ROOT / "docs/configs") -> list[Path]:
    """The kept configs whose architecture the engine cannot run yet."""
    from runtime.hf_config import architecture_of, load_raw_config
    from runtime.models import resolve
    from runtime.models.interface import Status

    return [d for d in sorted(folder.iterdir()) if (d / "config.json").is_file()
            and resolve(architecture_of(load_raw_config(d))).capabilities.engine.status
            not in (Status.SUPPORTED, Status.PARTIAL)]


# transformers 5.24's MiniMaxConfig defaults, saved with save_pretrained, at a small size (hidden_size=64, 4 layers,
# 4 heads of 16 with 2 KV heads, 4 experts, vocab 128): every published config in docs/configs/ now runs on the
# engine, and MiniMax is planned.
MINIMAX_TINY = ROOT / "tests/runtime/configs/minimax_tiny"


def test_plan_on_a_planned_architecture_says_it_cannot_run_yet():
    planned = [*planned_configs(), MINIMAX_TINY]
    assert MINIMAX_TINY in planned_configs(MINIMAX_TINY.parent), "MiniMax runs now: keep a planned family's config here"
    for config in planned:
        result = tandem("plan", str(config))
        assert result.returncode == 0, result.stderr
        assert "planned: cannot run on the engine yet" in result.stdout.splitlines()[1]
    assert "cannot run" not in tandem("plan", str(BAMBA)).stdout


def test_a_closed_pipe_is_quiet():
    """`tandem plan ... | head -1` where the reader has gone before tandem writes."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([sys.executable, "-m", "runtime", "plan", str(BAMBA)], cwd=ROOT, stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert result.stderr == "", result.stderr
    assert result.returncode == 141


def test_a_closed_pipe_through_head_prints_no_traceback():
    result = subprocess.run(f"{sys.executable} -m runtime plan {BAMBA} | head -1", shell=True, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.stdout.startswith("architecture") and result.stdout.count("\n") == 1
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr


def test_an_engine_that_fails_to_start_leaves_earlier_engines_their_kernels(tiny_checkpoint):
    """The kernel binding is per process: a second engine binds Triton, then fails (its pool holds no
    sequence). The first engine must still run on its torch kernels, with the same tokens."""
    from runtime import kernels
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    directory = tiny_checkpoint("bamba")[0]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    first = LLM(directory, dtype="float32", device="cpu", kernel_backend="torch")
    before = first.generate(["The page"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(directory, dtype="float32", device="cpu", kernel_backend="triton", num_pages=1, max_model_len=64)
    assert kernels.backend == "torch"
    assert kernels.paged_attention in (kernels.paged_attention_ref, kernels.NATIVE["paged_attention"])
    after = first.generate(["The page"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
