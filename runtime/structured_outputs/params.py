"""StructuredOutputsParams, as vLLM 0.11+ spells it. Pure Python: the grammar library is imported only
when a grammar is compiled (runtime/structured_outputs/grammars.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The fields that each name one constraint; exactly one of them is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on the generated text.

    `json`: a JSON schema (a dict, its JSON text, or a pydantic model class); `regex`: a regular expression
    the whole output matches; `choice`: a list of strings, the output is one of them; `grammar`: an EBNF
    (GBNF) grammar whose rule `root` the output matches (a Lark grammar is accepted too); `json_object=True`:
    any JSON object. `disable_any_whitespace` keeps the JSON compact (no free whitespace between tokens).
    """

    json: dict[str, Any] | str | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            which = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; {which}")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar: equal keys compile to the same grammar (the cache's key)."""
        kind = self.kind
        if kind == "json":
            spec = json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = self.choice
        elif kind == "json_object":
            spec = True
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace


def _schema(value: Any) -> dict[str, Any]:
    """A JSON schema as a dict, from a dict, its JSON text, or a pydantic model class."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
    if isinstance(value, bool):  # JSON schema allows true/false; xgrammar takes them as {} and {"not": {}}
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got {type(value).__name__}")
    return value


def _choices(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"structured_outputs.choice must be a list of strings, got {value!r}")
    if not value or not all(isinstance(c, str) and c for c in value):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                         f"got {list(value)!r}")
    return tuple(value)
