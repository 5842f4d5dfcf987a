"""The request fields that ask for structured output, onto one StructuredOutputsParams: OpenAI's
`response_format`, vLLM's `structured_outputs` extra body and its older `guided_*` fields. Their grammar
is compiled on a worker thread, so a slow schema never holds up the engine thread and the other requests."""

from __future__ import annotations

import asyncio
from typing import Any

from runtime.server.protocol import InvalidField
from runtime.structured_outputs import StructuredOutputsParams
from runtime.structured_outputs.params import KINDS

# vLLM's older spelling: field -> StructuredOutputsParams field.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_outputs(body: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint the request asks for, the field that asked), or (None, None)."""
    asked = [(name, value) for name, value in _sources(body) if value is not None]
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise InvalidField(f"{names}: a request may ask for one structured output only; send one of them", asked[1][0])
    if not asked:
        return None, None
    name, spec = asked[0]
    try:
        return StructuredOutputsParams(**spec), name
    except ValueError as err:
        raise InvalidField(rename(str(err), name), name) from None


def _sources(body: Any) -> list[tuple[str, dict | None]]:
    sources = [("response_format", _response_format(body.response_format))]
    extra = body.structured_outputs
    if extra is not None:
        unknown = sorted(set(extra) - set(KINDS) - {"disable_any_whitespace"})
        if unknown:
            raise InvalidField(f"structured_outputs: unknown field {unknown[0]!r}; it takes {', '.join(KINDS)}",
                               "structured_outputs")
        extra = {key: value for key, value in extra.items() if value is not None}
    sources.append(("structured_outputs", extra))
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        sources.append((name, {kind: value} if value is not None else None))
    return sources


def _response_format(value: dict | None) -> dict | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise InvalidField(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                           "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    schema = (value.get("json_schema") or {}).get("schema")
    if schema is None:
        raise InvalidField('response_format: type "json_schema" needs {"json_schema": {"name": ..., "schema": '
                           '{...}}}', "response_format")
    return {"json": schema}


def rename(message: str, field: str) -> str:
    """An error about structured_outputs.KIND in the spelling of the field the request used."""
    if field == "response_format":
        return message.replace("structured_outputs.json_object", "response_format").replace(
            "structured_outputs.json", "response_format.json_schema.schema")
    if field in GUIDED:
        return message.replace(f"structured_outputs.{GUIDED[field]}", field)
    return message


async def compile_grammar(engine, spec: StructuredOutputsParams | None, field: str | None) -> None:
    """Compile `spec` on a worker thread (or find it cached); the engine thread then finds it ready.
    A constraint the grammar library refuses is a 400 naming `field`."""
    if spec is None:
        return
    try:
        await asyncio.to_thread(engine.grammars.compile, spec)
    except ValueError as err:
        raise InvalidField(rename(str(err), field), field) from None
