"""Where benchmark results go: one JSON file per host or device and benchmark."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def save(record: dict, out_dir: str, stem: str) -> Path:
    """Write `record` to `<out_dir>/<stem>.json`, print it, and say where it went."""
    path = Path(out_dir) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1)
    path.write_text(text + "\n")
    print(text)
    print(f"wrote {path}", file=sys.stderr)
    return path
