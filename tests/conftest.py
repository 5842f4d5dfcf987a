import os
import sys

# The tiny test models gain nothing from intra-op threads, and on a shared CPU every parallel
# op waits for a descheduled thread: the engine suite ran 4x slower with two threads than with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Engines in tests run the references eagerly: compiling them for every dtype and shape the
# suite meets would double its time. tests/kernels/test_cpu_compile.py checks the compiled path.
os.environ.setdefault("TANDEM_CPU_COMPILE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402  (after OMP_NUM_THREADS; importing torch does not import triton)

# Triton kernels run on CPU only through the interpreter, which triton reads from this variable when
# it is first imported (not yet: nothing above imports it). With a CUDA device the default test
# command compiles the kernels for it instead, so the compiled-kernel tests run too.
assert "triton" not in sys.modules, "triton was imported before the tests chose TRITON_INTERPRET"
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin, nothing calls it
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): one worker a core, at most 4. Each worker holds torch and its own
    tiny models, and the distributed and server tests start processes of their own beside it."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_collection_modifyitems(config, items):
    """The benchmarks' tests first; tests marked `gpu` need a CUDA device: without one they are skipped, not failed.

    A benchmark's test runs it for up to a minute and a half. Collected last (tests/test_bench_*.py), they left one
    worker of `-n auto` finishing them alone for the suite's last five minutes; first, the other files fill in."""
    items.sort(key=lambda item: not item.path.name.startswith("test_bench"))  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", autouse=True)
def stop_the_distributed_group():
    """A tensor- or pipeline-parallel group that a module's engines started stops when the module ends (workers
    joined), not at the interpreter's exit, where one left waiting held the suite's exit up until its receive timed
    out. Never imported, there is none to stop."""
    yield
    group = sys.modules.get("runtime.distributed.group")
    if group is not None:
        group.shutdown()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from tiny_models import build_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """tiny_checkpoint(name, **overrides) -> (directory, HF model); built once per name and overrides."""
    from tiny_models import build_model

    built = {}

    def make(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(name)
            built[key] = (directory, build_model(name, directory, tokenizer_dir, **overrides))
        return built[key]

    return make
