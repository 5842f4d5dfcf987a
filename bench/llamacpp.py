"""llama.cpp as a peer in bench/throughput.py (`--llamacpp PATH`, PATH its build or bin directory).

The benchmark's checkpoints are converted with llama.cpp's own `convert_hf_to_gguf.py` (run through
bench/llamacpp_convert.py, which fixes three things it gets wrong on our random checkpoints) to BF16 or F32,
and quantized from the BF16 file with `llama-quantize` (Q8_0, Q4_K_M); the files are cached next to the
checkpoint. One sequence runs `llama-bench` (prompt and generation as its two tests), a batch
`llama-batched-bench` (distinct prompts, its total time = prefill + output-length decode steps of the batch),
as ../shared/reference/peer-llamacpp.md ran them.

How llama.cpp was built (the vendored copy of the llama-cpp-python 0.3.36 sdist):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /work/llamacpp-src
    tar xzf /work/llamacpp-src/llama_cpp_python-0.3.36.tar.gz -C /work/llamacpp-src
    cp -a /work/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/. /work/llamacpp
    cd /work/llamacpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
    nice -n 10 cmake --build build -j2 --target llama-bench llama-batched-bench llama-quantize llama-cli
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
# Tandem's formats (--dtypes) and llama.cpp's counterparts: the quantized ones read about as many bytes.
FORMATS = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_K_M"}
CONVERTED = {"F32": "f32", "BF16": "bf16"}  # written by the converter; the others by llama-quantize from BF16


def source_dir(path: Path) -> Path:
    """The llama.cpp checkout above a build or bin directory: where convert_hf_to_gguf.py is."""
    for directory in [Path(path).absolute(), *Path(path).absolute().parents]:
        if (directory / "convert_hf_to_gguf.py").is_file():
            return directory
    raise ValueError(f"no convert_hf_to_gguf.py in {path} or above it: give --llamacpp a llama.cpp build or bin "
                     "directory inside its source tree")


def binary(path: Path, name: str) -> Path:
    for candidate in (Path(path) / name, Path(path) / "bin" / name):
        if candidate.is_file():
            return candidate
    raise ValueError(f"no {name} in {path} or {path}/bin: build it (cmake --build build --target {name})")


def gguf_path(checkpoint: Path, fmt: str) -> Path:
    """Next to the cached checkpoint directory."""
    return checkpoint.parent / f"{checkpoint.name}-{fmt}.gguf"


def convert(checkpoint: Path, fmt: str, llamacpp: Path) -> Path:
    """The checkpoint as a GGUF file of llama.cpp format `fmt` (F32, BF16, Q8_0, Q4_K_M), built once."""
    out = gguf_path(checkpoint, fmt)
    if out.is_file():
        return out
    partial = out.with_suffix(".partial")
    if fmt in CONVERTED:
        command = [sys.executable, str(HERE / "llamacpp_convert.py"), str(source_dir(llamacpp)), str(checkpoint),
                   "--outtype", CONVERTED[fmt], "--outfile", str(partial)]
    else:
        command = [str(binary(llamacpp, "llama-quantize")), str(convert(checkpoint, "BF16", llamacpp)), str(partial),
                   fmt]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"llama.cpp {fmt} conversion of {checkpoint} failed:\n{done.stderr[-3000:]}")
    partial.rename(out)
    return out


def run(model: Path, llamacpp: Path, num_prompts: int, input_len: int, output_len: int, threads: int) -> dict:
    """The figures every engine reports; peak memory is the llama.cpp process's own."""
    if num_prompts == 1:
        result = _single(model, llamacpp, input_len, output_len, threads)
    else:
        result = _batch(model, llamacpp, num_prompts, input_len, output_len, threads)
    return result


def _single(model: Path, llamacpp: Path, input_len: int, output_len: int, threads: int) -> dict:
    """llama-bench's prompt test (input_len tokens) and generation test (output_len tokens, one at a time);
    it warms up first. The table's total is the two together."""
    command = [str(binary(llamacpp, "llama-bench")), "-m", str(model), "-p", str(input_len), "-n", str(output_len),
               "-t", str(threads), "-r", "1", "-o", "json"]
    stdout, peak = _check(command)
    tests = json.loads(stdout)
    prompt = next(t for t in tests if t["n_prompt"] and not t["n_gen"])["avg_ns"] / 1e9
    generate = next(t for t in tests if t["n_gen"] and not t["n_prompt"])["avg_ns"] / 1e9
    return {"total_s": prompt + generate, "prefill_s": prompt, "step_s": generate / output_len,
            "generated_tokens": output_len, "peak_rss_mib": peak}


def _batch(model: Path, llamacpp: Path, num_prompts: int, input_len: int, output_len: int, threads: int) -> dict:
    """llama-batched-bench with distinct prompts (no -pps): t_pp the batch's prefill, t_tg its decode steps."""
    context = num_prompts * (input_len + output_len)
    command = [str(binary(llamacpp, "llama-batched-bench")), "-m", str(model), "-c", str(context), "-b", "2048",
               "-ub", "512", "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(num_prompts),
               "-t", str(threads), "--output-format", "jsonl"]
    stdout, peak = _check(command)
    row = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")][-1]
    return {"total_s": row["t"], "prefill_s": row["t_pp"], "step_s": row["t_tg"] / output_len,
            "generated_tokens": num_prompts * output_len, "peak_rss_mib": peak}


def _check(command: list[str]) -> tuple[str, float]:
    """The command's output and its peak resident memory in MiB. Not this interpreter's getrusage of its
    children: a child's ru_maxrss keeps across exec the size of the process it was forked from (this one, which
    floored every small model's figure). The command runs under PEAK_WRAPPER, a bare interpreter of ~10 MiB that
    forks it and reports its children's peak."""
    done = subprocess.run([sys.executable, "-S", "-c", PEAK_WRAPPER, *command], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    *_, last = done.stderr.splitlines() or [""]
    assert last.startswith("peak_kib "), done.stderr[-3000:]
    return done.stdout, int(last.split()[1]) / 1024


PEAK_WRAPPER = """
import os, resource, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status = os.waitpid(pid, 0)
sys.stderr.write("\\npeak_kib %d\\n" % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def weight_bytes_per_step(model: Path) -> int:
    """Every tensor of the GGUF file is read once per decode step, except the token embedding (one row per
    token) unless the output layer is tied to it."""
    import gguf  # the installed package reads every type llama-quantize writes

    reader = gguf.GGUFReader(model)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied)

