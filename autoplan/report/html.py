"""A self-contained HTML page: inline CSS, images embedded as base64 PNG, no external assets.

Sections carry an ``id`` (``<section id="timeline">``) so tools and tests can find them; all
text is escaped.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1250px; color: #222; line-height: 1.4; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
.subtitle { color: #555; margin-top: 0; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
caption { caption-side: top; text-align: left; font-weight: 600; padding-bottom: 0.3em; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
code { background: #f5f5f5; padding: 0 0.2em; }
.notes { color: #555; font-size: 0.9em; }
nav a { margin-right: 1em; }
"""


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    caption: str = ""
    numeric: tuple[int, ...] = ()          # column indices to right-align


@dataclass(frozen=True)
class Section:
    id: str
    title: str
    text: str = ""                          # a paragraph of plain text
    image: bytes | None = None              # PNG
    image_alt: str = ""
    tables: tuple[Table, ...] = field(default_factory=tuple)


def image_tag(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def table_html(t: Table) -> str:
    out = ["<table>"]
    if t.caption:
        out.append(f"<caption>{html.escape(t.caption)}</caption>")
    out.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in t.headers) + "</tr>")
    for row in t.rows:
        cells = []
        for i, cell in enumerate(row):
            cls = ' class="num"' if i in t.numeric else ""
            cells.append(f"<td{cls}>{html.escape(cell)}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def section_html(s: Section) -> str:
    parts = [f'<section id="{html.escape(s.id)}">', f"<h2>{html.escape(s.title)}</h2>"]
    if s.text:
        parts.append(f"<p>{html.escape(s.text)}</p>")
    if s.image is not None:
        parts.append(image_tag(s.image, s.image_alt or s.title))
    parts += [table_html(t) for t in s.tables]
    parts.append("</section>")
    return "\n".join(parts)


def render_page(title: str, subtitle: str, sections: list[Section], notes: list[str]) -> str:
    """The whole page as one string."""
    nav = " ".join(f'<a href="#{html.escape(s.id)}">{html.escape(s.title)}</a>'
                   for s in sections)
    body = "\n".join(section_html(s) for s in sections)
    foot = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n<p class=\"subtitle\">{html.escape(subtitle)}</p>\n"
            f"<nav>{nav}</nav>\n{body}\n"
            f"<section id=\"notes\" class=\"notes\"><h2>Notes</h2><ul>{foot}</ul></section>\n"
            "</body>\n</html>\n")
