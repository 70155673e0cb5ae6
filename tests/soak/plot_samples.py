#!/usr/bin/env python3
"""Plots dbuf-soak's --samples CSV as an SVG (standard library only): the
daemon's resident memory (all of it, and its anonymous part), its fds and
mappings, and the ranks killed, over the run.

    tests/soak/plot_samples.py SAMPLES.csv OUT.svg [TITLE]
"""
import csv
import sys


def polyline(points, width, height, x_max, y_max, color):
    coords = " ".join(f"{60 + x / x_max * (width - 80):.1f},{height - 30 - y / y_max * (height - 60):.1f}"
                      for x, y in points)
    return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}"/>'


def panel(rows, series, title, unit, top, width=800, height=220):
    """One chart: `series` is [(column, label, color, scale)]."""
    x_max = max(float(r["seconds"]) for r in rows) or 1.0
    y_max = max(max(float(r[c]) * s for r in rows) for c, _, _, s in series) * 1.15 or 1.0
    parts = [f'<g transform="translate(0,{top})">',
             f'<text x="60" y="16" font-size="13">{title}</text>',
             f'<line x1="60" y1="{height - 30}" x2="{width - 20}" y2="{height - 30}" stroke="#888"/>',
             f'<line x1="60" y1="30" x2="60" y2="{height - 30}" stroke="#888"/>',
             f'<text x="{width - 20}" y="{height - 12}" font-size="11" text-anchor="end">{x_max:.0f} s</text>',
             f'<text x="56" y="34" font-size="11" text-anchor="end">{y_max:.0f}</text>',
             f'<text x="56" y="{height - 30}" font-size="11" text-anchor="end">0</text>',
             f'<text x="20" y="{height / 2}" font-size="11" transform="rotate(-90 20 {height / 2})">{unit}</text>']
    for i, (column, label, color, scale) in enumerate(series):
        points = [(float(r["seconds"]), float(r[column]) * scale) for r in rows]
        parts.append(polyline(points, width, height, x_max, y_max, color))
        parts.append(f'<text x="{80 + 200 * i}" y="{height - 2}" font-size="11" fill="{color}">{label}</text>')
    parts.append("</g>")
    return "\n".join(parts)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit(f"{sys.argv[1]}: no samples")
    step = max(1, len(rows) // 400)  # a few hundred points are enough for the eye
    rows = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    title = sys.argv[3] if len(sys.argv) > 3 else "dbuf-soak"
    charts = [
        panel(rows, [("rss_kib", "RSS (incl. shared shards)", "#1f77b4", 1 / 1024),
                     ("rss_anon_kib", "anonymous RSS", "#d62728", 1 / 1024)], f"{title}: dbufd memory", "MiB", 30),
        panel(rows, [("fds", "open fds", "#2ca02c", 1), ("maps", "mappings", "#9467bd", 1),
                     ("memfds", "dbuf memfds", "#8c564b", 1)], "dbufd fds and mappings", "count", 260),
        panel(rows, [("kills", "ranks killed (cumulative)", "#ff7f0e", 1)], "chaos", "ranks", 490),
    ]
    with open(sys.argv[2], "w") as out:
        out.write('<svg xmlns="http://www.w3.org/2000/svg" width="800" height="720" font-family="sans-serif">\n')
        out.write('<rect width="100%" height="100%" fill="white"/>\n')
        out.write("\n".join(charts))
        out.write("\n</svg>\n")


if __name__ == "__main__":
    main()
