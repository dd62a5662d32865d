"""A small SVG canvas for the course's drawings (`decodelab.course.pictures`): boxes, labels and
arrows as plain SVG text, no drawing library.

    canvas = Canvas(width=600, title="two boxes")
    canvas.box(10, 10, 120, 30, "stage-a", "stage", label="a stage")
    canvas.arrow(70, 40, 70, 70)
    picture = canvas.picture()   # picture.svg is the text; Jupyter shows it (_repr_svg_)

Every shape may carry an id, a class and data-* attributes, so a test can read a drawing back
with xml.etree (`find_by_class`). Coordinates and sizes are in pixels.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

SVG_NS = "http://www.w3.org/2000/svg"
FONT = "font-family='DejaVu Sans, Helvetica, Arial, sans-serif'"
CHAR_WIDTH = 0.6  # average glyph width of the sans font, in units of the font size


@dataclass(frozen=True, repr=False)
class Picture:
    """A finished drawing: `svg` is the SVG text; Jupyter and the browser show it."""

    svg: str
    title: str

    def __repr__(self) -> str:  # the text/plain beside the drawing: short, not the whole SVG
        return f"Picture({self.title!r}, {len(self.svg):,} characters of SVG)"

    def _repr_svg_(self) -> str:
        return self.svg

    def __str__(self) -> str:
        return self.svg

    def save(self, path) -> None:
        """Write the SVG to `path` (open it in a browser)."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.svg)


def text_width(text: str, size: float = 11) -> float:
    """Estimated width in pixels of `text` at font `size` (no font metrics at hand)."""
    return len(text) * size * CHAR_WIDTH


def _attributes(id: str | None, cls: str | None, data: dict | None, extra: dict) -> str:
    pairs = {"id": id, "class": cls, **{f"data-{k.replace('_', '-')}": v for k, v in (data or {}).items()}}
    pairs.update({k.replace("_", "-"): v for k, v in extra.items()})
    return "".join(f" {key}={quoteattr(str(value))}" for key, value in pairs.items() if value is not None)


class Canvas:
    """Collects SVG elements; `picture(height)` closes them into a `Picture`."""

    def __init__(self, width: int, title: str):
        self.width, self.title, self.parts = width, title, []
        self.right = 0.0  # the rightmost x any text reaches (estimated): the picture widens to it

    def box(
        self,
        x,
        y,
        width,
        height,
        id=None,
        cls=None,
        label=None,
        fill="#f8fafc",
        stroke="#94a3b8",
        stroke_width=1,
        size=11,
        tooltip=None,
        data=None,
        label_color="#111827",
        bold=False,
    ) -> None:
        """A rounded rectangle with an optional centred label; id/class/data go on a <g> around both."""
        self.parts.append(f"<g{_attributes(id, cls, data, {})}>")
        hover = f"<title>{escape(tooltip)}</title>" if tooltip else ""
        self.parts.append(
            f"<rect x='{x:.1f}' y='{y:.1f}' width='{width:.1f}' height='{height:.1f}' rx='4' "
            f"fill='{fill}' stroke='{stroke}' stroke-width='{stroke_width}'>{hover}</rect>"
        )
        if label is not None:
            self.text(
                x + width / 2,
                y + height / 2 + size * 0.35,
                label,
                size=size,
                anchor="middle",
                color=label_color,
                bold=bold,
            )
        self.parts.append("</g>")

    def text(self, x, y, text, size=11, anchor="start", color="#111827", bold=False, cls=None, monospace=False) -> None:
        """One line of text with its baseline at y."""
        family = "font-family='DejaVu Sans Mono, Menlo, monospace'" if monospace else FONT
        reach = text_width(str(text), size) * {"start": 1, "middle": 0.5, "end": 0}[anchor]
        self.right = max(self.right, x + reach)
        weight = " font-weight='bold'" if bold else ""
        self.parts.append(
            f"<text x='{x:.1f}' y='{y:.1f}' {family} font-size='{size}' text-anchor='{anchor}' "
            f"fill='{color}'{weight}{_attributes(None, cls, None, {})}>{escape(str(text))}</text>"
        )

    def arrow(self, x1, y1, x2, y2, color="#475569", dashed=False, cls=None) -> None:
        """A straight line from (x1, y1) to (x2, y2) with an arrowhead at the end."""
        dash = " stroke-dasharray='4 3'" if dashed else ""
        self.parts.append(
            f"<line x1='{x1:.1f}' y1='{y1:.1f}' x2='{x2:.1f}' y2='{y2:.1f}' stroke='{color}' "
            f"stroke-width='1.4' marker-end='url(#head)'{dash}{_attributes(None, cls, None, {})}/>"
        )

    def path(self, d: str, color="#475569", dashed=False, arrow=True, cls=None) -> None:
        """An SVG path (`d` in SVG's path syntax), with an arrowhead at its end unless arrow=False."""
        dash = " stroke-dasharray='4 3'" if dashed else ""
        head = " marker-end='url(#head)'" if arrow else ""
        self.parts.append(
            f"<path d='{d}' fill='none' stroke='{color}' stroke-width='1.4'{head}{dash}"
            f"{_attributes(None, cls, None, {})}/>"
        )

    def picture(self, height: float) -> Picture:
        """The SVG document of everything drawn so far, `height` pixels tall."""
        head = (
            "<defs><marker id='head' markerWidth='8' markerHeight='8' refX='7' refY='4' orient='auto'>"
            "<path d='M0,0 L8,4 L0,8 z' fill='#475569'/></marker></defs>"
        )
        width = max(self.width, int(self.right) + 10)
        svg = (
            f"<svg xmlns='{SVG_NS}' width='{width}' height='{height:.0f}' "
            f"viewBox='0 0 {width} {height:.0f}' role='img'><title>{escape(self.title)}</title>{head}"
            + "".join(self.parts)
            + "</svg>"
        )
        return Picture(svg=svg, title=self.title)


def find_by_class(svg: str, cls: str) -> list[ET.Element]:
    """The elements of an SVG text whose class list holds `cls` (for tests and checks)."""
    root = ET.fromstring(svg)
    return [element for element in root.iter() if cls in element.get("class", "").split()]


__all__ = ["Canvas", "Picture", "find_by_class", "text_width"]
