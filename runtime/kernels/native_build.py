"""Builds and loads the native CPU kernels: csrc/cpu_native.c (the C core) and csrc/ops.cpp (the torch operators
over it, `tandem::...`), compiled on first use into one library and loaded with torch.ops.load_library.

The library is built for the CPU it runs on (`-march=native` on x86, `-mcpu=native` on ARM), so it is cached
under a key of the sources, the flags, the torch version and this CPU's instruction-set features, in
~/.cache/tandem/native (TANDEM_CACHE_DIR moves it). A home directory shared by machines of different CPU
generations then holds one library per generation, and each library records the features it was built for:
one whose features this CPU lacks is never loaded (it would die on an illegal instruction). A cached library
loads without a compiler (a container image with a warm cache).

Without a C and a C++ compiler, or where the build fails, the kernels' torch references run instead, with one
warning that says so (the compiler's own message included); TANDEM_CPU_NATIVE=0 chooses the references
silently. A build takes 10-20 s on two cores, once per machine and version.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger("tandem")
ENV_VAR = "TANDEM_CPU_NATIVE"
SOURCES = Path(__file__).with_name("csrc")
C_SOURCE, CXX_SOURCE, HEADER = SOURCES / "cpu_native.c", SOURCES / "ops.cpp", SOURCES / "tandem_cpu.h"
QUANT_SOURCE = SOURCES / "quant.c"  # the quantized linears' kernels (C, built beside the core)
QUANT_X16_SOURCE = SOURCES / "quant_x16.c"  # int4 linears against integer activations (C, built beside the core)
LORA_SOURCE = SOURCES / "lora.c"  # batched LoRA (C, built beside the core)
BF16_HEADER = SOURCES / "bf16.h"  # bfloat16 loads and stores, included by the C files
PANEL_HEADER = SOURCES / "panel.h"  # the bfloat16 panel GEMM's steps, included by cpu_native.c and quant.c
# What runs on the references when the library is missing: the warning names it.
LOST = ("the Mamba state updates, scans and convs, the norms, SiLU, rotary, decode attention and the "
        "small-batch linears run on their torch references (several times slower)")
# The x86 features a build with -march=native can use; on ARM every listed feature counts.
_X86_FEATURES = re.compile(r"^(sse\S*|ssse3|avx\S*|amx\S*|fma|f16c|bmi\d|popcnt|movbe|gfni|vaes|vpclmulqdq)$")


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no")


@functools.cache
def load() -> bool:
    """Build (or find) the library for this CPU and load its operators; False, with a warning, where it
    cannot be had here."""
    features = cpu_features()
    path = library_path(features)
    if not usable(path, features):
        compilers = _compilers()
        if compilers is None:
            logger.warning("no C/C++ compiler found (cc and c++, or $CC and $CXX): %s; install gcc and g++ to "
                           "build the native CPU kernels", LOST)
            return False
        try:
            _build(path, features, *compilers)
        except _BuildFailed as err:
            logger.warning("the native CPU kernels did not build: %s; %s.\n%s", err.command, LOST, err.output)
            return False
    torch.ops.load_library(str(path))
    return True


def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set features, as Linux reports them (x86 `flags`, ARM `Features`); the machine
    name alone elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset([platform.machine()])
    match = re.search(r"^(flags|Features)\s*:(.*)$", text, re.MULTILINE)
    words = match.group(2).split() if match else []
    if match and match.group(1) == "flags":
        words = [w for w in words if _X86_FEATURES.match(w)]
    return frozenset([platform.machine(), *words])


def flags() -> tuple[list[str], list[str]]:
    """The C core's and the C++ layer's compiler flags, for this architecture."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        # 512-bit vectors in GCC's own loops too where the CPU has them (GCC's tuning for recent Intel CPUs
        # prefers 256): a 512-bit load of what 256-bit stores just wrote is not forwarded from the store
        # buffer, and stalled the SiLU after the prefill conv (conv 3.2 -> 1.9 ms for 2,048 tokens).
        native = ["-march=native", "-mprefer-vector-width=512"]
    elif machine in ("aarch64", "arm64"):
        native = ["-mcpu=native"]
    else:
        native = []
    common = ["-fPIC", "-fopenmp"]
    c_flags = ["-O3", *native, "-ffp-contract=fast", "-std=c11", *common]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cxx_flags = ["-O2", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *common,
                 *(f"-I{p}" for p in _torch_includes())]
    return c_flags, cxx_flags


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem") / "native"


def library_path(features: frozenset[str]) -> Path:
    """Where the library for a CPU of these features lies (or will)."""
    c_flags, cxx_flags = flags()
    key = hashlib.sha256()
    for source in (C_SOURCE, QUANT_SOURCE, QUANT_X16_SOURCE, CXX_SOURCE, HEADER, LORA_SOURCE, BF16_HEADER,
                   PANEL_HEADER):
        key.update(source.read_bytes())
    key.update(" ".join([*c_flags, *cxx_flags, torch.__version__, *sorted(features)]).encode())
    return cache_dir() / f"libtandem_cpu-{key.hexdigest()[:16]}.so"


def usable(path: Path, features: frozenset[str]) -> bool:
    """The library at `path` exists and was built for a CPU whose features this one has."""
    try:
        manifest = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return False
    return path.exists() and set(manifest.get("features", ())) <= features


class _BuildFailed(Exception):
    def __init__(self, command: list[str], output: str):
        super().__init__(" ".join(command))
        self.command, self.output = " ".join(command), output.strip()


def _compilers() -> tuple[str, str] | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    return (cc, cxx) if cc and cxx else None


def _torch_includes() -> list[str]:
    include = Path(torch.__file__).parent / "include"
    return [str(include), str(include / "torch" / "csrc" / "api" / "include")]


def _build(target: Path, features: frozenset[str], cc: str, cxx: str) -> None:
    """Compile the library for a CPU of these features into `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    c_flags, cxx_flags = flags()
    torch_lib = Path(torch.__file__).parent / "lib"
    # Built under a temporary name and renamed: a concurrent process never loads a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        core, quant, ops, built = (Path(scratch) / name for name in ("core.o", "quant.o", "ops.o", target.name))
        lora, quant_x16 = Path(scratch) / "lora.o", Path(scratch) / "quant_x16.o"
        _run_all([[cc, *c_flags, "-c", str(C_SOURCE), "-o", str(core)],
                  [cc, *c_flags, "-c", str(QUANT_SOURCE), "-o", str(quant)],
                  [cc, *c_flags, "-c", str(LORA_SOURCE), "-o", str(lora)],
                  [cc, *c_flags, "-c", str(QUANT_X16_SOURCE), "-o", str(quant_x16)],
                  [cxx, *cxx_flags, "-c", str(CXX_SOURCE), "-o", str(ops)]])
        _run_all([[cxx, "-shared", "-fopenmp", str(core), str(quant), str(quant_x16), str(lora), str(ops), "-o",
                   str(built), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}", "-lm"]])
        manifest = dict(features=sorted(features), torch=torch.__version__, compilers=[cc, cxx],
                        python=sys.version.split()[0])
        Path(scratch, "manifest.json").write_text(json.dumps(manifest, indent=1))
        os.replace(Path(scratch, "manifest.json"), target.with_suffix(".json"))
        os.replace(built, target)


def _run_all(commands: list[list[str]]) -> None:
    """Run the commands side by side (two cores compile the C core and the C++ layer at once)."""
    try:
        running = [(command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True)) for command in commands]
    except OSError as err:
        raise _BuildFailed(commands[0], str(err)) from err
    failures = []
    for command, process in running:
        output, _ = process.communicate()
        if process.returncode != 0:
            failures.append(_BuildFailed(command, output[-4000:]))
    if failures:
        raise failures[0]
