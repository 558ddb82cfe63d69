"""jobs-server: a Ray-compatible HTTP job server for shell-command jobs on a Ray cluster."""

__version__ = "0.1.0"
