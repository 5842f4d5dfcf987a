"""pytest imports test modules by basename (rootdir-relative, no packages): two test files with one name in
different folders make the whole collection fail, so name clashes are caught here, with both paths."""

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_module_basenames_are_unique():
    paths = defaultdict(list)
    for path in sorted(TESTS.rglob("test_*.py")):
        paths[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: where for name, where in paths.items() if len(where) > 1}
    assert not clashes, f"rename one of each: {clashes}"
