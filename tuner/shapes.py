"""Shape files: the GEMM keys a model needs, one line each.

A line is

    M[,M...]  N  K[,K...]  [groups=G] [dtype=bf16] [dtype_out=bf16] [layout=tn] [held=S]
                           [overlap=allreduce:BYTES] [name=TEXT]

- Several comma-separated M values expand to one key each (the batch sizes
  a deployment sees for one weight).
- Several comma-separated K values describe seed 000's grouped form: G
  problems of M x N, each with its own K (groups must equal their count).
- `groups=G` alone is the MoE form: M is the total rows split over G experts.
- `dtype` is the input dtype (bf16, fp16), `dtype_out` the output dtype
  (default: the input's), `layout` "tn" (y = x @ W.T, W stored (N, K) as
  nn.Linear keeps it) or "nn" (y = a @ b, b stored (K, N)).
- `held=S`: S SMs are held by another kernel while the GEMM runs (seed 003).
- `overlap=allreduce:BYTES`: an all-reduce of BYTES runs beside the GEMM
  (tensor parallelism); `gemm` and `patch` look such keys up under an
  overlap hint (`tuner.runtime.dispatch.overlap`).
- `#` starts a comment; blank lines are ignored.

A bad line raises ShapeFileError reading `FILE:LINE: what is wrong`; the
whole file is parsed before anything is tuned, so a bad line stores nothing.
A shape file name that is not an existing path is looked up among the files
shipped in `tuner/data/` (so `--shapes gemma3.txt` works from anywhere).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kernels.space import DTYPES_IN, DTYPES_OUT, LAYOUTS, MAX_NAME
from tuner.key import Problem, parse_overlap

DATA_DIR = Path(__file__).resolve().parent / "data"
_OPTIONS = ("groups", "dtype", "dtype_out", "layout", "held", "overlap", "name")


class ShapeFileError(ValueError):
    """A shape file line that does not describe a valid key; the message starts with FILE:LINE."""


@dataclass(frozen=True)
class ShapeEntry:
    problem: Problem
    name: str
    line: int


def resolve(path: str | Path) -> Path:
    """`path` if it exists, else the shipped shape file of that name."""
    path = Path(path)
    if path.exists() or path.parent != Path("."):
        return path
    shipped = DATA_DIR / path.name
    return shipped if shipped.exists() else path


def parse_shapes(path: str | Path) -> list[ShapeEntry]:
    """Every key of the shape file at `path`, in file order, duplicates dropped."""
    path = resolve(path)
    return parse_text(_text(path), path)


def parse_text(text: str, path: str | Path) -> list[ShapeEntry]:
    """Every key of shape file text, errors naming `path` as its file."""
    entries: list[ShapeEntry] = []
    seen: set[Problem] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            parsed = _parse_line(text, number)
        except ValueError as exc:
            raise ShapeFileError(f"{path}:{number}: {exc}") from None
        for entry in parsed:
            if entry.problem not in seen:
                seen.add(entry.problem)
                entries.append(entry)
    if not entries:
        raise ShapeFileError(f"{path}:1: the file lists no GEMM keys")
    return entries


def parse_key(text: str) -> ShapeEntry:
    """One key written as a shape file line with a single M (e.g. on a command line)."""
    entries = _parse_line(text.split("#", 1)[0].strip(), 1)
    if len(entries) != 1:
        raise ValueError(f"{text!r} lists {len(entries)} keys; give one M")
    return entries[0]


def _text(path: Path) -> str:
    """The file as text: UTF-8, a leading byte-order mark dropped."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ShapeFileError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); a shape file is text") from None


def _parse_line(text: str, number: int) -> list[ShapeEntry]:
    fields = text.split()
    sizes = [f for f in fields if "=" not in f]
    options: dict[str, str] = {}
    for name, value in (_option(f) for f in fields if "=" in f):
        if name in options:
            raise ValueError(f"option {name!r} given twice")
        options[name] = value
    if len(options.get("name", "")) > MAX_NAME:
        raise ValueError(f"name is {len(options['name'])} characters; at most {MAX_NAME}")
    if len(sizes) < 3:
        missing = ("M", "N", "K")[len(sizes):]
        raise ValueError(f"missing {', '.join(missing)}: a line is 'M N K [option=value ...]'")
    if len(sizes) > 3:
        raise ValueError(f"unexpected field {sizes[3]!r} after M N K (options are name=value)")
    ms = _ints("M", sizes[0])
    (n,) = _ints("N", sizes[1], many=False)
    ks = _ints("K", sizes[2])
    groups = _ints("groups", options["groups"], many=False)[0] if "groups" in options else 1
    dtype = options.get("dtype", "bf16")
    if dtype not in DTYPES_IN:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES_IN}")
    dtype_out = options.get("dtype_out", dtype)
    if dtype_out not in DTYPES_OUT:
        raise ValueError(f"unknown dtype_out {dtype_out!r}; expected one of {DTYPES_OUT}")
    layout = options.get("layout", "tn")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    held = _ints("held", options["held"], many=False)[0] if "held" in options else 0
    overlap = parse_overlap(options["overlap"]) if "overlap" in options else 0
    if held and overlap:
        raise ValueError("held and overlap both say what runs beside the GEMM: give one")
    group_k: tuple[int, ...] = ()
    if len(ks) > 1:
        if "groups" in options and groups != len(ks):
            raise ValueError(f"groups={groups} but {len(ks)} per-group K values")
        groups, group_k = len(ks), tuple(ks)
    return [
        ShapeEntry(
            Problem(m, n, max(ks), groups, dtype, dtype_out, layout, group_k, held, overlap),
            options.get("name", ""), number,
        )
        for m in ms
    ]


def _option(field: str) -> tuple[str, str]:
    name, _, value = field.partition("=")
    if name not in _OPTIONS:
        raise ValueError(f"unknown option {name!r}; expected one of {_OPTIONS}")
    if not value:
        raise ValueError(f"option {name!r} has no value")
    return name, value


def _ints(name: str, text: str, many: bool = True) -> list[int]:
    parts = text.split(",")
    if not many and len(parts) > 1:
        raise ValueError(f"{name} takes one value, got {text!r}")
    values = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {part!r}") from None
        if value < 1 and not (name == "held" and value == 0):
            raise ValueError(f"{name} must be positive, got {value}")
        values.append(value)
    return values
