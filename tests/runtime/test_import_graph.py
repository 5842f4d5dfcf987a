"""The import graph: transformers only for the tokenizer, and a cache package that does not import the model side."""

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).parents[2] / "runtime"
# The one transformers name the runtime uses: configs are read by the declarations, modules are ours.
TOKENIZER_ONLY = {"AutoTokenizer", "PreTrainedTokenizerFast"}  # the latter wraps a GGUF file's tokenizer
# Trains the model that ships with Tandem, with transformers' own classes; the engine never imports it.
NOT_RUNTIME_CODE = {RUNTIME / "default_model" / "train.py"}


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None for `import module`, line) for every import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


def runtime_files() -> list[Path]:
    return sorted(p for p in RUNTIME.rglob("*.py") if p not in NOT_RUNTIME_CODE)


def test_the_runtime_imports_nothing_from_transformers_but_the_tokenizer():
    bad = [
        f"{path.relative_to(RUNTIME.parent)}:{line}: {module}{'.' + name if name else ''}"
        for path in runtime_files()
        for module, name, line in imports(path)
        if module.split(".")[0] == "transformers" and (module != "transformers" or name not in TOKENIZER_ONLY)
    ]
    assert not bad, "transformers beyond the tokenizer:\n" + "\n".join(bad)


# runtime/cache is below the model: the layers implement its protocols (runtime/cache/protocol.py).
MODEL_SIDE = ("runtime.layers", "runtime.loader", "runtime.runner", "runtime.engine", "runtime.kernels")


@pytest.mark.parametrize("path", sorted((RUNTIME / "cache").glob("*.py")), ids=lambda p: p.name)
def test_the_cache_package_does_not_import_the_model_side(path):
    upward = [f"{module} (line {line})" for module, _, line in imports(path)
              if module.startswith(MODEL_SIDE) or (module.startswith("runtime.models.") and module.endswith(".model"))]
    assert not upward, f"{path.name} imports {', '.join(upward)}"


def test_the_check_sees_an_upward_import(tmp_path):
    # The walk itself: a file that imports a layer is caught.
    probe = tmp_path / "probe.py"
    probe.write_text("from runtime.layers.attention import PagedAttention\nfrom transformers import AutoConfig\n")
    assert [(m, n) for m, n, _ in imports(probe)] == [("runtime.layers.attention", "PagedAttention"),
                                                     ("transformers", "AutoConfig")]
