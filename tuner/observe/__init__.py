"""Seeing what the tuner found: M-map plots, the HTML report and per-tile
traces of a kernel's schedule."""
