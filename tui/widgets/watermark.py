"""One line per VMU segment: how full it is now, how full it has ever been, how big it is.

    host arena  ██████░░░░░░░░░┃░░░░░░░░░░   96.0 MiB / 256.0 MiB  38%  peak 160.0 MiB

The filled part is `used`, the bright marker is the high-water mark (`peak`), the whole
bar is `capacity`. The peak matters as much as current use: a segment that sits at 10%
but peaked at 99% is one request away from RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from djinn.cli.status import human_bytes

LABEL_WIDTH = 16
MIN_BAR = 10
FULL, EMPTY, PEAK = "█", "░", "┃"


def _fill_style(fraction: float) -> str:
    # Colour by pressure so the segment about to run out stands out at a glance.
    if fraction >= 0.9:
        return "red"
    if fraction >= 0.7:
        return "yellow"
    return "green"


def render_watermark(label: str, used: int, peak: int, capacity: int, width: int) -> Text:
    """The bar as rich Text, `width` cells wide (pure, so it can be tested without a UI)."""
    if capacity > 0:
        pct = 100 * used / capacity
        suffix = (
            f" {human_bytes(used):>10} / {human_bytes(capacity):<10} {pct:3.0f}%"
            f"  peak {human_bytes(peak):<10}"
        )
    else:
        suffix = f" {human_bytes(used):>10} / {'n/a':<10}       peak {human_bytes(peak):<10}"
    cells = max(MIN_BAR, width - LABEL_WIDTH - len(suffix))
    text = Text(f"{label[: LABEL_WIDTH - 1]:<{LABEL_WIDTH}}", no_wrap=True, overflow="crop")
    if capacity > 0:
        filled = min(cells, round(cells * used / capacity))
        # The marker sits in the cell holding the peak byte; a peak above zero always shows.
        mark = min(cells - 1, max(0, -(-cells * peak // capacity) - 1)) if peak > 0 else None
        style = _fill_style(used / capacity)
        for i in range(cells):
            if i == mark:
                text.append(PEAK, style="bold magenta")
            elif i < filled:
                text.append(FULL, style=style)
            else:
                text.append(EMPTY, style="grey35")
    else:
        text.append(EMPTY * cells, style="grey23")
    text.append(suffix)
    return text


class WatermarkBar(Widget):
    """A one-line bar for a single segment; `update_values` redraws it."""

    DEFAULT_CSS = """
    WatermarkBar {
        height: 1;
        width: 1fr;
    }
    """

    def __init__(self, label: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.label = label
        self.used = self.peak = self.capacity = 0

    def update_values(self, used: int, peak: int, capacity: int) -> None:
        if (used, peak, capacity) != (self.used, self.peak, self.capacity):
            self.used, self.peak, self.capacity = used, peak, capacity
            self.refresh()

    def render(self) -> Text:
        return render_watermark(self.label, self.used, self.peak, self.capacity, self.size.width)
