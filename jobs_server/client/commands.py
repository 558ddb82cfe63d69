"""The client's subcommands: their options, and what each does with a JobsClient."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jobs_server.client.follow import follow_log, wait_for_end
from jobs_server.client.http import (
    DEFAULT_URL,
    TOKEN_ENV_VAR,
    URL_ENV_VAR,
    ClientError,
    Connection,
    JobsClient,
    UsageError,
)
from jobs_server.client.interrupt import watch_until_done
from jobs_server.client.output import format_time, print_job, print_job_table, print_json

Handler = Callable[[JobsClient, argparse.Namespace], Awaitable[int]]
USAGE_EXIT_CODE = 2
INTERRUPTED_EXIT_CODE = 130


def add_client_commands(commands: Any) -> None:
    """Add submit, logs, list, status, stop, delete and webhooks to the CLI's subparsers."""
    server = argparse.ArgumentParser(add_help=False)
    options = server.add_argument_group("server")
    options.add_argument(
        "--url", help=f"the server's address [env: {URL_ENV_VAR}] (default: {DEFAULT_URL})"
    )
    options.add_argument(
        "--token-file",
        type=Path,
        help=f"a file whose first line is the key [default: the key in {TOKEN_ENV_VAR}]",
    )
    interrupt = argparse.ArgumentParser(add_help=False)
    interrupt.add_argument(
        "--stop-on-interrupt",
        action="store_true",
        help="Ctrl-C stops the job (by default a terminal asks; elsewhere the job keeps running)",
    )

    submit = commands.add_parser(
        "submit",
        parents=[server, interrupt],
        help="submit a shell command as a job",
        description="Submit CMD as a job and print its submission id. One argument is run as a"
        " shell command as it is; several are quoted each (`-- sh -c 'echo hi; exit 3'` runs those"
        " three words), as `ray job submit` does.",
    )
    waiting = submit.add_mutually_exclusive_group()
    waiting.add_argument(
        "--wait", action="store_true", help="wait for the job to end; exit with its exit code"
    )
    waiting.add_argument(
        "--follow",
        action="store_true",
        help="print the log as it grows until the job ends; exit with its exit code",
    )
    submit.add_argument("--submission-id", help="the job's id (default: one the server makes)")
    submit.add_argument(
        "--working-dir",
        type=_url,
        metavar="URL",
        help="run in this archive (https://, s3://, gcs://...; see runtime_env.working_dir)",
    )
    submit.add_argument(
        "--env",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable of the job (repeat for more)",
    )
    submit.add_argument(
        "--metadata",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a metadata entry of the job (repeat for more)",
    )
    queue = submit.add_argument_group("queue and retries (checked by the server)")
    queue.add_argument(
        "--priority",
        type=int,
        metavar="N",
        help="among queued jobs, higher runs first (default 0; the server says the bounds)",
    )
    queue.add_argument(
        "--max-retries",
        type=int,
        metavar="N",
        help="failed attempts retried after the first (default 0)",
    )
    queue.add_argument(
        "--retry-on-exit-code",
        type=int,
        action="append",
        dest="retry_on_exit_codes",
        metavar="CODE",
        help="retry only an attempt that exits with CODE (repeat for more; default: any"
        " non-zero code)",
    )
    chain = submit.add_argument_group(
        "dependencies and webhooks", "the job waits (PENDING) until every dependency holds"
    )
    for option, condition, what in (
        ("--after", "succeeded", "has succeeded (Slurm's afterok)"),
        ("--after-failed", "failed", "has failed or was stopped (afternotok)"),
        ("--after-any", "ended", "has ended, however (afterany)"),
    ):
        chain.add_argument(
            option,
            type=_dependency(condition),
            action="append",
            dest="depends_on",
            metavar="ID",
            help=f"run once job ID {what} (repeat for more)",
        )
    chain.add_argument(
        "--notify",
        type=_webhook_url,
        action="append",
        metavar="URL",
        help="POST every event of the job to URL, signed (repeat for more; the server decides"
        " which addresses it may call)",
    )
    submit.add_argument("cmd", nargs="+", metavar="CMD", help="the command, after `--`")
    submit.set_defaults(client_command=run_submit)

    logs = commands.add_parser(
        "logs",
        parents=[server, interrupt],
        help="print a job's log",
        description="Print the job's log as it is now, or with -f as it grows until the job"
        " ends (then exit with the job's exit code).",
    )
    logs.add_argument("-f", "--follow", action="store_true", help="follow the log to the end")
    logs.add_argument("job_id", metavar="ID")
    logs.set_defaults(client_command=run_logs)

    listing = commands.add_parser("list", parents=[server], help="list jobs")
    listing.add_argument("--status", help="comma-separated statuses, e.g. RUNNING,PENDING")
    listing.add_argument("--limit", type=int, help="at most this many jobs")
    listing.add_argument("--json", action="store_true", help="the server's JSON")
    listing.set_defaults(client_command=run_list)

    status = commands.add_parser("status", parents=[server], help="show a job")
    status.add_argument("job_id", metavar="ID")
    status.add_argument("--json", action="store_true", help="the server's JSON")
    status.set_defaults(client_command=run_status)

    stop = commands.add_parser("stop", parents=[server], help="stop a job")
    stop.add_argument("job_id", metavar="ID")
    stop.add_argument(
        "--grace-period-s",
        type=float,
        help="seconds between SIGTERM and SIGKILL (default: the server's --stop-grace-s)",
    )
    stop.set_defaults(client_command=run_stop)

    delete = commands.add_parser(
        "delete", parents=[server], help="forget a job that has ended, and its log"
    )
    delete.add_argument("job_id", metavar="ID")
    delete.set_defaults(client_command=run_delete)

    webhooks = commands.add_parser(
        "webhooks",
        help="webhook endpoints a 410 Gone disabled: list them, enable one again",
        description="An endpoint that answered 410 Gone is disabled for its tenant: no delivery"
        " is written for it until it is enabled again.",
    )
    endpoints = webhooks.add_subparsers(
        dest="webhooks_command", metavar="{disabled,enable}", required=True
    )
    disabled = endpoints.add_parser(
        "disabled",
        parents=[server],
        help="list the disabled endpoints (your tenant's; an admin key: every tenant's)",
    )
    disabled.add_argument("--tenant", help="only this tenant's (an admin key's option)")
    disabled.add_argument("--json", action="store_true", help="the server's JSON")
    disabled.set_defaults(client_command=run_webhooks_disabled)
    enable = endpoints.add_parser(
        "enable",
        parents=[server],
        help="enable a disabled endpoint: deliveries are written again from the next event on",
        description="Enable URL for your tenant (an admin key: for --tenant). Deliveries are"
        " written for it again from the next event on; those that ended disabled stay ended.",
    )
    enable.add_argument("endpoint_url", type=_webhook_url, metavar="URL")
    enable.add_argument("--tenant", help="the endpoint's tenant (an admin key's option)")
    enable.set_defaults(client_command=run_webhooks_enable)


def run_client_command(args: argparse.Namespace) -> int:
    """Run the parsed client command; its exit code (1 for an error, said on stderr)."""
    handler: Handler = args.client_command
    try:
        connection = Connection.from_options(args.url, args.token_file)
        return asyncio.run(_with_client(connection, handler, args))
    except UsageError as error:
        print(f"jobs-server: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except ClientError as error:
        print(f"jobs-server: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside a follow: nothing to ask about
        return INTERRUPTED_EXIT_CODE
    except BrokenPipeError:  # `jobs-server logs ID | head`: the reader has all it wants
        # Python would complain again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


async def _with_client(connection: Connection, handler: Handler, args: argparse.Namespace) -> int:
    async with JobsClient(connection) as client:
        return await handler(client, args)


def entrypoint_of(words: list[str]) -> str:
    """One word is a shell command as it is; several are quoted each, as `ray job submit`
    does, so that the same words run the same command under either client."""
    if len(words) == 1:
        return words[0]
    return shlex.join(words)


async def run_submit(client: JobsClient, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"entrypoint": entrypoint_of(args.cmd)}
    if args.submission_id:
        body["submission_id"] = args.submission_id
    runtime_env: dict[str, Any] = {}
    if args.working_dir:
        runtime_env["working_dir"] = args.working_dir
    if args.env:
        runtime_env["env_vars"] = dict(args.env)
    if runtime_env:
        body["runtime_env"] = runtime_env
    if args.metadata:
        body["metadata"] = dict(args.metadata)
    for field in ("priority", "max_retries", "retry_on_exit_codes", "depends_on"):
        if getattr(args, field) is not None:
            body[field] = getattr(args, field)
    if args.notify:
        body["notify"] = [{"url": url} for url in args.notify]
    job_id = await client.submit_job(body)
    if args.follow:
        print(f"jobs-server: submitted {job_id}", file=sys.stderr, flush=True)
        following = follow_log(client, job_id, sys.stdout.buffer)
        return await watch_until_done(
            client, job_id, following, stop_on_interrupt=args.stop_on_interrupt
        )
    print(job_id, flush=True)
    if not args.wait:
        return 0
    code = await watch_until_done(
        client, job_id, wait_for_end(client, job_id), stop_on_interrupt=args.stop_on_interrupt
    )
    job = await client.get_job(job_id)
    print(f"jobs-server: {job_id} {job['status']}: {job.get('message')}", file=sys.stderr)
    return code


async def run_logs(client: JobsClient, args: argparse.Namespace) -> int:
    if not args.follow:
        await client.write_log(args.job_id, sys.stdout.buffer)
        return 0
    following = follow_log(client, args.job_id, sys.stdout.buffer)
    return await watch_until_done(
        client, args.job_id, following, stop_on_interrupt=args.stop_on_interrupt
    )


async def run_list(client: JobsClient, args: argparse.Namespace) -> int:
    jobs = await client.list_jobs(status=args.status, limit=args.limit)
    if args.json:
        print_json(jobs, sys.stdout)
    else:
        print_job_table(jobs, sys.stdout)
    return 0


async def run_status(client: JobsClient, args: argparse.Namespace) -> int:
    job = await client.get_job(args.job_id)
    if args.json:
        print_json(job, sys.stdout)
    else:
        print_job(job, sys.stdout, deliveries=await client.get_deliveries(args.job_id))
    return 0


async def run_stop(client: JobsClient, args: argparse.Namespace) -> int:
    if await client.stop_job(args.job_id, args.grace_period_s):
        print(f"stopping {args.job_id}")
    else:
        job = await client.get_job(args.job_id)
        print(f"{args.job_id} had already ended ({job['status']})")
    return 0


async def run_delete(client: JobsClient, args: argparse.Namespace) -> int:
    await client.delete_job(args.job_id)
    print(f"deleted {args.job_id}")
    return 0


async def run_webhooks_disabled(client: JobsClient, args: argparse.Namespace) -> int:
    endpoints = await client.list_disabled_webhooks(tenant=args.tenant)
    if args.json:
        print_json({"endpoints": endpoints}, sys.stdout)
        return 0
    rows = [("TENANT", "DISABLED", "URL")]
    rows += [
        (str(each.get("tenant")), format_time(each.get("disabled_at")), str(each.get("url")))
        for each in endpoints
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for tenant, when, url in rows:
        print(f"{tenant.ljust(widths[0])}  {when.ljust(widths[1])}  {url}")
    return 0


async def run_webhooks_enable(client: JobsClient, args: argparse.Namespace) -> int:
    enabled = await client.enable_webhook(args.endpoint_url, tenant=args.tenant)
    print(f"enabled {enabled['url']} for tenant {enabled['tenant']}")
    return 0


def _key_value(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _dependency(condition: str) -> Callable[[str], dict[str, str]]:
    """An `--after*` option's ID as a `depends_on` entry with that option's condition."""

    def dependency(job_id: str) -> dict[str, str]:
        if not job_id.strip():
            raise argparse.ArgumentTypeError("expected a job's submission id")
        return {"submission_id": job_id, "condition": condition}

    return dependency


def _webhook_url(text: str) -> str:
    if not text.startswith(("https://", "http://")):
        raise argparse.ArgumentTypeError(f"expected an https:// URL, got {text!r}")
    return text


def _url(text: str) -> str:
    if "://" not in text:
        raise argparse.ArgumentTypeError(
            f"expected a URL (https://, s3://, ...), got {text!r}: the server never reads local"
            " files; `ray job submit --working-dir DIR` uploads a directory"
        )
    return text
