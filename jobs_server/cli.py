"""The `jobs-server` command: `serve` runs the server; the other commands are the terminal
client (jobs_server/client), which must start fast: only `serve` imports the server, pydantic
and Ray, and only when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jobs_server import __version__
from jobs_server.client.commands import USAGE_EXIT_CODE, add_client_commands, run_client_command

if TYPE_CHECKING:
    import ssl

    from jobs_server.settings import Settings

logger = logging.getLogger(__name__)
SERVE = "serve"
HASH_TOKEN = "hash-token"
# Allocations between two collections of the youngest generation (see _freeze_startup_objects).
GC_YOUNG_THRESHOLD = 10_000


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser(*, serve_options: bool = True) -> argparse.ArgumentParser:
    """The serve command with one flag per Settings field (so every option has a flag and a
    JOBS_SERVER_* variable; left out when another command runs, to keep pydantic unimported),
    and the client's commands."""
    parser = argparse.ArgumentParser(
        prog="jobs-server",
        description="A Ray-compatible HTTP job server (`serve`) and its terminal client.",
    )
    parser.add_argument("--version", action="version", version=f"jobs-server {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        SERVE,
        help="run the server",
        description="Run the job server. Flags override JOBS_SERVER_* environment variables.",
    )
    hash_token = commands.add_parser(
        HASH_TOKEN,
        help="print a new API key and its digest for the tokens file",
        description=(
            "Print a new random API key (give it to its user) and its sha256 digest (put that"
            " in the --tokens-file). With --stdin, the digest of a key read from stdin instead."
        ),
    )
    hash_token.add_argument(
        "--stdin", action="store_true", help="hash the key on stdin's first line instead"
    )
    add_client_commands(commands)
    if serve_options:
        _add_serve_options(serve)
    return parser


def _add_serve_options(serve: argparse.ArgumentParser) -> None:
    from jobs_server.settings import Settings

    for name, field in Settings.model_fields.items():
        env_var = f"JOBS_SERVER_{name.upper()}"
        if name == "ray_address":
            env_var += " or RAY_ADDRESS"
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("cli") is False:
            continue
        help_text = f"{field.description} [env: {env_var}]"
        if field.annotation is bool:
            serve.add_argument(
                _flag(name),
                dest=name,
                action="store_true",
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        default = field.default_factory() if field.default_factory else field.default  # type: ignore[call-arg]
        serve.add_argument(
            _flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{help_text} (default: {default})",
        )


def load_settings(flags: dict[str, Any]) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    from jobs_server.settings import Settings

    return Settings(**flags)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(serve_options=_command_of(argv) == SERVE)
    args = parser.parse_args(argv)
    if args.command is None:
        print(
            "jobs-server: no command given; to run the server, try `jobs-server serve`"
            " (`jobs-server serve --help` lists its options)\n",
            file=sys.stderr,
        )
        parser.print_help(sys.stderr)
        sys.exit(USAGE_EXIT_CODE)
    if args.command == HASH_TOKEN:
        sys.exit(print_new_key(from_stdin=args.stdin))
    if args.command != SERVE:
        sys.exit(run_client_command(args))
    flags = vars(args)
    flags.pop("command")
    serve(flags)


def print_new_key(*, from_stdin: bool) -> int:
    """`hash-token`: a new key and its digest (or the digest of the key on stdin)."""
    from jobs_server.access.key_digest import digest_of, new_api_key

    if from_stdin:
        key = sys.stdin.readline().strip()
        if not key:
            print("jobs-server hash-token: no key on stdin", file=sys.stderr)
            return USAGE_EXIT_CODE
        print(f'digest = "{digest_of(key)}"')
        return 0
    key = new_api_key()
    print(f"key: {key}")
    print(f'digest = "{digest_of(key)}"')
    return 0


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    return next((word for word in argv if not word.startswith("-")), None)


def serve(flags: dict[str, Any]) -> None:
    """Run the server with these flags over the environment, until SIGTERM or SIGINT."""
    import ssl

    from aiohttp import web
    from pydantic import ValidationError

    from jobs_server.access.auth import TokenSourceError, resolve_auth_token
    from jobs_server.access.tokens import TokensFileError, load_tokens_file
    from jobs_server.app import create_app, exit_without_ray, left_the_cluster_gone
    from jobs_server.manager.archive.schema_versions import SchemaUpgradeError
    from jobs_server.manager.tenancy import RunAs
    from jobs_server.serving.request_body import describe_validation_error
    from jobs_server.state_dir import StateDirError, lock_state_dir
    from jobs_server.webhooks.signing import read_secret_file
    from jobs_server.webhooks.targets import TargetPolicy

    try:
        settings = load_settings(flags)
    except ValidationError as error:
        sys.exit(f"jobs-server: {describe_validation_error(error)}")
    _forget_secrets_in_environment()
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Before Ray or the archive is touched: a second server on the state dir would hand the
    # same queued jobs over twice. Held until the process ends.
    try:
        state_dir_lock = lock_state_dir(settings.state_dir)
    except StateDirError as error:
        sys.exit(f"jobs-server: {error}")
    try:
        token = resolve_auth_token(settings)
        users = set()
        if settings.tokens_file is not None:
            # Checked whole, webhook URLs by the server's own policy: an error is no start.
            tokens = load_tokens_file(
                settings.tokens_file, target_policy=TargetPolicy.from_settings(settings)
            )
            users = {limits.run_as.name for limits in tokens.limits.values() if limits.run_as}
        if settings.jobs_user is not None:
            RunAs.of(settings.jobs_user)
            users.add(settings.jobs_user)
        if users and not _can_change_user():
            sys.exit(
                f"jobs-server: jobs are to run as {', '.join(sorted(users))} (--jobs-user,"
                " run_as), but this server cannot change user: it needs root or CAP_SETUID and"
                " CAP_SETGID"
            )
        if settings.webhook_secret_file is not None:
            read_secret_file(settings.webhook_secret_file)  # WebhookSecretError: a ValueError
        ssl_context = _ssl_context(settings)
    except (TokenSourceError, TokensFileError, OSError, ssl.SSLError, ValueError) as error:
        sys.exit(f"jobs-server: {error}")
    has_keys = token is not None or settings.tokens_file is not None
    _check_bind(settings, has_token=has_keys)
    logger.info(
        "jobs-server %s listening on %s://%s:%d (%s)",
        __version__,
        "https" if ssl_context else "http",
        settings.host,
        settings.port,
        "key required" if has_keys else "no authentication",
    )
    app = create_app(settings)
    app.on_startup.append(_freeze_startup_objects)
    try:
        web.run_app(
            app,
            host=settings.host,
            port=settings.port,
            ssl_context=ssl_context,
            print=None,
            shutdown_timeout=settings.shutdown_timeout_s,
            access_log_format='%a "%r" %s %b %Tfs',
        )
    except SchemaUpgradeError as error:
        sys.exit(f"jobs-server: {error}")
    except Exception:
        if not left_the_cluster_gone(app):
            raise
        logger.exception("the shutdown failed")
        exit_without_ray(1)
    finally:
        state_dir_lock.release()
    if left_the_cluster_gone(app):
        exit_without_ray(0)


async def _freeze_startup_objects(_: object) -> None:
    """Once started (Ray joined, the manager up): what the server holds from its start lives as
    long as it does (Ray's, aiohttp's and pydantic's modules: about 120,000 objects), so it is
    moved out of the garbage collector's reach. Each full collection then walks only what
    the server made since; with 10,000 jobs queued that took its pauses from 0.4 s to 0.05 s
    (a submit waits through them).

    Then the youngest generation is collected after GC_YOUNG_THRESHOLD allocations instead of
    CPython's 700: a request allocates and frees hundreds of objects, and at 700 a burst of
    submits ran about 60 collections a second (in 10 s of a burst: 0.7 s of the event loop, and
    pauses up to 25-77 ms when one reached the oldest generation). At 10,000: a dozen, 0.1 s in
    all. Cyclic garbage waits a little longer for its collection: at most that many objects."""
    import gc

    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def _forget_secrets_in_environment() -> None:
    """The token and the database URL (its password) are in Settings now; no child process
    may inherit them: not an embedded Ray's processes, nor through them the supervisors and
    every job."""
    from jobs_server.settings import SECRET_ENV_VARS

    for name in list(os.environ):
        if name.upper() in SECRET_ENV_VARS:
            del os.environ[name]


# Bits of the effective capability set (/proc/self/status CapEff; linux/capability.h).
_CAP_SETGID, _CAP_SETUID = 6, 7


def _can_change_user() -> bool:
    """Whether this process may set its uid and groups (a job's start changes them)."""
    if os.geteuid() == 0:
        return True
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    effective = int(line.split()[1], 16)
                    return all(effective >> cap & 1 for cap in (_CAP_SETGID, _CAP_SETUID))
    except OSError:
        pass
    return False


def _check_bind(settings: Settings, *, has_token: bool) -> None:
    """Refuse to expose an unauthenticated server beyond this machine: it runs shell commands."""
    from jobs_server.access.auth import is_loopback

    if has_token or is_loopback(settings.host):
        return
    if not settings.insecure_no_auth:
        sys.exit(
            f"jobs-server: refusing to listen on {settings.host} without a token: anyone who can"
            " reach it could run commands here. Set JOBS_SERVER_AUTH_TOKEN, --auth-token-file or"
            " --tokens-file, or pass --insecure-no-auth if something else protects it."
        )
    logger.warning(
        "listening on %s WITHOUT authentication (--insecure-no-auth): anyone who can reach this"
        " port can run commands as this user",
        settings.host,
    )


def _ssl_context(settings: Settings) -> ssl.SSLContext | None:
    import ssl

    if settings.tls_cert is None or settings.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.tls_cert, settings.tls_key)
    return context
