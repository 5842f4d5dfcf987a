"""`tandem serve [MODEL]`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

Order matters for the user: the options are checked and the cache layout resolved first (a bad
--block-size exits 2 at once), then the port is bound (a busy port exits 2 before the model
loads), then the model loads and the server starts.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from pathlib import Path

from runtime.cli import examples
from runtime.config import DEFAULT_MODEL, EngineConfig
from runtime.distributed.env import torchrun_rank
from runtime.options import parse_size, spelled_as_flags
from runtime.plan import add_engine_arguments, engine_options

API_KEY_ENV = "TANDEM_API_KEY"  # as vLLM's VLLM_API_KEY


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /health, /metrics) on 127.0.0.1:8000 until Ctrl-C or SIGTERM.",
        epilog=examples("tandem serve", "tandem serve path/to/model --port 8080 "
                        "--kv-cache-memory 8GiB", "tandem serve path/to/model --chat-template template.jinja"))
    parser.add_argument("model", nargs="?", default=None,
                        help="a model directory (default: the small model shipped with Tandem)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="requests waiting to run at most; more are refused with 503 (default 1024)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model directory's name)")
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="a Jinja chat template file, for a tokenizer that has none (or to replace its own)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model decide whether to call tools (tool_choice "auto"); '
                             "needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="how to find tool calls in the model's text for tool_choice \"auto\": hermes, qwen3, "
                             "granite or llama3_json")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) to serve from the start, each under the name requests "
                             "give as `model`; needs --enable-lora (more load at run time: POST /v1/load_lora_adapter)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds that in-flight requests get to finish on SIGINT or SIGTERM (default 10)")
    add_engine_arguments(parser)
    add_access_arguments(parser)
    add_limit_arguments(parser)
    parser.set_defaults(run=run)


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on every path but /health and /metrics "
                             f"(default: ${API_KEY_ENV}, else none)")
    parser.add_argument("--enable-openapi", action="store_true", help="serve /docs and /openapi.json (off by default)")


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = _limits_defaults()
    parser.add_argument("--max-request-bytes", type=parse_size, default=defaults.max_request_bytes,
                        help="larger request bodies are refused with 413 (default 8MiB)")
    parser.add_argument("--max-prompt-chars", type=int, default=None,
                        help="longer prompts are refused before tokenization (default max-model-len * 16)")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help=f"stop strings per request at most (default {defaults.max_stop_strings})")
    parser.add_argument("--max-stop-string-chars", type=int, default=defaults.max_stop_string_chars,
                        help=f"characters per stop string at most (default {defaults.max_stop_string_chars})")
    parser.add_argument("--max-chat-messages", type=int, default=defaults.max_chat_messages,
                        help=f"messages per chat request at most (default {defaults.max_chat_messages})")
    parser.add_argument("--max-n", type=int, default=defaults.max_n,
                        help=f"choices per prompt (`n`) at most (default {defaults.max_n})")
    parser.add_argument("--request-read-timeout", type=float, default=defaults.request_read_timeout,
                        help="seconds a client gets to send a whole request, or its connection is closed "
                             f"(default {defaults.request_read_timeout:g})")
    parser.add_argument("--timeout-keep-alive", type=float, default=defaults.timeout_keep_alive,
                        help=f"seconds an idle connection stays open (default {defaults.timeout_keep_alive:g})")


def _limits_defaults():
    from runtime.server.limits import ServerLimits  # torch-free, like this module

    return ServerLimits()


def server_limits(args: argparse.Namespace):
    from runtime.server.limits import ServerLimits

    return ServerLimits(max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                        max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                        max_chat_messages=args.max_chat_messages, max_n=args.max_n,
                        request_read_timeout=args.request_read_timeout,
                        timeout_keep_alive=args.timeout_keep_alive)


def api_key(args: argparse.Namespace) -> str | None:
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"the API key (--api-key or ${API_KEY_ENV}) is empty; give a key, or unset it")
    return key


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=str(args.model or DEFAULT_MODEL), **engine_options(args))


def check_server_options(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be 0 or more, got {args.max_waiting}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be 0 or more, got {args.shutdown_timeout}")
    if args.chat_template is not None and not args.chat_template.is_file():
        raise ValueError(f"--chat-template {args.chat_template}: no such file")
    if args.tool_call_parser is not None:
        from runtime.server.tool_parsers import get_parser

        get_parser(args.tool_call_parser)
    from runtime.server.lora import parse_lora_modules

    if parse_lora_modules(args.lora_modules) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (hermes, qwen3, granite or "
                         "llama3_json) to find the calls in the model's text")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror}; choose another --host or --port") from None
    return sock


def run(args: argparse.Namespace) -> int:
    config = engine_config(args)
    check_server_options(args)
    limits, key = server_limits(args), api_key(args)
    model_name = args.served_model_name or config.model_dir.resolve().name
    if config.world_size > 1 and torchrun_rank() > 0:
        from runtime.distributed.runner import serve_torchrun_rank

        return serve_torchrun_rank(config)  # rank 0 alone listens; the others run its steps
    sock = bind(args.host, args.port)
    try:
        server = build_server(config, args, model_name, limits, key)
        # Uvicorn handles SIGINT and SIGTERM itself and, once it has shut down gracefully, raises the
        # signal again for the handler it found; that handler does nothing, so the exit status is 0.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            # A request's errors go to its HTTP client, who passed no flag: they name options as LLM(...) does.
            with spelled_as_flags(None):
                server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
    return 0


def load_lora_modules(state, specs: list[str] | None) -> None:
    """The adapters of --lora-modules, checked and loaded before the server listens (ValueError: exit 2)."""
    from runtime.lora.request import LoRARequest
    from runtime.server.lora import parse_lora_modules

    for name, path in parse_lora_modules(specs):
        if name == state.model_name or name in state.loras:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice (or is the served model's)")
        lora = LoRARequest(name, state.next_lora_id(), path)
        state.engine.engine.add_lora(lora)
        state.loras[name] = lora


def build_server(config: EngineConfig, args: argparse.Namespace, model_name: str, limits, key: str | None):
    # Imported here: the server needs torch and FastAPI, and `tandem plan` needs neither.
    from runtime.server import memory

    memory.limit_arenas()  # before torch, the engine and uvicorn start their threads

    from runtime.engine import Engine
    from runtime.loader import load_tokenizer
    from runtime.sampling_params import generation_defaults
    from runtime.server.app import GracefulServer, build_app
    from runtime.server.async_engine import AsyncEngine
    from runtime.server.state import ServerState
    from runtime.server.tokenize import TokenizerWorker

    engine = Engine(config)
    engine.grammars.warm_up()  # structured outputs: the vocabulary's tables, before any request can wait on them

    def tokenizer():
        # Two instances: the tokenizer worker's thread and the event loop must not share one.
        loaded = load_tokenizer(config)
        if args.chat_template is not None:
            loaded.chat_template = args.chat_template.read_text(encoding="utf-8")
        return loaded

    state = ServerState(
        engine=AsyncEngine(engine, args.max_waiting),
        tokenizer=tokenizer(),
        tokenize=TokenizerWorker(tokenizer()),
        model_name=model_name,
        max_model_len=engine.max_model_len,
        limits=limits,
        api_key=key,
        sampling_defaults=generation_defaults(config.model_dir),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    load_lora_modules(state, args.lora_modules)
    return GracefulServer(build_app(state, enable_openapi=args.enable_openapi), args.host, args.port,
                          args.shutdown_timeout, log_level="info" if args.verbose else "warning")
