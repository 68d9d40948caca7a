"""A small SVG chart renderer for the report, standard library only: panels of lines and points over a
linear x and y axis with 1-2-5 ticks, dashed lines, markers, vertical bands, a legend, a colour bar.

It replaced matplotlib, whose import and Agg drawing cost 3-4 s of CPU per report. Every text is
escaped (labels are run names and metric keys, which users choose) and a drawing has no id, script or
link, so that several can sit inline in one HTML page and each is also a file of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from typing import Callable, Optional

FONT = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif"
CHAR_WIDTH = 0.6  # a sans-serif character's mean advance, in font sizes: boxes are sized by it (no font metrics here)
TEXT, TICK_TEXT, TITLE_TEXT = 11.5, 11, 13  # font sizes, in pixels of the drawing
AXIS, GRID = "#888", "#e6e6e6"


class Unplottable(ValueError):
    """Values no axis can span: none finite, or a range wider than a float holds (a damaged metrics.jsonl)."""


@dataclass
class Series:
    """One line, or one set of points, of a plot. Non-finite values are left out (a gap in the line)."""

    label: str  # legend text; "" keeps it out of the legend
    xs: list[float]
    ys: list[float]
    color: str
    line: bool = True
    dashed: bool = False
    width: float = 1.5
    markers: bool = False  # a dot at each point
    marker_radius: float = 2.5
    hollow: bool = False  # markers as rings
    marker_colors: Optional[list[str]] = None  # one fill per point (a scatter coloured by a third quantity)
    opacity: float = 1.0
    note: str = ""  # a word beside the last point

    def points(self) -> list[tuple[float, float]]:
        return [(x, y) for x, y in zip(self.xs, self.ys) if math.isfinite(x) and math.isfinite(y)]


@dataclass
class ColorBar:
    """The scale of a scatter's colours: `color(t)` for t in [0, 1] spans `low`..`high`."""

    label: str
    low: float
    high: float
    color: Callable[[float], str]


@dataclass
class Plot:
    title: str
    series: list[Series]
    xlabel: str = "update"
    ylabel: str = ""
    integer_x: bool = True  # updates: ticks at whole numbers
    bands: list[tuple[float, str]] = field(default_factory=list)  # (x, colour): a faint vertical band (an alarm)
    colorbar: Optional[ColorBar] = None

    def limits(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """((x low, x high), (y low, y high)) with a margin; Unplottable when the values allow no axis."""
        points = [p for s in self.series for p in s.points()]
        return axis_limits([p[0] for p in points]), axis_limits([p[1] for p in points])


# --------------------------------------------------------------------------- axes and ticks


def axis_limits(values: list[float], margin: float = 0.05) -> tuple[float, float]:
    """The data range widened by `margin` of it on each side (a constant: by a tenth of itself, or 1)."""
    if not values:
        raise Unplottable("its values are all NaN or infinite")
    low, high = min(values), max(values)
    if low == high:
        pad = abs(low) * 0.1 or 1.0
    else:
        pad = (high - low) * margin
    low, high = low - pad, high + pad
    if not (math.isfinite(low) and math.isfinite(high) and math.isfinite(high - low) and high > low):
        raise Unplottable(f"its values (from {min(values):.4g} to {max(values):.4g}) span more than a chart's axis can")
    return low, high


def ticks(low: float, high: float, count: int, integer: bool = False) -> list[tuple[float, str]]:
    """(value, label) of the multiples between `low` and `high` of the smallest step m x 10**k (m 1, 2 or 5;
    a whole number if `integer`) that gives at most `count` of them."""
    k0 = math.floor(math.log10((high - low) / max(1, count)))
    steps = [(m, k) for k in range(k0 - 1, k0 + 3) for m in (1, 2, 5) if not (integer and k < 0)] or [(1, 0)]
    for m, k in steps:
        step = m * 10.0**k
        if step == 0:  # 10**k below the smallest float
            continue
        first, last = math.ceil(low / step - 1e-9), math.floor(high / step + 1e-9)
        if last - first + 1 <= count:
            break
    return [(n * step, tick_label(n * step, k, max(abs(low), abs(high)))) for n in range(first, min(last, first + count) + 1)]


def tick_label(value: float, k: int, magnitude: float) -> str:
    """`value` with as many digits as the step 10**k needs: 0.25, 1200, 3.5e-4 (below 1e-3) or 2.0e7 (from 1e6)."""
    if abs(value) < 10.0**k / 2:
        value = 0.0  # not -0.0, nor 1e-17 from n x step
    if 1e-3 <= magnitude < 1e6:
        return f"{value:.{max(0, -k)}f}"
    if value == 0:
        return "0"
    digits = max(0, math.floor(math.log10(magnitude)) - k)
    mantissa, exponent = f"{value:.{digits}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def text_width(text: str, size: float) -> float:
    return len(text) * size * CHAR_WIDTH


# --------------------------------------------------------------------------- drawing


def figure(title: str, plots: list[Plot], columns: int = 2, cell: tuple[int, int] = (640, 320)) -> str:
    """One SVG document of `plots` in a grid of `columns`, each in a cell of `cell` pixels; `title` is its
    accessible name (the page shows it as a heading)."""
    columns = max(1, min(columns, len(plots)))
    rows = math.ceil(len(plots) / columns)
    width, height = cell[0] * columns, cell[1] * rows
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="{escape(FONT)}" font-size="{TEXT}" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
    ]
    for i, plot in enumerate(plots):
        column, row = i % columns, i // columns
        parts.append(f'<g class="panel" transform="translate({column * cell[0]},{row * cell[1]})">')
        parts += panel(plot, cell[0], cell[1])
        parts.append("</g>")
    parts.append("</svg>")
    return "\n".join(parts)


@dataclass
class Frame:
    """Where a plot's data land: the plot area in pixels and the data ranges it spans."""

    left: float
    top: float
    right: float
    bottom: float
    x: tuple[float, float]
    y: tuple[float, float]

    def px(self, x: float) -> float:
        return self.left + (x - self.x[0]) / (self.x[1] - self.x[0]) * (self.right - self.left)

    def py(self, y: float) -> float:
        return self.bottom - (y - self.y[0]) / (self.y[1] - self.y[0]) * (self.bottom - self.top)


def panel(plot: Plot, width: float, height: float) -> list[str]:
    """The SVG elements of one plot in a `width` x `height` cell: title, axes, ticks, grid, bands, series, legend."""
    xrange, yrange = plot.limits()
    top, bottom = 30.0, height - (42.0 if plot.xlabel else 26.0)
    y_ticks = ticks(*yrange, count=max(2, min(6, int((bottom - top) / 36))))
    left = 10 + max(text_width(label, TICK_TEXT) for _, label in y_ticks) + (18 if plot.ylabel else 0)
    right = width - (78 if plot.colorbar else 14)
    x_ticks = fitting_ticks(*xrange, right - left, plot.integer_x)
    frame = Frame(left, top, right, bottom, xrange, yrange)
    out = [f'<text class="title" x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="{TITLE_TEXT}" font-weight="600"'
           f'{squeeze(plot.title, TITLE_TEXT, width - 8)}>{escape(plot.title)}</text>']
    out += axes(frame, x_ticks, y_ticks, plot.xlabel, plot.ylabel)
    for x, color in plot.bands:
        if xrange[0] <= x <= xrange[1]:
            out.append(f'<line class="band" x1="{frame.px(x):.1f}" x2="{frame.px(x):.1f}" y1="{top}" y2="{bottom}" '
                       f'stroke="{color}" stroke-opacity="0.25" stroke-width="3"/>')
    for series in plot.series:
        out += draw_series(series, frame)
    out += notes(plot.series, frame)
    if plot.colorbar:
        out += colorbar(plot.colorbar, right + 14, top, bottom)
    out += legend([s for s in plot.series if s.label], frame, traced(plot.series, frame))
    return out


def traced(series: list[Series], frame: Frame, per_segment: int = 4) -> list[tuple[float, float]]:
    """Pixel points along every line (its points and `per_segment` between each two) and every marker."""
    out = []
    for s in series:
        for run in finite_runs(s) if s.line else [[p] for p in s.points()]:
            pixels = [(frame.px(x), frame.py(y)) for x, y in run]
            out += pixels
            for (x0, y0), (x1, y1) in zip(pixels, pixels[1:]):
                out += [(x0 + (x1 - x0) * i / per_segment, y0 + (y1 - y0) * i / per_segment) for i in range(1, per_segment)]
    return out


def fitting_ticks(low: float, high: float, length: float, integer: bool) -> list[tuple[float, str]]:
    """X ticks whose labels do not touch: as many as fit in `length` pixels, at most 10."""
    for count in range(10, 1, -1):
        chosen = ticks(low, high, count, integer)
        widest = max((text_width(label, TICK_TEXT) for _, label in chosen), default=0)
        if len(chosen) * (widest + 14) <= length:
            return chosen
    return chosen


def axes(frame: Frame, x_ticks, y_ticks, xlabel: str, ylabel: str) -> list[str]:
    out = []
    for value, label in x_ticks:
        x = frame.px(value)
        out.append(f'<line class="xgrid" x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{frame.bottom}" stroke="{GRID}"/>')
        out.append(f'<text class="xtick" x="{x:.1f}" y="{frame.bottom + 15:.1f}" text-anchor="middle" font-size="{TICK_TEXT}" '
                   f'fill="#444">{escape(label)}</text>')
    for value, label in y_ticks:
        y = frame.py(value)
        out.append(f'<line class="ygrid" x1="{frame.left:.1f}" x2="{frame.right:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GRID}"/>')
        out.append(f'<text class="ytick" x="{frame.left - 5:.1f}" y="{y + TICK_TEXT * 0.35:.1f}" text-anchor="end" '
                   f'font-size="{TICK_TEXT}" fill="#444">{escape(label)}</text>')
    out.append(f'<rect x="{frame.left:.1f}" y="{frame.top}" width="{frame.right - frame.left:.1f}" '
               f'height="{frame.bottom - frame.top:.1f}" fill="none" stroke="{AXIS}"/>')
    if xlabel:
        out.append(f'<text class="xlabel" x="{(frame.left + frame.right) / 2:.1f}" y="{frame.bottom + 33:.1f}" text-anchor="middle"'
                   f'{squeeze(xlabel, TEXT, frame.right - frame.left)}>{escape(xlabel)}</text>')
    if ylabel:
        middle = (frame.top + frame.bottom) / 2
        out.append(f'<text class="ylabel" transform="translate(12,{middle:.1f}) rotate(-90)" text-anchor="middle"'
                   f'{squeeze(ylabel, TEXT, frame.bottom - frame.top)}>{escape(ylabel)}</text>')
    return out


def squeeze(text: str, size: float, room: float) -> str:
    """A textLength attribute narrowing `text` to `room` pixels when it would be wider (never cut: every word is kept)."""
    return f' textLength="{room:.0f}" lengthAdjust="spacingAndGlyphs"' if text_width(text, size) > room else ""


def draw_series(series: Series, frame: Frame) -> list[str]:
    out = []
    title = f"<title>{escape(series.label)}</title>" if series.label else ""
    if series.line:
        dash = ' stroke-dasharray="5 3"' if series.dashed else ""
        for run in finite_runs(series):  # a non-finite value breaks the line
            points = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in run)
            out.append(f'<polyline class="series" points="{points}" fill="none" stroke="{series.color}" '
                       f'stroke-width="{series.width}" stroke-linejoin="round" stroke-opacity="{series.opacity}"{dash}>{title}</polyline>')
    if series.markers:
        colors = series.marker_colors or [series.color] * len(series.xs)
        dots = [(x, y, c) for x, y, c in zip(series.xs, series.ys, colors) if math.isfinite(x) and math.isfinite(y)]
        out += [marker(frame.px(x), frame.py(y), series.marker_radius, color, series.hollow, "marker", series.opacity) for x, y, color in dots]
    return out


def notes(series: list[Series], frame: Frame) -> list[str]:
    """The word beside each series' last point (`Series.note`), just above it; a note that would cover one
    placed before (runs ending close together) moves up or down by a line until it covers none."""
    placed: list[tuple[float, float, float]] = []  # (left, right, baseline) of each note drawn
    line = TICK_TEXT + 2
    out = []
    for s in series:
        points = s.points()
        if not s.note or not points:
            continue
        x, y = frame.px(points[-1][0]), frame.py(points[-1][1])
        anchor, dx = ("end", -6) if x > (frame.left + frame.right) / 2 else ("start", 6)
        width = text_width(s.note, TICK_TEXT)
        left = x + dx - width if anchor == "end" else x + dx
        covers = lambda b: any(start < left + width and left < end and abs(b - other) < line for start, end, other in placed)  # noqa: E731
        shifts = [k * sign * line for k in range(len(placed) + 1) for sign in ((-1, 1) if k else (1,))]
        inside = [y - 6 + d for d in shifts if frame.top + TICK_TEXT <= y - 6 + d <= frame.bottom] or [y - 6]
        baseline = next((b for b in inside if not covers(b)), inside[0])
        placed.append((left, left + width, baseline))
        out.append(f'<text class="note" x="{x + dx:.1f}" y="{baseline:.1f}" text-anchor="{anchor}" font-size="{TICK_TEXT}" '
                   f'fill="{s.color}">{escape(s.note)}</text>')
    return out


def finite_runs(series: Series) -> list[list[tuple[float, float]]]:
    runs, current = [], []
    for x, y in zip(series.xs, series.ys):
        if math.isfinite(x) and math.isfinite(y):
            current.append((x, y))
        elif current:
            runs.append(current)
            current = []
    return runs + [current] if current else runs


def legend(entries: list[Series], frame: Frame, avoid: list[tuple[float, float]]) -> list[str]:
    """A box of `entries` (a sample of each line or marker, then its label) in the corner of the plot area
    where it covers the fewest points of `avoid`; in columns when they are more than its height holds,
    labels too wide for the plot narrowed."""
    if not entries:
        return []
    row, sample = TEXT + 5, 24
    per_column = max(1, int((frame.bottom - frame.top - 18) // row))
    columns = math.ceil(len(entries) / per_column)
    per_column = math.ceil(len(entries) / columns)
    room = (frame.right - frame.left - 12) / columns
    label_room = min(max(text_width(s.label, TEXT) for s in entries), room - sample - 14)
    column_width = sample + label_room + 14
    width, height = column_width * columns, row * per_column + 6
    x, y = best_corner(width, height, frame, avoid)
    out = [f'<g class="legend"><rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{height:.1f}" rx="3" '
           f'fill="#fff" fill-opacity="0.85" stroke="#ccc"/>']
    for i, s in enumerate(entries):
        left, middle = x + column_width * (i // per_column), y + 3 + row * (i % per_column) + row / 2
        if s.line:
            dash = ' stroke-dasharray="5 3"' if s.dashed else ""
            out.append(f'<line x1="{left + 6:.1f}" x2="{left + sample:.1f}" y1="{middle:.1f}" y2="{middle:.1f}" stroke="{s.color}" '
                       f'stroke-width="{s.width}"{dash}/>')
        if s.markers:
            color = s.marker_colors[len(s.marker_colors) // 2] if s.marker_colors else s.color
            out.append(marker(left + 6 + (sample - 6) / 2, middle, s.marker_radius, color, s.hollow))
        out.append(f'<text class="entry" x="{left + sample + 6:.1f}" y="{middle + TEXT * 0.35:.1f}"'
                   f'{squeeze(s.label, TEXT, label_room)}>{escape(s.label)}</text>')
    out.append("</g>")
    return out


def marker(x: float, y: float, radius: float, color: str, hollow: bool, css_class: str = "", opacity: float = 1.0) -> str:
    paint = f'fill="none" stroke="{color}" stroke-width="1.4"' if hollow else f'fill="{color}"'
    named = f'class="{css_class}" ' if css_class else ""
    faded = f' opacity="{opacity}"' if opacity != 1 else ""
    return f'<circle {named}cx="{x:.1f}" cy="{y:.1f}" r="{radius}" {paint}{faded}/>'


def best_corner(width: float, height: float, frame: Frame, avoid: list[tuple[float, float]]) -> tuple[float, float]:
    """The top-left of a `width` x `height` box in a corner (or the middle of the top or bottom edge) of the
    plot area covering the fewest of the points `avoid`, as matplotlib's legend loc="best" chooses."""
    inset = 6
    lefts = (frame.right - inset - width, frame.left + inset, (frame.left + frame.right - width) / 2)
    tops = (frame.top + inset, frame.bottom - inset - height)
    candidates = [(lefts[0], tops[0]), (lefts[1], tops[0]), (lefts[0], tops[1]), (lefts[1], tops[1]), (lefts[2], tops[0]), (lefts[2], tops[1])]
    return min(candidates, key=lambda c: sum(c[0] <= x <= c[0] + width and c[1] <= y <= c[1] + height for x, y in avoid))


def colorbar(bar: ColorBar, left: float, top: float, bottom: float, steps: int = 40) -> list[str]:
    out = ['<g class="colorbar">']
    step = (bottom - top) / steps
    for i in range(steps):
        out.append(f'<rect x="{left:.1f}" y="{bottom - (i + 1) * step:.1f}" width="12" height="{step + 0.5:.1f}" '
                   f'fill="{bar.color((i + 0.5) / steps)}"/>')
    out.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="12" height="{bottom - top:.1f}" fill="none" stroke="{AXIS}"/>')
    low, high = (bar.low - 0.5, bar.high + 0.5) if bar.low == bar.high else (bar.low, bar.high)
    for value, label in ticks(low, high, 5, integer=True):
        y = bottom - (value - low) / (high - low) * (bottom - top)
        out.append(f'<text x="{left + 16:.1f}" y="{y + TICK_TEXT * 0.35:.1f}" font-size="{TICK_TEXT}" fill="#444">{escape(label)}</text>')
    out.append(f'<text transform="translate({left + 56:.1f},{(top + bottom) / 2:.1f}) rotate(-90)" text-anchor="middle">'
               f"{escape(bar.label)}</text></g>")
    return out


def interpolate(stops: list[str], t: float) -> str:
    """The colour at `t` in [0, 1] along evenly spaced hex `stops`, mixed linearly."""
    t = min(1.0, max(0.0, t)) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    a, b = (tuple(int(s[j:j + 2], 16) for j in (1, 3, 5)) for s in (stops[i], stops[i + 1]))
    return "#" + "".join(f"{round(p + (q - p) * (t - i)):02x}" for p, q in zip(a, b))
