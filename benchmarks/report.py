"""Figures, targets and the markdown table that puts Ray's and ours side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Better(StrEnum):
    """Which way a figure is better; it decides how a ratio meets its target."""

    LOWER = "lower"
    HIGHER = "higher"


class Unit(StrEnum):
    """How a figure is printed."""

    SECONDS = "s"
    PER_SECOND = "/s"
    BYTES = "B"
    BYTES_PER_SECOND = "B/s"
    # Not a number: a word that answers the row (see `answer`).
    ANSWER = "answer"


class Server(StrEnum):
    """The two servers under test."""

    RAY = "Ray's job server"
    OURS = "jobs-server"


@dataclass(frozen=True)
class Target:
    """A bound on ours/Ray's: at most `ratio` when lower is better, at least when higher is."""

    text: str
    ratio: float
    strict: bool = False

    def is_met(self, ratio: float, better: Better) -> bool:
        """Whether `ratio` (ours/Ray's) meets this target."""
        if better is Better.HIGHER:
            return ratio > self.ratio if self.strict else ratio >= self.ratio
        return ratio < self.ratio if self.strict else ratio <= self.ratio

    def verdict(self, ours: Figure, ratio: float | None, better: Better) -> bool | None:
        """Met, not met, or None when the ratio could not be computed."""
        return None if ratio is None else self.is_met(ratio, better)


@dataclass(frozen=True)
class OursAtMost:
    """A bound on our own figure, whatever Ray's is (e.g. memory a request may take)."""

    text: str
    limit: float

    def verdict(self, ours: Figure, ratio: float | None, better: Better) -> bool | None:
        """Met, not met, or None when our figure is missing."""
        return None if ours.value is None else ours.value <= self.limit


@dataclass(frozen=True)
class Metric:
    """One row of the table: a figure measured on both servers (or ours against `ray_key`)."""

    key: str
    label: str
    unit: Unit
    better: Better
    target: Target | OursAtMost | None = None
    ray_key: str | None = None


@dataclass(frozen=True)
class Figure:
    """One server's value for one metric; `value` is None when there is no number, and
    `missing` is what the cell says instead: why, or the answer of an ANSWER row."""

    value: float | None
    missing: str = "n/a"


def answer(text: str) -> Figure:
    """A figure that is a word, not a number (no ratio): e.g. "yes (HTTP 200)"."""
    return Figure(None, text)


@dataclass
class Results:
    """Every figure, keyed by server and metric, and the notes that explain odd ones."""

    figures: dict[tuple[Server, str], Figure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def record(self, server: Server, figures: dict[str, Figure]) -> None:
        """Keep one scenario's figures for `server`."""
        for key, figure in figures.items():
            self.figures[(server, key)] = figure

    def note(self, server: Server | None, text: str) -> None:
        """Keep a note for under the table."""
        self.notes.append(f"{server}: {text}" if server else text)

    def get(self, server: Server, key: str) -> Figure:
        """The figure, or a 'not run' placeholder."""
        return self.figures.get((server, key), Figure(None, "not run"))


def format_value(figure: Figure, unit: Unit) -> str:
    """A figure as a table cell, with a unit a reader takes in at a glance."""
    value = figure.value
    if value is None:
        return figure.missing
    if unit is Unit.SECONDS:
        return _format_seconds(value)
    if unit is Unit.BYTES:
        return f"{value / 2**20:.1f} MiB"
    if unit is Unit.BYTES_PER_SECOND:
        return _format_mib_per_s(value)
    if value < 10:
        return f"{value:.2f}/s"
    return f"{value:.1f}/s" if value < 100 else f"{value:.0f}/s"


def _format_seconds(value_s: float) -> str:
    if value_s >= 10:
        return f"{value_s:.1f} s"
    if value_s >= 1:
        return f"{value_s:.2f} s"
    if value_s >= 0.01:
        return f"{value_s * 1000:.1f} ms"
    return f"{value_s * 1000:.2f} ms"


def _format_mib_per_s(bytes_per_s: float) -> str:
    mib_per_s = bytes_per_s / 2**20
    if mib_per_s >= 100:
        return f"{mib_per_s:.0f} MiB/s"
    return f"{mib_per_s:.1f} MiB/s" if mib_per_s >= 1 else f"{mib_per_s:.3f} MiB/s"


def ratio_of(ours: Figure, ray: Figure) -> float | None:
    """ours/Ray's, when both were measured and Ray's is not zero."""
    if ours.value is None or ray.value is None or ray.value == 0:
        return None
    return ours.value / ray.value


def table_row(metric: Metric, results: Results) -> str:
    """One markdown row: label, Ray's, ours, ratio and whether the target is met."""
    ray = results.get(Server.RAY, metric.ray_key or metric.key)
    ours = results.get(Server.OURS, metric.key)
    ratio = ratio_of(ours, ray)
    ratio_cell = "—" if ratio is None else f"{ratio:.3g} ({metric.better} is better)"
    if metric.target is None:
        target_cell = "— (for information)"
    else:
        verdict = metric.target.verdict(ours, ratio, metric.better)
        word = {None: "not measured", True: "met", False: "not met"}[verdict]
        target_cell = f"{metric.target.text}: **{word}**"
    cells = [
        metric.label,
        format_value(ray, metric.unit),
        format_value(ours, metric.unit),
        ratio_cell,
        target_cell,
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(metrics: list[Metric], results: Results) -> str:
    """The whole comparison table; ratios are always ours/Ray's."""
    header = [
        f"| scenario | {Server.RAY} | {Server.OURS} | ratio (ours/Ray's) | target |",
        "|---|---:|---:|---|---|",
    ]
    return "\n".join(header + [table_row(metric, results) for metric in metrics])
