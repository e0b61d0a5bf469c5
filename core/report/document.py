"""The report as a list of blocks, rendered both as Markdown and as one self-contained HTML page.

The HTML embeds every image as a base64 data URI and its style inline: nothing is fetched when
the page is opened, so the file can be mailed or archived on its own.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Block:
    """A piece of the report, rendered both as Markdown and as HTML."""

    kind: str  # "h1" | "h2" | "p" | "table" | "ul" | "img"
    text: str = ""
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    path: str = ""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[Block]) -> str:
    """The blocks as Markdown (images link to their PNG files)."""
    out: list[str] = []
    for b in blocks:
        if b.kind == "h1":
            out.append(f"# {b.text}")
        elif b.kind == "h2":
            out.append(f"## {b.text}")
        elif b.kind == "p":
            out.append(b.text)
        elif b.kind == "ul":
            out.append("\n".join(f"- {item}" for item in b.items))
        elif b.kind == "table":
            lines = ["| " + " | ".join(_md_cell(h) for h in b.headers) + " |"]
            lines.append("|" + "|".join("---" for _ in b.headers) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in b.rows]
            out.append("\n".join(lines))
        elif b.kind == "img":
            out.append(f"![{b.text}]({b.path})\n\n*{b.text}*")
        out.append("")
    return "\n".join(out)


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1100px;
       margin: 2em auto; padding: 0 1em; color: #222; line-height: 1.45; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; }
code { background: #f3f3f3; padding: 0 3px; }
"""


def render_html(blocks: list[Block], title: str, root: Path) -> str:
    """A single HTML file; images are embedded as base64 data URIs (nothing is fetched)."""
    esc = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
    ]
    for b in blocks:
        if b.kind in ("h1", "h2"):
            out.append(f"<{b.kind}>{esc(b.text)}</{b.kind}>")
        elif b.kind == "p":
            out.append(f"<p>{_inline(b.text)}</p>")
        elif b.kind == "ul":
            out.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif b.kind == "table":
            head = "".join(f"<th>{esc(h)}</th>" for h in b.headers)
            body = "".join(
                "<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in b.rows
            )
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif b.kind == "img":
            data = base64.b64encode((root / b.path).read_bytes()).decode("ascii")
            out.append(
                f'<figure><img alt="{esc(b.text)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{esc(b.text)}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def _inline(text: str) -> str:
    """Escape, then turn Markdown `code` and **bold** into HTML."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)
