"""`vllm serve` flags that kvserve serve accepts: the ones with a meaning here, and the
rest logged (no-op) or refused unless off (default-only), as for the engine arguments
(kvserve.args.vllm_compat)."""

from __future__ import annotations

import argparse

from kvserve.args.vllm_compat import IgnoredArg, add_ignored_cli_args, check_ignored

IGNORED_SERVER_ARGS: dict[str, IgnoredArg] = {
    "enable_log_requests": IgnoredArg(
        "no-op", "requests are logged unless --disable-log-requests", cli="flag"
    ),
    "max_log_len": IgnoredArg(
        "no-op", "request lines log sampling parameters, not prompts", cli=int
    ),
    "disable_frontend_multiprocessing": IgnoredArg(
        "no-op",
        "the HTTP front end and the engine core always run in two processes",
        cli="flag",
    ),
    "enable_request_id_headers": IgnoredArg("no-op", "X-Request-Id is always echoed", cli="flag"),
    "enable_prompt_tokens_details": IgnoredArg(
        "no-op", "usage carries no prompt_tokens_details", cli="flag"
    ),
    "enable_server_load_tracking": IgnoredArg(
        "no-op", "load is on /metrics and the dashboard", cli="flag"
    ),
    "disable_uvicorn_access_log": IgnoredArg("no-op", "uvicorn's access log is off", cli="flag"),
    "api_server_count": IgnoredArg("default-only", "one API server process", (1,), cli=int),
    "return_tokens_as_token_ids": IgnoredArg(
        "default-only", "logprob tokens are text", (False,), cli="flag"
    ),
    "response_role": IgnoredArg("default-only", "replies are the assistant's", ("assistant",)),
    "middleware": IgnoredArg("default-only", "no user ASGI middleware is loaded"),
}


def add_vllm_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's server flags: TLS, root path and docs (used), the rest IGNORED_SERVER_ARGS."""
    group = parser.add_argument_group("server (vLLM's names)")
    group.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM)")
    group.add_argument(
        "--root-path", default=None, help="the URL prefix a proxy in front serves this under"
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="no /docs, /redoc or /openapi.json",
    )
    group.add_argument(
        "--enable-store-responses",
        action="store_true",
        help="keep /v1/responses results in memory (store=true, previous_response_id, "
        "GET /v1/responses/{id}); off by default, like vLLM",
    )
    add_ignored_cli_args(parser, IGNORED_SERVER_ARGS, "vLLM server compatibility")
    return parser


def check_server_args(args: argparse.Namespace) -> None:
    """Logs the no-op server flags given; ValueError for a default-only one turned on."""
    check_ignored(args, IGNORED_SERVER_ARGS)
