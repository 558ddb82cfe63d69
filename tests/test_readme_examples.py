"""The shell examples of README.md and docs/*.md run top to bottom, as a newcomer pastes them.

Every ```sh block of a document runs, in the document's order, against a real server of that
document's own on a free loopback port (real Ray), from a directory where `.venv/bin` is this
test's virtualenv, as after the README's install command; so each document's examples stand on
their own (an example may use what an earlier one of the same document made). The only change
to the text: the server's default URL, `http://127.0.0.1:8266`, becomes the test server's (and
`JOBS_SERVER_URL` says the same, for the terminal client). A block is left out only when the
line before its fence says so:

    <!-- readme-test: skip, REASON -->

(for blocks that install, start servers or clusters, or run the test suite itself). A block
passes when it exits 0 (`bash -e -o pipefail`) and no answer in its output is an error.
"""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks.webhooks import Webhook

from jobs_server.api_models import JobDetails, WebhookPayload
from jobs_server.manager import JobRecord, JobSpec, JobStatus
from jobs_server.manager.webhook_events import WebhookEventType
from tests.support.processes import free_port, stop_process_group
from tests.support.ray_nodes import kill_actors_in_namespace
from tests.support.servers import start_jobs_server, wait_for_server

# Runs every `sh` block of the docs: servers of their own and package installs.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Every document whose shell examples run: the README, then the docs.
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_URL = "http://127.0.0.1:8266"
SKIP_MARKER = re.compile(r"^<!-- readme-test: skip, (?P<reason>.+) -->$")
BLOCK_TIMEOUT_S = 300
# How the server's JSON errors look; no example may get one.
ERROR_ANSWER = re.compile(r'\{"error": ?\{"code"')


@dataclass(frozen=True)
class ShellBlock:
    line: int  # of the opening fence, 1-based
    code: str
    skip_reason: str | None


def shell_blocks(markdown: str) -> list[ShellBlock]:
    """The ```sh blocks of `markdown` in order, each with the skip marker's reason, if any."""
    blocks, lines = [], markdown.splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```sh":
            start = index
            index += 1
            body = []
            while lines[index].strip() != "```":
                body.append(lines[index])
                index += 1
            marker = SKIP_MARKER.match(lines[start - 1].strip()) if start else None
            reason = marker.group("reason") if marker else None
            blocks.append(ShellBlock(start + 1, "\n".join(body) + "\n", reason))
        index += 1
    return blocks


def test_shell_blocks_are_found_with_their_markers() -> None:
    text = (
        "```sh\necho a\n```\n"
        "<!-- readme-test: skip, starts a server -->\n```sh\nserve\n```\n"
        "```python\nprint()\n```\n```sh\necho b\n```\n"
    )
    assert shell_blocks(text) == [
        ShellBlock(1, "echo a\n", None),
        ShellBlock(5, "serve\n", "starts a server"),
        ShellBlock(11, "echo b\n", None),
    ]


@pytest.fixture
def readme_server(ray_connection: str, tmp_path: Path) -> Iterator[str]:
    """A server of the document's own (its namespace and state dir: the session's default state
    dir is shared), so its `demo-*` ids meet no other test's nor another document's."""
    port, namespace = free_port(), f"test_readme_{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "server.log"
    process = start_jobs_server(
        [
            "--port",
            str(port),
            "--ray-address",
            ray_connection,
            "--state-dir",
            str(tmp_path / "state"),
            "--log-dir",
            str(tmp_path / "logs"),
            "--namespace",
            namespace,
        ],
        log_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, process, log_path)
        yield url
    finally:
        stop_process_group(process)
        kill_actors_in_namespace(namespace)


def test_the_readme_and_every_doc_have_their_examples_checked() -> None:
    runnable = {
        path.relative_to(ROOT).as_posix(): sum(
            block.skip_reason is None for block in shell_blocks(path.read_text())
        )
        for path in DOCUMENTS
    }
    # The README's tour (Use it, the terminal client) and the guide's jobs, logs and retries.
    assert runnable["README.md"] >= 2
    assert runnable["docs/guide.md"] >= 3
    assert runnable["docs/operations.md"] >= 1


def with_examples(paths: list[Path]) -> list[Path]:
    """The documents with at least one block to run (architecture.md has none)."""
    return [
        path
        for path in paths
        if any(block.skip_reason is None for block in shell_blocks(path.read_text()))
    ]


@pytest.mark.parametrize(
    "document", with_examples(DOCUMENTS), ids=lambda path: path.relative_to(ROOT).as_posix()
)
def test_shell_examples_run_in_order(document: Path, readme_server: str, tmp_path: Path) -> None:
    runnable = [block for block in shell_blocks(document.read_text()) if block.skip_reason is None]
    name = document.relative_to(ROOT).as_posix()
    assert all(DEFAULT_URL in block.code for block in runnable), name
    workdir = tmp_path / "newcomer"
    (workdir / ".venv").mkdir(parents=True)
    (workdir / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("JOBS_SERVER_") and name != "RAY_ADDRESS"
    }
    # This checkout's code, whatever the virtualenv's editable install points at.
    environment["PYTHONPATH"] = str(ROOT)
    environment["JOBS_SERVER_URL"] = readme_server
    for block in runnable:
        code = block.code.replace(DEFAULT_URL, readme_server)
        try:
            result = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", code],
                cwd=workdir,
                env=environment,
                capture_output=True,
                text=True,
                timeout=BLOCK_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"{name} line {block.line} still ran after {BLOCK_TIMEOUT_S} s: an example"
                " must end by itself (`curl --max-time`), or be marked"
                " `<!-- readme-test: skip, REASON -->` if it starts a server"
            )
        output = result.stdout + result.stderr
        where = f"{name} line {block.line}:\n{code}\n--- output ---\n{output}"
        assert result.returncode == 0, where
        assert not ERROR_ANSWER.search(output), where


# The README's webhook receiver (issue 36): its Python, run as written.
RECEIVER_MARKER = "<!-- readme-test: webhook receiver -->"


def marked_python_block(markdown: str, marker: str) -> str:
    """The ```python block right after the line `marker`."""
    lines = markdown.splitlines()
    start = lines.index(marker) + 1
    assert lines[start].strip() == "```python", f"no ```python block after {marker}"
    end = lines.index("```", start + 1)
    return "\n".join(lines[start + 1 : end]) + "\n"


def signed_headers(msg_id: str, at: datetime, body: bytes, secrets: list[str]) -> dict[str, str]:
    """Standard Webhooks' headers of `body`, a signature by each secret (space separated)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": " ".join(Webhook(s).sign(msg_id, at, body) for s in secrets),
        "content-type": "application/json",
    }


def signed_event(secret: str, body: bytes, *, at: datetime, msg_id: str) -> dict[str, str]:
    return signed_headers(msg_id, at, body, [secret])


def test_the_readmes_webhook_receiver_accepts_signed_events_and_refuses_forged_ones() -> None:
    receiver: dict[str, Any] = {}
    exec(
        compile(marked_python_block(README.read_text(), RECEIVER_MARKER), "README", "exec"),
        receiver,
    )
    job_event, secret = receiver["job_event"], receiver["SECRET"]
    # A secret the server would take: whsec_ and 24 to 64 bytes of padded base64.
    assert secret.startswith("whsec_")
    assert 24 <= len(base64.b64decode(secret.removeprefix("whsec_"), validate=True)) <= 64
    record = JobRecord(
        spec=JobSpec(submission_id="train-1", entrypoint="python train.py"),
        status=JobStatus.SUCCEEDED,
        start_time=1_700_000_000_000,
        end_time=1_700_000_005_000,
        driver_exit_code=0,
    )
    now = datetime.now(UTC)
    payload = WebhookPayload(
        type=WebhookEventType.SUCCEEDED,
        timestamp=now.isoformat(),
        event_id=42,
        data=JobDetails.from_record(record),
    )
    body = payload.model_dump_json().encode()
    headers = signed_event(secret, body, at=now, msg_id="msg_2f3c")
    event = job_event(body, headers)
    assert event["type"] == "job.succeeded"
    assert event["event_id"] == 42
    assert (event["data"]["submission_id"], event["data"]["status"]) == ("train-1", "SUCCEEDED")
    # Two signatures while a secret is rotated: the receiver's is one of them.
    other = "whsec_" + base64.b64encode(b"another secret of 32 bytes.....!").decode()
    rotated = signed_headers("msg_2f3c", now, body, [other, secret])
    assert job_event(body, rotated) == event

    forged = {
        "signed with another secret": (body, signed_event(other, body, at=now, msg_id="m")),
        "a changed body": (body.replace(b"SUCCEEDED", b"FAILED"), headers),
        "another id": (body, {**headers, "webhook-id": "msg_other"}),
        "an old timestamp": (
            body,
            signed_event(secret, body, at=now - timedelta(minutes=10), msg_id="msg_2f3c"),
        ),
        "no signature": (body, {k: v for k, v in headers.items() if k != "webhook-signature"}),
    }
    for what, (forged_body, forged_headers) in forged.items():
        assert job_event(forged_body, forged_headers) is None, what
