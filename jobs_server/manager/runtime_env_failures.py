"""One-paragraph messages for runtime envs that Ray's agent could not set up.

Ray reports such a failure as `RuntimeEnvSetupError` whose text is the agent's whole traceback,
often several chained ones. A job's status message should instead say which part of the runtime
env failed (the field and its URI) and why (HTTP 404, connection refused, not a zip, NoSuchKey,
pip's own error line), in a line a person reads. It starts with the words of Ray's own server
(`runtime_env setup failed: Failed to set up runtime environment`), which scripts match.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jobs_server.errors import InvalidRuntimeEnvError
from jobs_server.manager.runtime_envs import PackageRef, package_refs

MAX_CAUSE_CHARS = 500
# Ray's server says `runtime_env setup failed: {RuntimeEnvSetupError}`, and the error's text
# begins `Failed to set up runtime environment.`: the same words start ours.
SETUP_FAILED_PREFIX = "runtime_env setup failed: Failed to set up runtime environment."

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def strip_ansi(text: str) -> str:
    """Ray's error texts carry terminal colour codes; a status message does not."""
    return _ANSI_ESCAPE.sub("", text)


# The line that ends a Python traceback: `module.Name: message`, or a bare `Name`.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?::\s.*)?$")
_NODE = re.compile(r"\[Node ([^\]\s]+)\]")
# smart_open names an S3 object by bucket and key, not by its URI.
_S3_OBJECT = re.compile(r"bucket: '([^']+)' key: '([^']+)'")
# The plugin's module in the agent's traceback tells which field was being set up.
_PLUGIN_FRAMES = {"working_dir": "working_dir.py", "py_modules": "py_modules.py"}


def _http_status(match: re.Match[str]) -> str:
    return f"HTTP {match[1]} {match[2]}"


def _s3_error(match: re.Match[str]) -> str:
    return f"{match[1]} ({match[2].strip()})"


def _os_error(match: re.Match[str]) -> str:
    return f"cannot connect ({match[1].strip()})"


def _http_timeout(match: re.Match[str]) -> str:
    return f"no answer within {match[2]} s ({match[1]} timeout)"


def _bad_zip(match: re.Match[str]) -> str:
    return f"not a zip archive ({match[1].strip()})"


def _missing_gcs_package(match: re.Match[str]) -> str:
    return (
        "the package is not in the cluster's GCS (it was never uploaded, or Ray "
        "garbage-collected it after its last use)"
    )


def _setup_timeout(match: re.Match[str]) -> str:
    return (
        f"Timeout: not set up within {match[1]} s (raise runtime_env config "
        "setup_timeout_seconds if it needs longer)"
    )


def _command_error(match: re.Match[str]) -> str:
    # Ray keeps the last lines of a failed command (pip's, for one) indented under this
    # heading; the command's own last `ERROR:` line names what failed, e.g. the package.
    errors = re.findall(r"^\s+ERROR: (.+)$", match[2], re.MULTILINE)
    output_lines = [line.strip() for line in match[2].splitlines() if line.strip()]
    line = errors[-1] if errors else (output_lines[-1] if output_lines else "")
    command = "pip install" if "pip" in match[1] else "a setup command"
    return f"{command} failed: {line}" if line else f"{command} failed"


# First match wins: the specific causes Ray's agent meets fetching an archive, most telling first.
_CAUSES: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = (
    (
        re.compile(r"Failed to install runtime_env within the timeout of (\d+) seconds"),
        _setup_timeout,
    ),
    (
        re.compile(
            r"SubprocessCalledProcessError: Run cmd\[\d+\] failed[^\n]*\n(.*?)\n"
            r"Last \d+ lines of (?:stdout|stderr):\n((?:[ \t]+[^\n]*(?:\n|$))+)"
        ),
        _command_error,
    ),
    (re.compile(r"(\d{3}) (?:Client|Server) Error: (.*?) for url: "), _http_status),
    (
        re.compile(r"An error occurred \((\w+)\) when calling the \w+ operation: ([^\n]*)"),
        _s3_error,
    ),
    (re.compile(r"timed out\. \((read|connect) timeout=([\d.]+)\)"), _http_timeout),
    (re.compile(r"\[Errno -?\d+\] ([^\"'()\n]+)"), _os_error),
    (re.compile(r"BadZipFile: ([^\n]*)"), _bad_zip),
    (
        re.compile(r"Failed to download runtime_env file package \S+ from the GCS"),
        _missing_gcs_package,
    ),
)


def describe_setup_failure(error_text: str, runtime_env: dict[str, Any]) -> str:
    """`runtime_env setup failed: Failed to set up runtime environment. <field> '<uri>':
    <cause> (on node <ip>).`, on one line."""
    text = strip_ansi(error_text)
    parts = _failed_parts(text, runtime_env)
    message = SETUP_FAILED_PREFIX + " "
    if parts:
        message += " or ".join(f"{ref.field} {ref.uri!r}" for ref in parts) + ": "
    message += _cause(text)
    node = _NODE.search(text)
    if node:
        message += f" (on node {node[1]})"
    return " ".join(message.split()) + "."


def _failed_parts(text: str, runtime_env: dict[str, Any]) -> list[PackageRef]:
    """The packages the error is about: those it names, else those of the failing plugin."""
    try:
        refs = package_refs(runtime_env)
    except InvalidRuntimeEnvError:  # a record from before these checks: the cause alone
        return []
    s3_objects = {f"s3://{bucket}/{key}" for bucket, key in _S3_OBJECT.findall(text)}
    mentioned = [ref for ref in refs if ref.uri in text or ref.uri in s3_objects]
    if mentioned:
        return mentioned
    return [ref for ref in refs if _PLUGIN_FRAMES[ref.field.split("[")[0]] in text]


def _cause(text: str) -> str:
    for pattern, describe in _CAUSES:
        match = pattern.search(text)
        if match:
            return describe(match)
    lines = [line for line in text.splitlines() if _EXCEPTION_LINE.match(line)]
    cause = lines[-1] if lines else (text.strip().splitlines() or ["unknown error"])[-1]
    return cause[:MAX_CAUSE_CHARS]
