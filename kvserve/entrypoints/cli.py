"""The `kvserve` command: generate, chat, serve, bench, events, cache-server, router,
cache-controller, proxy, disagg."""

from __future__ import annotations

import argparse
import importlib
import itertools
import logging
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvserve.engine.core_launcher import discard_prestarted_core, prestart_engine_core
from kvserve.utils.allocator import exec_on_jemalloc
from kvserve.utils.threads import configure_process_threads

if TYPE_CHECKING:
    # The engine (torch) is imported inside the commands: OpenMP's settings must be in
    # the environment before torch loads, and `kvserve --help` should not pay for it.
    # The rest too, down to the flags: `serve` spawns its engine core before them.
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling_params import SamplingParams


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from kvserve.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        output_kind=RequestOutputKind.DELTA,
    )


_request_ids = itertools.count()


def _stream(engine: LLMEngine, prompt: Any, params: SamplingParams) -> Iterator[str]:
    from kvserve.outputs import RequestOutput

    request_id = f"cli-{next(_request_ids)}"
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert isinstance(output, RequestOutput)  # a generate request's output
            yield output.outputs[0].text


def _encode_chat(engine: LLMEngine, messages: list[dict[str, str]]) -> dict[str, list[int]]:
    from kvserve.engine.input_processor import apply_chat_template

    text = apply_chat_template(engine.tokenizer, messages, add_generation_prompt=True)
    return {"prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}


def _make_engine(args: argparse.Namespace) -> LLMEngine:
    from kvserve.args.engine_args import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    use_template = not args.raw and engine.tokenizer.chat_template is not None
    prompt: Any = (
        _encode_chat(engine, [{"role": "user", "content": args.prompt}])
        if use_template
        else args.prompt
    )
    for piece in _stream(engine, prompt, _sampling_params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for piece in _stream(engine, _encode_chat(engine, messages), _sampling_params(args)):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    engine.shutdown()
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``command`` one whose other lazy sub-commands are stubs."""
    from kvserve.args.engine_args import EngineArgs

    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="GGUF file, HF directory or a known name")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    EngineArgs.add_cli_args(gen, with_model=False)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat on the command line")
    chat.add_argument("--model", default=None)
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat, with_model=False)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    for name, (help_text, module, function) in _LAZY_COMMANDS.items():
        if command in (None, name):
            getattr(importlib.import_module(module), function)(sub)
        else:
            # Listed in `kvserve --help`, but not imported: the cache server's parser
            # pulls in torch, the web stack takes a second, and a command needs only its own.
            sub.add_parser(name, help=help_text)
    return parser


# Sub-commands registered only when they run (or for the full parser): name ->
# (help shown by `kvserve --help`, module, its add_*_parser function).
_LAZY_COMMANDS = {
    "serve": (
        "start the OpenAI-compatible HTTP server",
        "kvserve.entrypoints.openai.cli_args",
        "add_serve_parser",
    ),
    "cache-server": (
        "run a KV cache server (remote tier for kvserve://host:port)",
        "kvserve.kvcache.server.cli",
        "add_cache_server_parser",
    ),
    "bench": (
        "benchmark a server or offline throughput",
        "kvserve.benchmarks.cli",
        "add_bench_parser",
    ),
    "events": (
        "print an engine's KV cache events as JSON lines",
        "kvserve.entrypoints.events_cli",
        "add_events_parser",
    ),
    "router": (
        "route requests over several instances by their cached prefixes",
        "kvserve.entrypoints.router.server",
        "add_router_parser",
    ),
    "cache-controller": (
        "track and manage the KV tiers of several instances (lookup, pin, clear, move)",
        "kvserve.entrypoints.cache_controller.server",
        "add_cache_controller_parser",
    ),
    "proxy": (
        "disaggregated prefill: one front door over prefill and decode instances",
        "kvserve.entrypoints.disagg.proxy",
        "add_proxy_parser",
    ),
    "disagg": (
        "run a producer, a consumer and the disaggregation proxy locally",
        "kvserve.entrypoints.disagg.launcher",
        "add_disagg_parser",
    ),
}


def _command(argv: list[str]) -> str | None:
    """The sub-command named on the command line (None if there is none yet)."""
    skip_value = False
    for arg in argv:
        if skip_value:
            skip_value = False
        elif arg == "--log-level":
            skip_value = True
        elif not arg.startswith("-"):
            return arg
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None and _command(sys.argv[1:]) == "serve":
        exec_on_jemalloc()  # a long-running server: see utils/allocator.py
    argv = sys.argv[1:] if argv is None else argv
    # Before anything imports torch (the parser's sub-commands may). Not for benchmarks:
    # they run peers (HF, llama.cpp's OpenMP) in this process, and every engine must run
    # in the environment the user gave, or the comparison measures our settings.
    if argv[:1] != ["bench"]:
        configure_process_threads()
    command = _command(argv)
    if command == "serve":
        # The engine core's imports (torch, ~2 s) need no flags: they run while this
        # process parses them and builds the config and the tokenizer.
        prestart_engine_core()
    try:
        args = build_parser(command).parse_args(argv)
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        if getattr(args, "model", None) is None:
            from kvserve.args.engine_args import EngineArgs

            args.model = EngineArgs.model
        return int(args.func(args))
    except ValueError as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    finally:
        discard_prestarted_core()


if __name__ == "__main__":
    sys.exit(main())
