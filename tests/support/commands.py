"""Shell commands that jobs of several test modules run."""

from __future__ import annotations

from pathlib import Path


def counted(counter: Path, then: str) -> str:
    """A command that counts its attempts in `counter` (as $n), says which one it is (not in
    ASCII: offsets are bytes), then runs `then`."""
    return (
        f"n=$(( $(cat {counter} 2>/dev/null || echo 0) + 1 )); echo $n > {counter}; "
        f'echo "attempt $n: début"; {then}'
    )


# The same with more processes to signal: signalled one by one (in no set order), the shell's
# foreground child often dies while many others are still to be signalled, and the shell
# then has all that time to run its next command.
MANY_THEN_FINISHES = "for i in 1 2 3 4 5 6 7 8 9 10; do sleep 60 & done; sleep 60; echo finished"


# Shells that left the command's process group (`setsid`), each waiting for its own child: a
# stop signals them one by one.
ESCAPED_SHELLS = (
    "for i in 1 2 3 4 5 6 7 8; do setsid sh -c 'sleep 60; echo b' & done; echo ready; sleep 60"
)
