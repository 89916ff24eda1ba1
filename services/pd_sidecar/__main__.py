"""`python -m dynamo_lite.pd_sidecar`: the P/D sidecar beside a decode engine (a reverse proxy
that prefills on the engine the `x-prefiller-host-port` header names, then decodes locally)."""

from __future__ import annotations

import argparse
import logging
from urllib.parse import urlsplit

from dynamo_lite.web.cli import configure_logging, parse_args, positive_float, serve, service_parser

from .app import DEFAULT_PREFILL_TIMEOUT_SECS, create_app

DEFAULT_PORT = 8000
DEFAULT_DECODE_URL = "http://127.0.0.1:8001"


def _decode_url(text: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// base URL")
    return text.rstrip("/")


def main(argv: list[str] | None = None) -> None:
    parser = service_parser(
        "python -m dynamo_lite.pd_sidecar",
        "The P/D sidecar: a reverse proxy beside a decode engine, as llm-d's routing sidecar. With an "
        "x-prefiller-host-port header it prefills the request on that engine (max_tokens 1, vLLM's NixlConnector "
        "kv_transfer_params), then decodes it on --decode-url with what the prefill answered; without one, or "
        "when the prefill fails, the decode engine does it all.",
        DEFAULT_PORT,
    )
    parser.add_argument("--decode-url", type=_decode_url, default=DEFAULT_DECODE_URL,
                        help="base URL of the decode engine beside it (vLLM's OpenAI server)")
    parser.add_argument("--prefill-timeout-secs", type=positive_float, default=DEFAULT_PREFILL_TIMEOUT_SECS,
                        help="a prefill that has not answered in this time is given up (and cancelled): the decode "
                        "engine prefills the request itself")
    args = parse_args(parser, argv)
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream call otherwise
    logging.getLogger("dynamo_lite.pd_sidecar").info(
        "P/D sidecar on %s:%d for the decode engine at %s (prefill timeout %ss)", args.host, args.port,
        args.decode_url, args.prefill_timeout_secs)
    serve(create_app(args.decode_url, args.prefill_timeout_secs), args)


if __name__ == "__main__":
    main()
