"""Post-mortem reports: a plain-text summary (:func:`render_text`) and one self-contained HTML file
(:func:`render_html`: plotly.js inlined, opens offline)."""

from __future__ import annotations

from stability.report._html import render_html
from stability.report._text import render_text

__all__ = ["render_html", "render_text"]
