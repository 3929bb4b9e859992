"""`kvserve serve`: the server's flags (vLLM's names) and its entry point."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os

from kvserve.args.engine_args import EngineArgs
from kvserve.entrypoints.openai.compat_args import add_vllm_server_args, check_server_args
from kvserve.entrypoints.openai.model_sources import add_multi_model_args, model_sources

# Where `--api-key` is read from when not given (vLLM's VLLM_API_KEY too): a key in the
# environment is not in the process list other users of the machine can read.
API_KEY_ENV = "KVSERVE_API_KEY"


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Engine flags plus the HTTP server's own."""
    # The positional model is one of the served models (model_sources() lists them all).
    parser.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="model",
        help="GGUF file, HF directory or a known name (default: SmolLM2-135M-Instruct)",
    )
    EngineArgs.add_cli_args(parser, with_model=False)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (loopback by default; 0.0.0.0 for all)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or os.environ.get("VLLM_API_KEY"),
        help="require `Authorization: Bearer <key>` on every route but /health, /version, "
        f"the OpenAPI schema and (unless --metrics-auth) /metrics; default: ${API_KEY_ENV} "
        "or $VLLM_API_KEY",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="several API keys, one 'KEY TENANT' per line (mode 600): each tenant's KV "
        "(prefix cache, tier chunks) is kept apart from every other's, and /metrics counts "
        "per tenant; may be combined with --api-key",
    )
    parser.add_argument(
        "--allowed-origins",
        type=_origins,
        default=None,
        help='CORS origins, e.g. \'["http://localhost:3000"]\' or "*"',
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (file path or the text itself) that replaces the tokenizer's",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='accepted for vLLM\'s command lines: tool_choice "auto" (the default when a '
        "request has tools) is always on",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        help="how to read tool calls out of the model's text: auto (the default: chosen from "
        "the chat template and the tokenizer, logged at startup), hermes, llama3_json, "
        "mistral, pythonic, qwen3_coder, granite, or a parser registered with "
        "ToolParserManager",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="split a thinking model's output into reasoning_content and content: "
        "deepseek_r1, qwen3, auto (from the chat template's <think> tags; none when it has "
        "none), or a parser registered with ReasoningParserManager",
    )
    parser.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log each request's id and sampling parameters",
    )
    parser.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the chat playground (/) and the engine dashboard (/dashboard)",
    )
    parser.add_argument(
        "--enable-request-census",
        action="store_true",
        help="serve GET /debug/census: per process, the per-request state every owner "
        "still holds (all 0 when idle; for leak hunts, behind --api-key when one is set)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM before they are aborted",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served under their own model names, as "
        'name=path or JSON \'{"name": ..., "path": ...}\'; needs --enable-lora',
    )
    add_limit_args(parser)
    add_multi_model_args(parser)
    add_vllm_server_args(parser)
    return parser


def _lora_module(value: str) -> tuple[str, str]:
    """vLLM's two forms of a --lora-modules entry -> (name, path)."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
            return str(entry["name"]), str(entry["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f"--lora-modules JSON needs 'name' and 'path': {value!r}"
            ) from None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules expects name=path, got {value!r}")
    return name, path


def add_limit_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Admission control, timeouts and the metrics guard (README: "Limits")."""
    group = parser.add_argument_group("limits")
    group.add_argument(
        "--max-queued-requests",
        type=_non_negative_int,
        default=256,
        help="generation requests that may wait for a slot beyond --max-num-seqs running "
        "ones; more get 503 with Retry-After (default: %(default)s)",
    )
    group.add_argument(
        "--retry-after",
        type=float,
        default=1.0,
        help="seconds sent in Retry-After when a request is refused (default: %(default)s)",
    )
    group.add_argument(
        "--max-request-body-size",
        type=_non_negative_int,
        default=16 << 20,
        help="bytes a request body may have; larger ones get 413 (default: %(default)s)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a generation request may run before it is aborted (408 or, once "
        "streaming, an error event); off by default",
    )
    group.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=30.0,
        help="seconds one write of a stream may block on a client that does not read "
        "(its socket buffers full) before the request is aborted and its KV blocks freed "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--metrics-auth",
        action="store_true",
        help="with --api-key, require the key on /metrics too",
    )
    return parser


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _origins(value: str) -> list[str]:
    # vLLM takes a JSON list; a bare origin (or "*") is accepted too.
    if value.startswith("["):
        origins = json.loads(value)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("--allowed-origins must be a JSON list of strings")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


def serve_main(args: argparse.Namespace) -> int:
    if args.tool_call_parser != "auto":
        from kvserve.entrypoints.openai.tool_parsers import ToolParserManager

        try:
            ToolParserManager.get_tool_parser(args.tool_call_parser)
        except ValueError as exc:
            raise SystemExit(f"--tool-call-parser: {exc}") from None
    if args.reasoning_parser and args.reasoning_parser != "auto":
        from kvserve.entrypoints.openai.reasoning_parsers import ReasoningParserManager

        try:
            ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
        except ValueError as exc:
            raise SystemExit(f"--reasoning-parser: {exc}") from None
    check_server_args(args)
    if getattr(args, "headless", False):
        # Engine cores only, for a front end on another node: no HTTP, no tokenizer.
        from kvserve.engine.core_launcher import discard_prestarted_core
        from kvserve.engine.headless import run_headless

        discard_prestarted_core()
        return run_headless(model_sources(args)[0].engine_args.create_engine_config())
    # Request lines and the periodic stats line are INFO: show them unless asked not to.
    # The tool call parser's choice is logged once at startup, whatever the request logging.
    names = ["kvserve.metrics", "kvserve.entrypoints.openai.serving_chat"] + (
        [] if args.disable_log_requests else ["kvserve.entrypoints.openai"]
    )
    for name in names:
        if logging.getLogger(name).getEffectiveLevel() > logging.INFO:
            logging.getLogger(name).setLevel(logging.INFO)
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from kvserve.engine.async_llm import AsyncLLM

    # The first model's engine core is spawned first; the web stack (FastAPI and the
    # OpenAI routes, about a second of imports) is imported here while it loads the model.
    sources = model_sources(args)
    engine = AsyncLLM.from_engine_args(
        sources[0].engine_args,
        also_while_starting=lambda: importlib.import_module(_API_SERVER),
    )
    from kvserve.entrypoints.openai.api_server import serve_http

    return await serve_http(args, engine, sources)


_API_SERVER = "kvserve.entrypoints.openai.api_server"


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    add_serve_args(parser)
    parser.set_defaults(func=serve_main)
    return parser
