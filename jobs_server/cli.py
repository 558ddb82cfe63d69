"""`jobs-server serve`: build Settings from flags and the environment, then run the app."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from jobs_server import __version__
from jobs_server.app import create_app
from jobs_server.request_body import describe_validation_error
from jobs_server.settings import Settings

logger = logging.getLogger(__name__)


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """One flag per Settings field, so every option has a flag and a JOBS_SERVER_* variable."""
    parser = argparse.ArgumentParser(
        prog="jobs-server", description="A Ray-compatible HTTP job server."
    )
    parser.add_argument("--version", action="version", version=f"jobs-server {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the server",
        description="Run the job server. Flags override JOBS_SERVER_* environment variables.",
    )
    for name, field in Settings.model_fields.items():
        env_var = f"JOBS_SERVER_{name.upper()}"
        if name == "ray_address":
            env_var += " or RAY_ADDRESS"
        serve.add_argument(
            _flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar=name.upper(),
            help=f"{field.description} [env: {env_var}] (default: {field.default})",
        )
    return parser


def load_settings(flags: dict[str, Any]) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    return Settings(**flags)


def main(argv: Sequence[str] | None = None) -> None:
    args = vars(build_parser().parse_args(argv))
    args.pop("command")
    try:
        settings = load_settings(args)
    except ValidationError as error:
        sys.exit(f"jobs-server: {describe_validation_error(error)}")
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logger.info(
        "jobs-server %s listening on http://%s:%d", __version__, settings.host, settings.port
    )
    web.run_app(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        print=None,
        access_log_format='%a "%r" %s %b %Tfs',
    )
