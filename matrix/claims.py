"""Which tests claim to prove which cell of the support matrix, read from tests/ without running them.

A test claims cells with the registered pytest marker `proves`. Its arguments are architecture
names (the keys of runtime.models.REGISTRY) and claims (`engine`, the V1 column, or a feature's
value such as `chunked prefill`), in any order and at least one of each; the test proves every
named claim for every named architecture:

    @pytest.mark.proves("LlamaForCausalLM", "engine", "chunked prefill")    # this test
    pytestmark = pytest.mark.proves("BambaForCausalLM", "engine")             # every test of the module or class
    pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "engine"))
                    # the parametrized case, in a parametrize list, a fixture's params or a list they name

The source is read with `ast`, not collected by pytest (which would import torch and transformers),
so the check stays fast. A marker this reader cannot place, an argument that is not a string
literal, an unknown name, a marker that reaches no test, and a proof on a test CI does not run
(marked gpu, skip or xfail) are errors: a typo must not silently prove nothing.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from pathlib import Path

from matrix.errors import BadClaim, UsageError
from matrix.files import read_text
from runtime.models import REGISTRY
from runtime.models.interface import Feature

ENGINE = "engine"
CLAIMS = (ENGINE, *(feature.value for feature in Feature))
MARKER = "proves"
EXAMPLE = '@pytest.mark.proves("BambaForCausalLM", "chunked prefill")'
# A test with one of these markers does not run in CI, so it cannot prove anything there.
NOT_RUN_IN_CI = frozenset({"gpu", "skip", "xfail"})
Decorated = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclass(frozen=True, order=True)
class Claim:
    architecture: str
    claim: str  # ENGINE or a Feature value
    test: str  # e.g. tests/engine/test_parity.py::test_greedy_tokens_match_transformers[bamba]
    where: str  # path:line of the marker


def read_claims(root: Path) -> list[Claim]:
    """Every claim of every test under root/tests, sorted."""
    tests = root / "tests"
    if not tests.is_dir():
        raise UsageError(f"no tests/ directory under {root}; the proving tests are read from it")
    claims = []
    for path in sorted(tests.rglob("*.py")):
        shown = path.relative_to(root).as_posix()
        text = read_text(path, shown)
        if MARKER in text:  # most files have no marker: skip parsing them
            claims.extend(claims_in(text, shown))
    return sorted(set(claims))


def claims_in(source: str, path: str) -> list[Claim]:
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        raise BadClaim(f"{path}:{err.lineno}: {err.msg}; the check reads the proves markers of this file "
                       "and cannot parse it") from None
    module = ParsedTests(tree, path)
    claims = []
    for marker in module.markers():
        architectures, names = parse_arguments(marker, path)
        tests = module.tests_of(marker)
        if not tests:
            raise BadClaim(f"{path}:{marker.lineno}: this proves marker reaches no test; put it on a test function, "
                           "a test class, pytestmark, or a pytest.param used by a test")
        claims += [Claim(a, n, test, f"{path}:{marker.lineno}") for a in architectures for n in names for test in tests]
    return claims


def is_mark(node: ast.AST, name: str) -> bool:
    """`pytest.mark.NAME` or `mark.NAME`."""
    if not isinstance(node, ast.Attribute) or node.attr != name:
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark")


def mark_name(node: ast.AST) -> str | None:
    """NAME for `pytest.mark.NAME` or `pytest.mark.NAME(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and is_mark(node, node.attr):
        return node.attr
    return None


def parse_arguments(marker: ast.Call, path: str) -> tuple[list[str], list[str]]:
    where = f"{path}:{marker.lineno}"
    values = []
    for arg in [*marker.args, *marker.keywords]:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise BadClaim(f"{where}: proves takes string literals only (the check reads them without running the "
                           f"test); write each architecture and claim as a quoted name")
        values.append(arg.value)
    architectures = [v for v in values if v in REGISTRY]
    names = [v for v in values if v in CLAIMS]
    for value in values:
        if value not in REGISTRY and value not in CLAIMS:
            raise BadClaim(f"{where}: proves names {value!r}, which is neither an architecture nor a claim"
                           f"{did_you_mean(value)}; architectures: {', '.join(sorted(REGISTRY))}; "
                           f"claims: {', '.join(CLAIMS)}")
    if not architectures or not names:
        missing = "an architecture" if not architectures else f"a claim ({', '.join(CLAIMS)})"
        raise BadClaim(f"{where}: proves needs {missing}, e.g. {EXAMPLE}")
    return architectures, names


def did_you_mean(value: str) -> str:
    close = difflib.get_close_matches(value, [*REGISTRY, *CLAIMS], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class ParsedTests:
    """One test file's syntax tree, with what is needed to find the tests a marker applies to."""

    def __init__(self, tree: ast.Module, path: str) -> None:
        self.tree, self.path = tree, path
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        # Module-level functions and the methods of module-level classes, each with its class.
        self.functions: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, ast.ClassDef | None]] = []
        for node in tree.body:
            owner = node if isinstance(node, ast.ClassDef) else None
            for inner in node.body if owner else [node]:
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.append((inner, owner))

    def markers(self) -> list[ast.Call]:
        found = []
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and is_mark(node, MARKER):
                call = self.parents.get(node)
                if not (isinstance(call, ast.Call) and call.func is node):
                    raise BadClaim(f"{self.path}:{node.lineno}: a bare pytest.mark.proves proves nothing; call it "
                                   f'with an architecture and a claim, e.g. {EXAMPLE}')
                found.append(call)
        return sorted(found, key=lambda call: (call.lineno, call.col_offset))

    def climb(self, node: ast.AST) -> tuple[ast.AST, ast.AST]:
        """The first ancestor that is not a list or tuple, and its child on the way."""
        parent = self.parents.get(node)
        while isinstance(parent, (ast.List, ast.Tuple)):
            node, parent = parent, self.parents.get(parent)
        return parent, node

    def tests_of(self, marker: ast.Call) -> list[str]:
        parent, child = self.climb(marker)
        if isinstance(parent, ast.keyword) and parent.arg == "marks":
            param = self.parents[parent]
            if isinstance(param, ast.Call) and is_param(param.func):
                return self.tests_of_param(param)
        if isinstance(parent, Decorated) and child in parent.decorator_list:
            return self.tests_in(parent)
        if isinstance(parent, ast.Assign) and [getattr(t, "id", None) for t in parent.targets] == ["pytestmark"]:
            owner = self.parents[parent]
            if owner is self.tree or isinstance(owner, ast.ClassDef):
                return self.tests_in(owner)
        raise BadClaim(f"{self.path}:{marker.lineno}: the check cannot tell which test this proves marker is on; "
                       "use it as a decorator, in pytestmark = ..., or in pytest.param(..., marks=...)")

    def tests_of_param(self, param: ast.Call) -> list[str]:
        """The tests that run a `pytest.param(...)`: in a decorator's arguments, or in a module-level list."""
        suffix = param_id(param)
        parent, _ = self.climb(param)
        if isinstance(parent, ast.keyword):  # a fixture's params=[...]
            parent = self.parents[parent]
        decorated = self.parents.get(parent)
        if isinstance(parent, ast.Call) and isinstance(decorated, Decorated) and parent in decorated.decorator_list:
            return self.tests_using(decorated, parent, suffix)
        if isinstance(parent, ast.Assign) and self.parents[parent] is self.tree and len(parent.targets) == 1 \
                and isinstance(parent.targets[0], ast.Name):
            return self.tests_naming(parent.targets[0].id, suffix)
        return []

    def tests_naming(self, name: str, suffix: str | None) -> list[str]:
        """The tests that run the cases in the module-level list `name`, wherever a decorator passes it."""
        tests = []
        for decorated in self.decorated():
            for decorator in decorated.decorator_list:
                if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(decorator)):
                    tests += self.tests_using(decorated, decorator, suffix)
        return tests

    def tests_using(self, decorated: Decorated, decorator: ast.AST, suffix: str | None) -> list[str]:
        """The tests a case reaches: a parametrized test itself, or every test requesting a fixture."""
        if is_fixture(decorator) and isinstance(decorated, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return self.tests_requesting(decorated.name, suffix)
        return self.tests_in(decorated, suffix)

    def tests_requesting(self, fixture: str, suffix: str | None) -> list[str]:
        """Tests of this module that request the fixture, directly or through the module's other fixtures."""
        wanted, tests, changed = {fixture}, [], True
        while changed:
            changed = False
            for function, _ in self.functions:
                if is_fixture_function(function) and function.name not in wanted and wanted & argument_names(function):
                    wanted.add(function.name)
                    changed = True
        for function, owner in self.functions:
            if argument_names(function) & wanted:
                tests += self.tests_in(function, suffix, owner)
        return tests

    def decorated(self) -> list[Decorated]:
        return [node for node in ast.walk(self.tree) if isinstance(node, Decorated)]

    def tests_in(self, scope: ast.AST, suffix: str | None = None, owner: ast.ClassDef | None = None) -> list[str]:
        """Node ids of the tests in a module, a class or one function; an error for a test CI does not run."""
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            owner = owner or next((o for f, o in self.functions if f is scope), None)
            candidates = [(scope, owner)]
        else:
            candidates = [(f, o) for f, o in self.functions if scope is self.tree or o is scope]
        tests = []
        for function, cls in candidates:
            if not is_test(function, cls):
                continue
            skipped = ", ".join(sorted(self.markers_on(function, cls) & NOT_RUN_IN_CI))
            if skipped:
                raise BadClaim(f"{self.path}:{function.lineno}: {function.name} is marked {skipped}, so CI does not "
                               "run it and it cannot prove a claim; prove the claim with a test CI runs")
            parts = [self.path, *([cls.name] if cls else []), function.name]
            tests.append("::".join(parts) + (f"[{suffix}]" if suffix else ""))
        return tests

    def markers_on(self, function: ast.AST, cls: ast.ClassDef | None) -> set[str]:
        names = set()
        for scope in (function, cls):
            for decorator in getattr(scope, "decorator_list", []):
                names.add(mark_name(decorator))
        for scope in (self.tree, cls):
            for node in getattr(scope, "body", []):
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["pytestmark"]:
                    names.update(mark_name(n) for n in ast.walk(node.value))
        return names - {None}


def is_test(function: ast.AST, cls: ast.ClassDef | None) -> bool:
    # pytest's defaults: python_functions = test*, python_classes = Test*.
    return function.name.startswith("test") and (cls is None or cls.name.startswith("Test"))


def is_param(node: ast.AST) -> bool:
    """`pytest.param` or `param`."""
    return (isinstance(node, ast.Attribute) and node.attr == "param" and isinstance(node.value, ast.Name)) or (
        isinstance(node, ast.Name) and node.id == "param")


def is_fixture(decorator: ast.AST) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(node, ast.Attribute) and node.attr == "fixture") or (
        isinstance(node, ast.Name) and node.id == "fixture")


def is_fixture_function(function: ast.AST) -> bool:
    return any(is_fixture(d) for d in function.decorator_list)


def argument_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}


def param_id(param: ast.Call) -> str | None:
    """The id pytest gives a `pytest.param(...)` case, where it can be read: `id=`, or its literal values."""
    for keyword in param.keywords:
        if keyword.arg == "id" and isinstance(keyword.value, ast.Constant):
            return str(keyword.value.value)
    values = [arg.value for arg in param.args if isinstance(arg, ast.Constant)]
    if param.args and len(values) == len(param.args) and all(isinstance(v, (str, int, float)) for v in values):
        return "-".join(str(v) for v in values)
    return None
