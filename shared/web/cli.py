"""Command-line plumbing shared by both services: common flags, environment, logging, serving.

Every long option `--some-flag` can also be set by the environment variable
`DYNAMO_LITE_SOME_FLAG` (see `parse_args`); a flag on the command line wins over it.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import ssl
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .auth import ApiKeys, key_list
from .credentials import ClientCredentials, api_key_from_env
from .http import Service
from .logs import DEFAULT_TRACE_ID_HEADER, LOG_FORMATS, AccessLog
from .logs import configure_logging as configure_logging
from .reloading import KeyFiles, read_keys
from .server import DEFAULT_HEADER_TIMEOUT_SECS, DEFAULT_KEEP_ALIVE_SECS, ConnectionCollector, ConnectionLimits, run
from .tls import ReloadingContext, TlsCollector, TlsFiles

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ENV_PREFIX = "DYNAMO_LITE_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each default shown once: not for an option without one (`None`), nor for a
    switch (`store_true`: off unless given), nor where the help text already says what the
    default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if (action.default is None or action.default is argparse.SUPPRESS or "default" in help_text
                or isinstance(action, argparse._StoreConstAction)):
            return action.help
        return super()._get_help_string(action)


def invoked_as(module_prog: str) -> str:
    """The program name `--help` and errors show: the console script's (`dynamo-lite-indexer`)
    when the service was started by it, else `module_prog` (`python -m dynamo_lite.indexer`), so
    a usage line can be pasted back as it was typed."""
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return script if script.startswith("dynamo-lite-") else module_prog


def service_parser(prog: str, description: str, default_port: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=invoked_as(prog),
        description=description,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--host", default="0.0.0.0",
                        help="address to bind (without --api-key anyone who reaches it may write: "
                             "keep it on a trusted network)")
    parser.add_argument("--port", type=port_number, default=default_port, help="TCP port to listen on")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="minimum level of log lines")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text lines, or one JSON object per line")
    # --no-access-log too, so a command line can turn off what DYNAMO_LITE_ACCESS_LOG turned on.
    parser.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                        help="log one line per HTTP request (method, path, status, duration, client, trace id)")
    parser.add_argument("--trace-id-header", default=DEFAULT_TRACE_ID_HEADER,
                        help="request header whose value the access log records as the trace id")
    connections = parser.add_argument_group("connections")
    connections.add_argument(
        "--header-timeout-secs", type=non_negative_float, default=DEFAULT_HEADER_TIMEOUT_SECS,
        help="a request head (request line and headers) not complete this long after its first byte, "
        "or after the connection opened, is answered 408 and the connection closed; 0: no limit",
    )
    connections.add_argument(
        "--keep-alive-secs", type=positive_float, default=DEFAULT_KEEP_ALIVE_SECS,
        help="how long an idle connection is kept open between two requests: longer than gateway "
        "connection pools keep theirs (Go's net/http 90 s, nginx and AWS load balancers 60 s), so the "
        "client, not the server, closes an idle connection and a request never races a close",
    )
    connections.add_argument(
        "--max-connections", type=non_negative_int, default=None,
        help="open client connections beyond which a new one is answered 503 and closed at once; "
        "default: the open-file limit less a tenth (at least 128) kept for everything else; 0: no limit",
    )
    return parser


def env_name(action: argparse.Action) -> str:
    """`--request-ttl-secs` -> `DYNAMO_LITE_REQUEST_TTL_SECS`."""
    return ENV_PREFIX + action.dest.upper()


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with each option's default taken from `DYNAMO_LITE_<DEST>`
    when that variable is set, converted and checked like the flag's own value; a bad value
    exits with status 2 and a message naming the variable. Flags given in `argv` win. Every
    option's --help text names its variable."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if not action.option_strings or action.dest == argparse.SUPPRESS or action.default == argparse.SUPPRESS:
            continue  # positionals, --help, --version
        name = env_name(action)
        if action.help != argparse.SUPPRESS and name not in (action.help or ""):
            action.help = f"{action.help or ''} [env {name}]".lstrip()
        text = environ.get(name)
        if text is not None:
            action.default = _env_value(parser, action, name, text)
    return parser.parse_args(argv)


def _env_value(parser: argparse.ArgumentParser, action: argparse.Action, name: str, text: str) -> Any:
    if action.nargs == 0:  # store_true / store_false / store_const
        flag = text.strip().lower()
        if flag not in _TRUE | _FALSE:
            parser.error(f"environment variable {name}={text!r}: expected one of 1, true, yes, on, 0, false, no, off")
        if isinstance(action.const, bool) or isinstance(action, argparse.BooleanOptionalAction):
            # the variable holds the value of `dest`
            return flag in _TRUE
        return action.const if flag in _TRUE else action.default
    if action.nargs not in (None, "?"):
        raise TypeError(f"{action.option_strings[0]} takes nargs={action.nargs!r}: not settable from {name}")
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        parser.error(f"environment variable {name}={text!r}: {exc or 'invalid value'}")
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(repr, action.choices))
        parser.error(f"environment variable {name}={text!r}: invalid choice (choose from {choices})")
    return value


# Argument types. Each says what is wrong in words: argparse prefixes the flag ("argument
# --port: 'abc' is not a TCP port"), where a bare int() would make it "invalid _port value".


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def port_number(text: str) -> int:
    """A TCP port (0..65535), as argparse's `type=`."""
    port = _integer(text, "a TCP port")
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0..65535")
    return port


def non_negative_float(text: str) -> float:
    value = _number(text, "a number")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def positive_int(text: str) -> int:
    value = _integer(text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def default_max_connections(open_files: int) -> int:
    """Connections allowed with `open_files` descriptors: a tenth (at least 128) is kept for
    everything else a process opens (engine sockets, snapshots, logs)."""
    if open_files <= 0:  # RLIM_INFINITY
        return 0
    return max(64, open_files - max(128, open_files // 10))


def positive_float(text: str) -> float:
    value = _number(text, "a number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def peer_urls(text: str) -> tuple[str, ...]:
    """`--peers`: comma-separated base URLs; blanks between commas are ignored."""
    return tuple(url.strip() for url in text.split(",") if url.strip())


def add_recovery_arguments(
    parser: argparse.ArgumentParser, *, state: str, peers: str, snapshot_interval_secs: float
) -> None:
    """The flags of a service whose `state` outlives its process: `--peers` and
    `--recovery-timeout-secs` to copy a running replica's at start-up, `--snapshot`,
    `--snapshot-interval-secs` and `--ignore-bad-snapshot` to keep it in a file."""
    parser.add_argument(
        "--peers", type=peer_urls, default="",
        help=f"comma-separated base URLs of {peers} to copy the {state} from at start-up, first reachable wins",
    )
    parser.add_argument(
        "--recovery-timeout-secs", type=positive_float, default=10.0,
        help="how long start-up keeps trying the peers before it gives up on them",
    )
    parser.add_argument(
        "--snapshot", default=None, metavar="PATH",
        help=f"load the {state} from this file at start-up (when it exists) and write it there "
        "atomically, in the /dump format, periodically and at shutdown",
    )
    parser.add_argument(
        "--snapshot-interval-secs", type=positive_float, default=snapshot_interval_secs,
        help="seconds between two snapshots",
    )
    parser.add_argument(
        "--ignore-bad-snapshot", action="store_true",
        help="when the snapshot cannot be read, move it to PATH.bad and start empty instead of "
        "refusing to start",
    )


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """`--api-key` and friends (see `dynamo_lite.web.auth` and docs/security.md)."""
    group = parser.add_argument_group(
        "API keys", "without a key every route is open, as in Dynamo; with one, every route but /health and "
        "/ready needs `Authorization: Bearer KEY` (401 otherwise)"
    )
    group.add_argument("--api-key", type=key_list, default=[], metavar="KEY[,KEY...]",
                       help="full keys (every route); several, comma-separated, while rotating. Prefer "
                       "--api-key-file or the environment: a command line is visible to every local user")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="file of full keys, one per line (# comments and blank lines skipped), added to --api-key")
    group.add_argument("--read-api-key", type=key_list, default=[], metavar="KEY[,KEY...]",
                       help="read-only keys: the query routes (GET, /potential_loads, /query, /query_by_hash), "
                       "not the writes nor /dump (403)")
    group.add_argument("--read-api-key-file", default=None, metavar="PATH",
                       help="file of read-only keys, one per line, added to --read-api-key")
    group.add_argument("--public-metrics", action=argparse.BooleanOptionalAction, default=False,
                       help="serve /metrics without a key (by default any key, read-only included, may scrape it)")
    tls = parser.add_argument_group(
        "TLS", "uvicorn's flags; the files are re-read on SIGHUP and when they change, without a restart"
    )
    tls.add_argument("--ssl-certfile", default=None, metavar="PATH",
                     help="PEM certificate (chain): serve https only")
    tls.add_argument("--ssl-keyfile", default=None, metavar="PATH",
                     help="PEM private key of --ssl-certfile (default: in --ssl-certfile)")
    tls.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                     help="CA bundle: clients must present a certificate it signed (mutual TLS). Calls to "
                     "--peers then present --ssl-certfile and check the peer's against this bundle")


def key_files(args: argparse.Namespace) -> KeyFiles | None:
    """The keys of `add_security_arguments`' flags (kept up to date with their files), or None
    when none is given; ValueError for a key file that cannot be read or keys that cannot be used."""
    sources = (args.api_key, args.read_api_key, args.api_key_file, args.read_api_key_file)
    write, read = read_keys(*sources)
    if not write and not read:
        return None
    return KeyFiles(ApiKeys.from_texts(write, read, public_metrics=args.public_metrics), *sources)


def add_client_arguments(parser: argparse.ArgumentParser, *, api_key_flag: str = "--api-key",
                         default_key: str = "DYNAMO_LITE_API_KEY (its first key when it lists several)") -> None:
    """The flags of a program that calls the services: the key it sends and its TLS settings.
    `api_key_flag` names the key's flag (its `dest` follows the name); `default_key` says, in
    its help, what is sent without it."""
    group = parser.add_argument_group("calling the services (API key, TLS)")
    group.add_argument(api_key_flag, dest=_dest(api_key_flag), default=None, metavar="KEY",
                       help="API key sent to the slot tracker and the indexer (`Authorization: Bearer KEY`); "
                       f"default: {default_key}")
    group.add_argument("--services-ca-certs", default=None, metavar="PATH",
                       help="CA bundle that signed the services' certificates (https:// URLs); default: the system's")
    group.add_argument("--services-certfile", default=None, metavar="PATH",
                       help="client certificate (PEM) for services that require one (--ssl-ca-certs: mutual TLS)")
    group.add_argument("--services-keyfile", default=None, metavar="PATH", help="private key of --services-certfile")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def client_credentials_from(args: argparse.Namespace, *, api_key_flag: str = "--api-key",
                            default_key: str | None = None) -> ClientCredentials:
    """What `add_client_arguments`' flags say to present to the services; without the key's
    flag, `default_key`, else DYNAMO_LITE_API_KEY's first key."""
    text: str | None = getattr(args, _dest(api_key_flag))
    if text is not None:
        keys = key_list(text)
        api_key = keys[0] if keys else None
    else:
        api_key = default_key or api_key_from_env()
    cert = None
    if args.services_certfile:
        cert = (args.services_certfile, args.services_keyfile) if args.services_keyfile else args.services_certfile
    return ClientCredentials(api_key or None, args.services_ca_certs or True, cert)


def check_security_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Read the keys now (`args.api_keys`), so that a bad key file stops the command with
    status 2 and a message, like any bad flag."""
    try:
        args.key_files = key_files(args)
    except ValueError as exc:
        parser.error(str(exc))
    args.api_keys = args.key_files.api_keys if args.key_files is not None else None
    args.tls = None
    if args.ssl_certfile:
        try:
            args.tls = ReloadingContext(TlsFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs))
        except (OSError, ssl.SSLError) as exc:
            parser.error(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs cannot be used: {exc}")
    elif args.ssl_keyfile or args.ssl_ca_certs:
        parser.error("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile")


def peer_credentials(args: argparse.Namespace) -> ClientCredentials:
    """What a service presents to its `--peers`: its first full key (their `/dump` needs one);
    with `--ssl-ca-certs`, its own certificate, and the peers' checked against that bundle (one
    CA for the fleet)."""
    keys: ApiKeys | None = args.api_keys
    api_key = keys.write_keys[0].decode() if keys is not None and keys.write_keys else None
    if not args.ssl_ca_certs:
        return ClientCredentials(api_key)
    cert = (args.ssl_certfile, args.ssl_keyfile) if args.ssl_keyfile else args.ssl_certfile
    return ClientCredentials(api_key, args.ssl_ca_certs, cert)


GcThresholds = tuple[int, int, int]
DEFAULT_GC_THRESHOLDS: GcThresholds = (50_000, 20, 100)
# Collect the young generation only: older generations are never scanned automatically (see
# `tune_garbage_collector`); the service runs a full collection on a timer instead.
YOUNG_ONLY_GC_THRESHOLDS: GcThresholds = (20_000, 2**30, 2**30)


def tune_garbage_collector(thresholds: GcThresholds = DEFAULT_GC_THRESHOLDS) -> None:
    """Collect the young generation far less often.

    Both cores free what they drop by reference counting (the index tree unlinks parent and
    child when it prunes), so frequent cyclic collections only rescan a large, long-lived heap:
    with the default thresholds they cost a third of the indexer's event ingest (core
    benchmark, separate processes: 480k-590k blocks/s by default, 750k-940k tuned).
    Objects alive at start-up are frozen out of collection altogether.

    `YOUNG_ONLY_GC_THRESHOLDS` is for a large, growing heap (the indexer's tree): every object
    that survives a young collection moves to a generation that is never collected on its own,
    because such a collection scans all of it (bench/ANALYSIS.md has the pauses measured). The
    tree's nodes are outside the collector (`dynamo_lite.indexer.tree.Node`), so a full
    collection stays short; whatever becomes cyclic garbage waits for the service's periodic
    full collection.
    """
    gc.set_threshold(*thresholds)
    gc.freeze()


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit and return it.

    Every client connection is a file descriptor; a soft limit of 1024 (systemd's default)
    would refuse connections long before memory or CPU run out.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (OSError, ValueError):  # e.g. macOS refuses RLIM_INFINITY: keep the soft limit
            pass
    return soft


def serve(app: Service, args: argparse.Namespace, *, gc_thresholds: GcThresholds = DEFAULT_GC_THRESHOLDS) -> None:
    """Run until SIGINT/SIGTERM on the native server (`dynamo_lite.web.server`): it stops accepting,
    answers the requests in flight (up to 10 s), then runs the app's lifespan shutdown (the
    indexer's final snapshot) and returns, so the process exits with status 0."""
    access_log = AccessLog(args.trace_id_header) if args.access_log else None
    tune_garbage_collector(gc_thresholds)
    open_files = raise_open_file_limit()
    max_connections = args.max_connections
    if max_connections is None:
        max_connections = default_max_connections(open_files)
    limits = ConnectionLimits(args.header_timeout_secs, max_connections, args.keep_alive_secs)
    app.metrics_registry.register(ConnectionCollector(limits))
    keys = getattr(args, "api_keys", None)
    if keys is not None:
        app.protect(keys)
    tls = getattr(args, "tls", None)
    if tls is not None:
        app.metrics_registry.register(TlsCollector(tls))
    files = getattr(args, "key_files", None)
    run(app, args.host, args.port, limits, access_log, tls, [files] if files is not None and files.paths else [])
