"""Figures that read well with 30 methods: a distinct colour and line style per method,
the legend beside the axes, whole-number round ticks, a title, a % axis of at least 10
points, and a note naming the methods without values (the +FT rows' per-round curves).
Each figure is kept open (``plt.close`` patched) and inspected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pytest

from fedpers.reports import method_styles, plot_rounds
from fedpers.results import RoundRecord
from fedpers.simulations.plots import plot_client_cdf, plot_seeded

matplotlib.use("Agg")
from matplotlib import pyplot as plt

METHODS = [f"method-{i}" for i in range(29)] + ["fedavg-ft"]


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the plots would have closed."""
    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)
    return figures


def _records(method: str, rounds: int = 7) -> list[RoundRecord]:
    if method.endswith("-ft"):  # its accuracy is the fine-tuned final one only
        return [RoundRecord(round=r, seconds=1.0) for r in range(1, rounds + 1)]
    offset = int(method.rsplit("-", 1)[1]) / 100
    return [
        RoundRecord(round=r, seconds=1.0, evaluate={"accuracy": 0.80 + offset / 10 + r / 1000})
        for r in range(1, rounds + 1)
    ]


def _outside_legend(figure: Any, axes: Any) -> None:
    figure.canvas.draw()
    legend = axes.get_legend()
    assert legend is not None
    assert legend.get_window_extent().x0 >= axes.get_window_extent().x1


def test_sixty_methods_get_sixty_looks() -> None:
    styles = method_styles([f"m{i}" for i in range(60)])
    looks = {(s["color"], s["linestyle"], s.get("marker")) for s in styles.values()}
    assert len(looks) == 60
    assert styles["m0"]["color"] != styles["m1"]["color"]
    assert styles["m0"]["linestyle"] != styles["m10"]["linestyle"]  # fedrep and l2gd, once


def test_thirty_methods_read_apart_with_the_legend_outside(kept: list[Any], tmp_path: Path) -> None:
    curves = {m: [_records(m)] for m in METHODS}
    plot_seeded(curves, "evaluate.accuracy", tmp_path / "a.png", title="table 1, 1 seed")
    (figure,) = kept
    axes = figure.axes[0]
    looks = [(line.get_color(), line.get_linestyle()) for line in axes.get_lines()]
    assert len(looks) == 29 == len(set(looks))
    _outside_legend(figure, axes)
    ticks = [t for t in axes.get_xticks() if 1 <= t <= 7]
    assert ticks
    assert all(float(t).is_integer() for t in ticks)
    assert axes.get_title() == "table 1, 1 seed"
    notes = [t.get_text() for t in axes.texts]
    assert notes == ["not drawn (no value in any round): fedavg-ft"]
    low, high = axes.get_ylim()
    assert high - low >= 10
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_a_small_drift_does_not_fill_the_axis(kept: list[Any], tmp_path: Path) -> None:
    records = [
        RoundRecord(round=r, seconds=1.0, evaluate={"accuracy": 0.90 - 0.01 * (r % 3)})
        for r in range(1, 21)
    ]
    plot_rounds([("fedrep-seed0", records)], "evaluate.accuracy", tmp_path / "r.png")
    (figure,) = kept
    axes = figure.axes[0]
    low, high = axes.get_ylim()
    assert high - low >= 10  # 2 points of drift in a 10-point window
    assert axes.get_title() == "fedrep-seed0: evaluate.accuracy"
    assert all(float(t).is_integer() for t in axes.get_xticks())


def test_client_cdf_styles_and_notes_the_methods_without_clients(
    kept: list[Any], tmp_path: Path
) -> None:
    per_client = {m: {"0": 0.5, "1": 0.75} for m in METHODS[:12]} | {"fedavg-ft": {}}
    plot_client_cdf(per_client, tmp_path / "c.png")
    (figure,) = kept
    axes = figure.axes[0]
    steps = [line for line in axes.get_lines() if line.get_label() in per_client]
    assert len({(s.get_color(), s.get_linestyle()) for s in steps}) == 12
    _outside_legend(figure, axes)
    assert axes.get_title() == "clients' final accuracy"
    assert [t.get_text() for t in axes.texts] == ["not drawn (no value in any round): fedavg-ft"]


def test_a_scripts_note_is_written_under_the_axes(kept: list[Any], tmp_path: Path) -> None:
    curves = {"fedavg": [_records("method-1")], "fedavg-ft": [_records("fedavg-ft")]}
    note = "fedavg-ft: the curve of the row without +FT (fine-tuned at the end only)"
    plot_seeded(curves, "evaluate.accuracy", tmp_path / "n.png", note=note)
    (figure,) = kept
    (text,) = figure.axes[0].texts
    assert text.get_text() == f"{note}\nnot drawn (no value in any round): fedavg-ft"
