"""Engine options written once: EngineConfig's field metadata gives every subcommand its options.

A field of `EngineConfig` declared with `option(...)` becomes the same command-line option, with
the same spelling, type and help text, in `tandem plan`, `generate`, `serve` and `chat`; `LLM(**kwargs)`
takes the same names as keywords. This module imports no torch and nothing of the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from typing import Any, Callable, Iterator

UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
         "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "t": 1024**4, "tib": 1024**4, "tb": 1000**4}
OPTION = "tandem_option"  # the key of a field's metadata that holds its Option
# field name -> flag while a command runs (see spelled_as_flags); None: errors speak LLM(...)'s keywords.
_flags: dict[str, str] | None = None


@dataclasses.dataclass(frozen=True)
class Option:
    help: str
    flag: str = ""  # "--kv-cache-memory"; empty: "--" + the field name with dashes
    aliases: tuple[str, ...] = ()  # shown in --help, e.g. vLLM's short "--tp"
    hidden_aliases: tuple[str, ...] = ()  # accepted, never shown (older spellings)
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    plan: bool = False  # it changes what `tandem plan` prints, so plan takes it too
    plan_help: str = ""  # plan's help for it, where the engine's does not fit a command that runs nothing


def option(help: str, **kwargs: Any) -> dict[str, Option]:
    """Field metadata: `field(default=..., metadata=option("what it does", ...))`."""
    return {OPTION: Option(help, **kwargs)}


def parse_size(text: str) -> int:
    """`8GiB`, `512MiB`, `1.5G` or a plain byte count; at least one byte."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}; write it like 8GiB, 512MiB or 1000000000")
    size = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if size < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: the page pool needs memory; give e.g. 4GiB")
    return size


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def options_of(config_cls: type) -> list[tuple[dataclasses.Field, Option]]:
    return [(f, f.metadata[OPTION]) for f in dataclasses.fields(config_cls) if OPTION in f.metadata]


def flag_of(f: dataclasses.Field, opt: Option) -> str:
    return opt.flag or "--" + f.name.replace("_", "-")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is None:
        return ""
    if isinstance(f.default, bool):
        return ""
    return f" (default: {f.default})"


def add_config_options(parser: argparse.ArgumentParser, config_cls: type, plan: bool = False) -> None:
    """Add one option per annotated field (with `plan`, those that change a plan); absent options stay
    absent, so EngineConfig's defaults apply."""
    title = "engine options that change the plan" if plan else "engine options"
    group = parser.add_argument_group(f"{title} (the same in every subcommand, and as LLM(...) keywords)")
    for f, opt in options_of(config_cls):
        if plan and not opt.plan:
            continue
        flag, text = flag_of(f, opt), (plan and opt.plan_help) or opt.help
        common: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS)
        if f.type in (bool, "bool"):
            kinds: dict[str, Any] = dict(action=argparse.BooleanOptionalAction)
            shown = text + (" (default: on)" if f.default else " (default: off)")
        else:
            kind = opt.type or (positive_int if "int" in str(f.type) else str)
            kinds = dict(type=kind, choices=opt.choices, metavar=opt.metavar)
            shown = text + _default_text(f)
        group.add_argument(flag, *opt.aliases, help=shown, **kinds, **common)
        for alias in opt.hidden_aliases:
            group.add_argument(alias, help=argparse.SUPPRESS, **kinds, **common)
    # What runtime.cli hands to spelled_as_flags while the command runs: its errors name these flags.
    parser.set_defaults(option_flags=option_flags(config_cls))


def config_kwargs(args: argparse.Namespace, config_cls: type) -> dict[str, Any]:
    """The EngineConfig keywords the user gave on the command line."""
    return {f.name: getattr(args, f.name) for f, _ in options_of(config_cls) if hasattr(args, f.name)}


def option_flags(config_cls: type) -> dict[str, str]:
    return {f.name: flag_of(f, opt) for f, opt in options_of(config_cls)}


@contextlib.contextmanager
def spelled_as_flags(flags: dict[str, str] | None) -> Iterator[None]:
    """While this runs, `spell` writes options as these flags (the command line's); None: as keywords."""
    global _flags
    previous, _flags = _flags, flags
    try:
        yield
    finally:
        _flags = previous


def spell(name: str, *value: Any) -> str:
    """An engine option, and its value if given, as the user wrote it: `--max-model-len 8` on the command
    line, `max_model_len=8` in LLM(...). Errors name options through this so that the fix they give can
    be typed as it stands, whichever interface the user is in."""
    if _flags is not None and name in _flags:
        return " ".join([_flags[name], *map(str, value)])
    return name + "".join(f"={v!r}" for v in value)


def plural(count: int, noun: str, nouns: str = "") -> str:
    """`1 page`, `2 pages`; `nouns` for a plural that is not noun + "s"."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"
