"""The house's import rule: imports only run down. Every import of the
project's code (function-level ones included) goes from a room to a room
below it, so the CLI and the service sit on top and `tuner` never imports
`service`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "db", "tuner", "service")
# Lowest first; a room may import only rooms listed before it.
FLOORS = [
    {"kernels", "db"},
    {"tuner.key"},
    {"tuner.records", "tuner.shapes", "tuner.config_shapes"},
    {"tuner.backends"},
    {"tuner.runtime"},
    {"tuner.search", "tuner.observe"},
    {"tuner.cli", "service"},
]


def _room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "tuner" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def _floor(room: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if room in rooms)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in out if name.split(".")[0] in PACKAGES]


def test_every_room_of_the_house_is_on_a_floor():
    rooms = {_room(".".join(p.relative_to(ROOT).with_suffix("").parts))
             for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    rooms.discard("tuner.__init__")
    assert rooms <= set().union(*FLOORS), rooms - set().union(*FLOORS)


def test_imports_only_run_down():
    upward = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            here = _room(".".join(path.relative_to(ROOT).with_suffix("").parts))
            if here == "tuner.__init__":
                continue
            for name in _imports(path):
                there = _room(name)
                # `from tuner import x` names a room by its second part.
                if there == "tuner" or there == here:
                    continue
                if _floor(there) >= _floor(here):
                    upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, "\n".join(upward)
