"""`tandem chat [MODEL]`: an interactive conversation through the model's chat template."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

from runtime.cli import examples
from runtime.plan import add_engine_arguments, engine_options

PROMPT = "> "
# On stderr, so that what a pipe reads of stdout is the conversation alone.
HINT = "Type a message and press Enter; /exit or Ctrl-D ends the chat."


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chat", help="talk to a model interactively, through its chat template",
        description="Talk to a model: each line you type is a user message; the conversation so far goes "
                    "through the tokenizer's chat template (or --chat-template FILE) and the reply is "
                    "printed as it is generated. Ctrl-D (end of input) or /exit ends the session; "
                    "Ctrl-C ends it at once.",
        epilog=examples("tandem chat", "tandem chat runtime/default_model --max-tokens 64",
                        "tandem chat path/to/model --chat-template template.jinja --system 'Be brief.'"))
    parser.add_argument("model", nargs="?", default=None,
                        help="a model directory (default: the small model shipped with Tandem)")
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="a Jinja chat template file, for a tokenizer that has none (or to replace its own)")
    parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per reply at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.chat_template is not None and not args.chat_template.is_file():
        raise ValueError(f"--chat-template {args.chat_template}: no such file")
    # Imported here: the engine needs torch, and `tandem plan` must not.
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_options(args))
    tokenizer = llm.get_tokenizer()
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {llm.engine.config.model_dir} has no chat template; "
                         "pass one with --chat-template FILE")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(HINT, file=sys.stderr)
    converse(llm, tokenizer, params, messages, sys.stdin, sys.stdout)
    return 0


def converse(llm, tokenizer, params, messages: list[dict], stdin: TextIO, out: TextIO) -> None:
    while True:
        out.write(PROMPT)
        out.flush()
        line = stdin.readline()
        if not line or line.strip() == "/exit":
            out.write("\n" if not line else "")
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        reply = ""
        for _, output in llm.stream({"prompt_token_ids": list(ids)}, params):
            text = output.outputs[0].text
            ready = text if output.finished else text.rstrip("\ufffd")
            out.write(ready[len(reply):])
            out.flush()
            reply = max(reply, ready, key=len)
        out.write("\n")
        messages.append({"role": "assistant", "content": reply})
