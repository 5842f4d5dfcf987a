"""JSON schemas, regexes and choices for the structured-output tests, offline and served.

Every string is bounded (maxLength, enum, pattern) and every array too: a random model left free in a
string writes until max_tokens, and the output would be cut, not wrong.
"""

NAME = {"type": "string", "maxLength": 6}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["x"],
     "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
     "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "id": {"type": "integer", "minimum": 1,
                                                                         "maximum": 9}},
     "required": ["kind", "id"], "additionalProperties": False},
    {"$defs": {"item": {"type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1,
                                                                               "maximum": 5}},
                        "required": ["sku", "qty"], "additionalProperties": False}},
     "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1,
                                                "maxItems": 2}}, "required": ["items"], "additionalProperties": False},
    {"$defs": {"level": {"enum": ["low", "high"]}}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/level"}, "b": {"$ref": "#/$defs/level"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                      {"type": "boolean"}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "object", "properties": {"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}},
     "required": ["maybe"], "additionalProperties": False},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "middle": NAME}, "required": ["first", "last"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}, "label": NAME},
     "required": ["score", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "string", "enum": ["alpha", "beta", "gamma"]},
    {"type": "integer", "minimum": 100, "maximum": 999},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"op": {"enum": ["add", "sub"]}, "arg": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
        "required": ["op", "arg"], "additionalProperties": False}}}, "required": ["steps"],
     "additionalProperties": False},
]

REGEXES = [r"[a-z]{3}-[0-9]{2}", r"(yes|no), [0-9]{1,3}", r"[A-Z][a-z]{2,5} [0-9]{4}", r"0x[0-9a-f]{4}"]

CHOICES = [["yes", "no"], ["Paris", "London", "Rome"], ['say "hi"', "a\\b", "é\nnew line"]]

# An EBNF grammar (GBNF, as vLLM's xgrammar backend takes) and the strings it allows.
GRAMMAR = 'root ::= "call(" arg ("," arg)? ")"\narg ::= [a-z] [0-9]?'
GRAMMAR_REGEX = r"call\([a-z][0-9]?(,[a-z][0-9]?)?\)"
