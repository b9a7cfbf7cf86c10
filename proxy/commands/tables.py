"""Plain-text tables for the CLI: columns sized to their content, numbers right-aligned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render_table"]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def render_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """``columns`` is ``(key, heading)`` pairs; returns the heading, a rule and one line per row."""
    cells = [[_cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max([len(heading)] + [len(r[i]) for r in cells]) for i, (_, heading) in enumerate(columns)]
    numeric = [all(isinstance(row.get(key), int | float) or row.get(key) is None for row in rows)
               for key, _ in columns]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line([heading for _, heading in columns]), line(["-" * w for w in widths])]
    out.extend(line(r) for r in cells)
    return "\n".join(out)
