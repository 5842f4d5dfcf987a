"""`tandem generate [MODEL] PROMPT...`: completions on the command line, streamed as they come."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import TextIO

from runtime.cli import examples
from runtime.plan import add_engine_arguments, engine_options


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="complete prompts (default model: the one shipped with Tandem)",
        description="Complete one or more prompts and print each prompt with its completion, token by token "
                    f"as it is generated. {MODEL_RULE} `-` as the prompt, or no prompt with a pipe on stdin, "
                    "reads the prompts from stdin, one per line. Ctrl-C stops and keeps what was printed.",
        epilog=examples(
            'tandem generate "The page pool"',
            'tandem generate runtime/default_model "The page pool" "Mamba layers keep" --max-tokens 16',
            'printf "The page pool\\nMamba layers keep\\n" | tandem generate --max-tokens 16',
            'tandem generate runtime/default_model - < prompts.txt',
            'tandem generate --model runtime/default_model "/etc is where"',
        ))
    parser.add_argument("args", nargs="*", metavar="[MODEL] PROMPT",
                        help="an optional model directory (see above), then the prompts (`-`: read them from stdin)")
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="the model directory; every argument is then a prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep tokens up to this "
                        "probability mass (default 1.0: all)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0: all)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="keep generating past the end-of-sequence token, up to --max-tokens")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


# The one rule, said the same way in --help and the docs (docs/usage/offline_inference.md, README.md).
MODEL_RULE = ("The model is --model DIR, or else the first argument when it names an existing directory or .gguf "
              "file (default: the small model shipped with Tandem). A first argument shaped like a path (it starts with ./, ../, / "
              "or ~, or ends with /) that is not a directory is an error; anything else is a prompt.")
PATH_PREFIXES = ("./", "../", "/", "~")


def split_model(args: list[str], model: str | None, stdin: TextIO) -> tuple[str | None, list[str]]:
    """(model or None, prompts), by MODEL_RULE."""
    if model is None and args and args[0] != "-":
        first = args[0]
        if _is_dir(first):
            model, args = str(Path(first).expanduser()), args[1:]
        elif first.startswith(PATH_PREFIXES) or first.endswith("/"):
            # A mistyped model path must not quietly become a prompt for the shipped model.
            raise ValueError(f"no model directory {first}: give an existing one, or pass the model with "
                             "--model DIR to use this argument as a prompt")
    if not args and not stdin.isatty():
        args = ["-"]
    if not args:
        raise ValueError("no prompt: give one or more prompts, or pipe them in (one per line)")
    prompts = []
    for arg in args:
        if arg == "-":
            prompts.extend(line.rstrip("\r\n") for line in stdin if line.strip())
        else:
            prompts.append(arg)
    if not prompts:
        raise ValueError("stdin held no prompt: write one prompt per line")
    return model, prompts


def _is_dir(text: str) -> bool:
    """A model directory, or a GGUF file (which is a model too)."""
    try:
        path = Path(text).expanduser()
        return path.is_dir() or (path.suffix == ".gguf" and path.is_file())
    except OSError:  # a prompt longer than a file name may be
        return False


def run(args: argparse.Namespace) -> int:
    model, prompts = split_model(args.args, args.model, sys.stdin)
    # Imported here: the engine needs torch, and `tandem plan` must not.
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm = LLM(model, **engine_options(args))
    print_streams(llm.stream(prompts, params), prompts, sys.stdout)
    return 0


def print_streams(stream, prompts: list[str], out: TextIO) -> None:
    """Print each prompt and its completion in prompt order: the current one as its tokens come, the
    later ones (which run in the same batch) from where they have got to once it finishes."""
    texts = [""] * len(prompts)
    finished = [False] * len(prompts)
    shown, current = 0, 0  # characters of prompt `current`'s completion printed so far
    # The stream checks every prompt when it starts (one too long raises): nothing is printed before that.
    stream = iter(stream)
    first = next(stream, None)
    out.write(prompts[0])
    out.flush()
    for index, output in itertools.chain([first] if first is not None else [], stream):
        texts[index] = output.outputs[0].text
        finished[index] = output.finished
        while current < len(prompts):
            # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for the next token to finish it.
            ready = texts[current] if finished[current] else texts[current].rstrip("\ufffd")
            out.write(ready[shown:])
            shown = max(shown, len(ready))
            if not finished[current]:
                break
            out.write("\n")
            current, shown = current + 1, 0
            if current < len(prompts):
                out.write("\n" + prompts[current])
        out.flush()
