"""HTML pages of the reports (``server.report``, ``server.department_record``): one self-contained
document per page, tables of numbers and matplotlib figures embedded as base64 PNG, so a page opens
offline and fetches nothing."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

__all__ = ["figure", "page", "png", "table", "whole_rounds"]


def figure(*args: Any, **kwargs: Any) -> Any:
    """``matplotlib.pyplot.subplots`` on the Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def png(fig: Any) -> str:
    """The figure as an ``<img>`` with its PNG inline (the figure is closed)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def whole_rounds(axis: Any) -> None:
    """Round numbers on the x axis: whole numbers only."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """An HTML table of ``columns`` of ``rows`` (escaped; whole numbers ≥ 1000 with separators)."""
    def cell(value: Any) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:,.0f}" if value.is_integer() and abs(value) >= 1000 else f"{value:.4g}"
        if isinstance(value, (list, dict)):
            return html.escape(", ".join(map(str, value)) if isinstance(value, list)
                               else ", ".join(f"{k}: {cell(v)}" for k, v in value.items()))
        return html.escape("" if value is None else str(value))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


STYLE = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .5em;"
         "text-align:left;font-size:90%}th{background:#f0f0f0}img{max-width:100%}")


def page(title: str, sections: list[tuple[str, str, str]]) -> str:
    """One HTML document: the title, then each (id, heading, content) as a section."""
    body = "".join(f'<section id="{sid}"><h2>{html.escape(heading)}</h2>{content}</section>'
                   for sid, heading, content in sections)
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>")
