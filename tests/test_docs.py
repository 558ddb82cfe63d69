"""The docs against the code (no Ray: part of the fast loop).

docs/architecture.md maps every module under jobs_server/ and no other, and names every test
file in its test map; README.md's configuration table lists every option of `Settings`; and
every relative link in README.md and docs/*.md reaches a file, and a heading there when it
names one. The README opens with its two commands, and CI runs the second one as it is.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs_server.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
MODULE = re.compile(r"`(jobs_server/[\w/]+\.py)`")
TEST_FILE = re.compile(r"`(tests/test_\w+\.py)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def section(markdown: str, heading: str) -> str:
    """The text under `heading` (a whole line, `#`s included), up to the next heading of the
    same or a higher level."""
    lines = markdown.splitlines()
    start = lines.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    body = []
    for line in lines[start + 1 :]:
        hashes = len(line) - len(line.lstrip("#"))
        if 0 < hashes <= level and line[hashes : hashes + 1] == " " and not body_in_fence(body):
            break
        body.append(line)
    return "\n".join(body)


def body_in_fence(lines: list[str]) -> bool:
    return sum(line.startswith("```") for line in lines) % 2 == 1


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(char for char in text if char.isalnum() or char in " -_")
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found: set[str] = set()
    for line in FENCE.sub("", markdown).splitlines():
        if re.match(r"^#{1,6} ", line):
            base = slug(line.lstrip("#"))
            name, count = base, 0
            while name in found:
                count += 1
                name = f"{base}-{count}"
            found.add(name)
    return found


def test_the_readme_opens_with_the_two_commands_and_ci_runs_the_second() -> None:
    """A fresh machine: the first sets up and runs the server, the second sets up and passes the
    tests, and `.ci/run` runs exactly that one."""
    fences = [
        block.strip().splitlines()
        for block in re.findall(r"^```sh\n(.*?)^```", README.read_text(), re.S | re.M)
    ]
    serve, check = fences[0], fences[1]
    assert serve == [
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/jobs-server serve"
    ]
    assert len(check) == 1
    assert check[0].endswith("scripts/check")
    text = README.read_text()
    assert text.index("```sh") < text.index("## ")
    ci_commands = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd ", "export "))
    ]
    assert ci_commands == check


def test_the_checkers_read_markdown() -> None:
    text = (
        "# Top\n\n## The map\n\n| `jobs_server/a.py` | a |\n\n```\n# not a heading\n```\n\n"
        "| `jobs_server/b/c.py` | c |\n\n## Next\n\n`jobs_server/d.py` [x](other.md#the-map)\n"
    )
    assert set(MODULE.findall(section(text, "## The map"))) == {
        "jobs_server/a.py",
        "jobs_server/b/c.py",
    }
    assert anchors(text) == {"top", "the-map", "next"}
    assert LINK.findall(text) == ["other.md#the-map"]
    assert slug("When Ray fails: GCS fault tolerance") == "when-ray-fails-gcs-fault-tolerance"
    assert slug("Retention, a full disk, uploads") == "retention-a-full-disk-uploads"


def test_the_architecture_map_names_every_module_and_only_those() -> None:
    on_disk = {str(path.relative_to(ROOT)) for path in (ROOT / "jobs_server").rglob("*.py")}
    mapped = set(MODULE.findall(section(ARCHITECTURE.read_text(), "## The map of the code")))
    assert {"missing from the map": sorted(on_disk - mapped)} == {"missing from the map": []}
    assert {"no such module": sorted(mapped - on_disk)} == {"no such module": []}


def test_the_test_map_names_every_test_file_and_only_those() -> None:
    on_disk = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")}
    mapped = set(TEST_FILE.findall(section(ARCHITECTURE.read_text(), "### The test map")))
    assert {"missing from the test map": sorted(on_disk - mapped)} == {
        "missing from the test map": []
    }
    assert {"no such test file": sorted(mapped - on_disk)} == {"no such test file": []}


def test_the_readme_configuration_table_lists_every_option() -> None:
    table = section(README.read_text(), "## Configure it")
    missing = []
    for name, field in Settings.model_fields.items():
        variable = f"`JOBS_SERVER_{name.upper()}`"
        flag = f"`--{name.replace('_', '-')}`"
        extra = field.json_schema_extra
        has_flag = not (isinstance(extra, dict) and extra.get("cli") is False)
        if variable not in table or (has_flag and flag not in table):
            missing.append(name)
    assert missing == []


@pytest.mark.parametrize("document", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_its_heading(document: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", document.read_text())):
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        linked = (document.parent / path_part).resolve() if path_part else document
        if not linked.exists() or (
            anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text())
        ):
            broken.append(target)
    assert broken == []
