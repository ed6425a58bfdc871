"""Server-side SVG charts for the dashboard: lines, steps, shaded bands and reference lines.

`chart(title, series, bands=..., hlines=...)` returns one `<svg>` element as `Markup`, ready for a
template: no JavaScript, no chart library, and only presentation attributes (no `style`), so the
pages' Content-Security-Policy needs no 'unsafe-inline'. Every text is escaped. A chart with no
points says so instead of drawing empty axes. Called by `api.dashboard.views`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

COLORS = {
    "candidate": "#d9480f",
    "incumbent": "#1c7ed6",
    "reward": "#2b8a3e",
    "share": "#7048e8",
    "margin": "#c92a2a",
    "grid": "#e9ecef",
    "axis": "#868e96",
    "text": "#343a40",
}


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[float, float]]
    color: str
    step: bool = False  # a step function: each value holds until the next point
    dashed: bool = False


@dataclass(frozen=True)
class Band:
    name: str
    points: Sequence[tuple[float, float, float]]  # (x, low, high)
    color: str


@dataclass(frozen=True)
class HLine:
    name: str
    y: float
    color: str = COLORS["margin"]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [round(first + i * step, 12) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def chart(
    title: str,
    series: Sequence[Series],
    *,
    bands: Sequence[Band] = (),
    hlines: Sequence[HLine] = (),
    x_labels: Mapping[float, str] | None = None,
    x_title: str = "",
    y_title: str = "",
    y_range: tuple[float, float] | None = None,
    width: int = 560,
    height: int = 230,
) -> Markup:
    """One chart; `x_labels` names x values (e.g. version ids) instead of numeric ticks."""
    xs = [p[0] for s in series for p in s.points] + [p[0] for b in bands for p in b.points]
    ys = [p[1] for s in series for p in s.points] + [y for b in bands for p in b.points for y in p[1:]]
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>"
        f'<text x="8" y="16" font-size="13" font-weight="600" fill="{COLORS["text"]}">{escape(title)}</text>'
    )
    if not xs:
        msg = f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle" font-size="12" fill="{COLORS["axis"]}">'
        return Markup(head + msg + "no data yet</text></svg>")
    left, right, top, bottom = 52, 30, 40, 40
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x0, x1 = x0 - 0.5, x1 + 0.5
    finite = [y for y in ys if math.isfinite(y)] + [h.y for h in hlines]
    y0, y1 = y_range if y_range is not None else (min(finite), max(finite))
    if y_range is None:
        pad = (y1 - y0) * 0.08 or max(abs(y1) * 0.1, 0.05)
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        y = min(max(y, y0), y1)
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [head]
    for t in nice_ticks(y0, y1):  # horizontal grid and y ticks
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="{COLORS["grid"]}"/>'
            f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end" font-size="11" '
            f'fill="{COLORS["axis"]}">{_fmt(t)}</text>'
        )
    if x_labels:
        every = max(1, math.ceil(len(x_labels) / 10))
        ticks = [(x, lab) for i, (x, lab) in enumerate(sorted(x_labels.items())) if i % every == 0]
    else:
        ticks = [(t, _fmt(t)) for t in nice_ticks(x0, x1, 6)]
    for x, lab in ticks:
        out.append(
            f'<text x="{px(x):.1f}" y="{top + ph + 16}" text-anchor="middle" font-size="11" '
            f'fill="{COLORS["axis"]}">{escape(lab)}</text>'
        )
    out.append(
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="{COLORS["axis"]}"/>'
        f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="{COLORS["axis"]}"/>'
    )
    if x_title:
        out.append(
            f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" font-size="11" '
            f'fill="{COLORS["axis"]}">{escape(x_title)}</text>'
        )
    if y_title:
        out.append(
            f'<text x="12" y="{top + ph / 2}" text-anchor="middle" font-size="11" fill="{COLORS["axis"]}" '
            f'transform="rotate(-90 12 {top + ph / 2})">{escape(y_title)}</text>'
        )
    for b in bands:
        spans = sorted(b.points)
        upper = " ".join(f"{px(x):.1f},{py(hi):.1f}" for x, _, hi in spans)
        lower = " ".join(f"{px(x):.1f},{py(lo):.1f}" for x, lo, _ in reversed(spans))
        out.append(f'<polygon points="{upper} {lower}" fill="{b.color}" fill-opacity="0.18" stroke="none"/>')
    for h in hlines:
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{py(h.y):.1f}" y2="{py(h.y):.1f}" stroke="{h.color}" '
            f'stroke-dasharray="5 4"/><text x="{left + pw - 4}" y="{py(h.y) - 4:.1f}" text-anchor="end" '
            f'font-size="10" fill="{h.color}">{escape(h.name)}</text>'
        )
    for s in series:
        pts = sorted(s.points)
        if s.step and pts:
            stepped = [pts[0]]
            for (_, ya), (xb, yb) in zip(pts, pts[1:]):
                stepped += [(xb, ya), (xb, yb)]
            pts = stepped
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts if math.isfinite(y))
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<polyline points="{line}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>')
        if len(s.points) <= 40 and not s.step:
            out += [
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{s.color}"/>'
                for x, y in s.points
                if math.isfinite(y)
            ]
    lx = float(left)
    for name, color in [(s.name, s.color) for s in series] + [(b.name, b.color) for b in bands]:
        out.append(
            f'<rect x="{lx}" y="24" width="10" height="10" fill="{color}"/>'
            f'<text x="{lx + 14}" y="33" font-size="11" fill="{COLORS["text"]}">{escape(name)}</text>'
        )
        lx += 24 + 6.5 * len(name)
    out.append("</svg>")
    return Markup("".join(out))


def share_bar(parts: Sequence[tuple[str, float, str]], width: int = 560, height: int = 26) -> Markup:
    """A horizontal bar split by share: (label, share in [0, 1], color) for each part."""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="bar" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="traffic split">'
    ]
    x = 0.0
    for label, share, color in parts:
        w = max(0.0, min(1.0, share)) * width
        if w <= 0:
            continue
        out.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="{color}"/>')
        if w > 60:
            out.append(
                f'<text x="{x + 6:.1f}" y="{height / 2 + 4}" font-size="12" fill="#fff">'
                f"{escape(label)} {share:.0%}</text>"
            )
        x += w
    out.append("</svg>")
    return Markup("".join(out))
