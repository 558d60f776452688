"""A DataTable that is refreshed in place, sorts by any column and keeps its selection.

`djinn top` rebuilds every table from a new stats document each poll. Clearing and
re-adding the rows would reset the cursor and the scroll position, so the operator's
selection would jump every second. Instead rows are keyed (session id, worker id, ...):
vanished keys are removed, existing rows are updated cell by cell, new keys are added,
and the cursor is put back on the row key it was on before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.binding import Binding
from textual.widgets import DataTable


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    numeric: bool = False  # right-justified; sorts descending first (biggest on top)


_TEXT = object()  # sort by the displayed text


class Cell(Text):
    """Displayed text plus the raw value it sorts by ("1.5 GiB" must sort as bytes).

    A rich Text subclass so DataTable renders it as-is (plain strings would be parsed as
    console markup, and a peer name or model name is not markup).
    """

    def __init__(self, text: str, sort_value: Any = _TEXT, numeric: bool = False) -> None:
        super().__init__(text, justify="right" if numeric else "left", no_wrap=True)
        self.sort_value = text if sort_value is _TEXT else sort_value


def _rank(value: Any) -> tuple[int, Any]:
    # Columns can mix types (worker ids are ints, the supervisor's row is a string) and
    # missing values are None: order numbers, then strings, then missing.
    if isinstance(value, (int, float)):
        return (0, value)
    if value is None:
        return (2, "")
    return (1, str(value))


Rows = dict[str, list[Cell]]


class SortableTable(DataTable):
    BINDINGS = [
        Binding("s", "cycle_sort", "Sort"),
        Binding("S", "reverse_sort", "Reverse", show=False),
    ]

    def __init__(self, columns: list[Column], *, title: str, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._columns = columns
        self._title = title
        self._sort_index = 0
        self._reverse = False
        self.border_title = title

    def on_mount(self) -> None:
        for col in self._columns:
            self.add_column(
                Text(col.label, justify="right" if col.numeric else "left"), key=col.key
            )
        self._show_sort()

    @property
    def selected_key(self) -> str | None:
        """The row key under the cursor, or None for an empty table."""
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value

    def row_keys(self) -> list[str]:
        """Row keys in display order (for tests and for the kill action)."""
        return [row.key.value for row in self.ordered_rows]

    def cell_text(self, row_key: str, column_key: str) -> str:
        return str(self.get_cell(row_key, column_key))

    def set_rows(self, rows: Rows) -> None:
        """Make the table show exactly `rows` (key -> one Cell per column)."""
        selected = self.selected_key
        for key in [k.value for k in self.rows]:
            if key not in rows:
                self.remove_row(key)
        for key, cells in rows.items():
            if key in self.rows:
                for col, cell in zip(self._columns, cells, strict=True):
                    old = self.get_cell(key, col.key)
                    if old != cell or old.sort_value != cell.sort_value:
                        self.update_cell(key, col.key, cell, update_width=True)
            else:
                self.add_row(*cells, key=key)
        self._sort(selected)

    def _sort(self, keep: str | None) -> None:
        if not self.row_count:
            return
        col = self._columns[self._sort_index]
        self.sort(col.key, key=lambda cell: _rank(cell.sort_value), reverse=self._reverse)
        # DataTable.sort keeps the cursor's row *index*; put it back on the same *row*.
        if keep is not None and keep in self.rows:
            self.move_cursor(row=self.get_row_index(keep), animate=False)

    def _show_sort(self) -> None:
        col = self._columns[self._sort_index]
        self.border_subtitle = f"sort: {col.label} {'▼' if self._reverse else '▲'}"

    def sort_by(self, index: int, reverse: bool | None = None) -> None:
        """Sort by column `index`; numbers default to biggest first, text to A-Z."""
        self._sort_index = index % len(self._columns)
        col = self._columns[self._sort_index]
        self._reverse = col.numeric if reverse is None else reverse
        self._show_sort()
        self._sort(self.selected_key)

    def action_cycle_sort(self) -> None:
        self.sort_by(self._sort_index + 1)

    def action_reverse_sort(self) -> None:
        self.sort_by(self._sort_index, not self._reverse)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        # Clicking the current sort column flips the order; another column sorts by it.
        event.stop()
        if event.column_index == self._sort_index:
            self.action_reverse_sort()
        else:
            self.sort_by(event.column_index)
