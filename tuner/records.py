"""The record form of a stored winner, shared by `tuner export`/`import`
and the HTTP service: every bound a record can break is stated on the models,
so a bad record is refused with a message naming its field, before anything
is written.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kernels.space import (
    ARCHS, DTYPES_IN, DTYPES_OUT, LAYOUTS, MAX_CARVEOUT, MAX_DIM, MAX_KEY_GROUPS, MAX_NAME, MAX_OVERLAP, GemmConfig,
    InvalidConfig,
)

MAX_SIZE = MAX_DIM
MAX_GROUPS = MAX_KEY_GROUPS
# Column width of the per-group K list (db.models.GemmKey.group_k).
GROUP_K_CHARS = 256

Arch = Literal[ARCHS]
DtypeIn = Literal[DTYPES_IN]
DtypeOut = Literal[DTYPES_OUT]
Layout = Literal[LAYOUTS]
Size = Annotated[int, Field(ge=1, le=MAX_SIZE)]
Groups = Annotated[int, Field(ge=1, le=MAX_GROUPS)]
Carveout = Annotated[int, Field(ge=0, le=MAX_CARVEOUT)]
Overlap = Annotated[int, Field(ge=0, le=MAX_OVERLAP)]
# 1 ns to about 3 hours: a speedup (a ratio of two) stays a finite number.
Millis = Annotated[float, Field(ge=1e-6, le=1e7)]
# Column widths of the tables (db.models): longer text could not be stored.
Device = Annotated[str, Field(min_length=1, max_length=128)]
Backend = Annotated[str, Field(min_length=1, max_length=16)]
Versions = Annotated[
    dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=256)]], Field(max_length=64),
]


class Key(BaseModel):
    """A tuning key: (arch, device, dtypes, layout, M, N, K, groups)."""

    arch: str
    device: str
    dtype_in: str
    dtype_out: str
    layout: str
    m: int
    n: int
    k: int
    groups: int = 1
    group_k: list[int] = Field(default_factory=list)
    carveout: int = 0
    overlap: int = 0


class KeyIn(Key):
    """A key to store: one the pool's rules and the tables can hold."""

    model_config = ConfigDict(extra="forbid")

    arch: Arch
    device: Device
    dtype_in: DtypeIn
    dtype_out: DtypeOut
    layout: Layout
    m: Size
    n: Size
    k: Size
    groups: Groups = 1
    group_k: list[Size] = Field(default_factory=list, max_length=MAX_GROUPS)
    carveout: Carveout = 0
    overlap: Overlap = 0

    @model_validator(mode="after")
    def _group_k_fits(self) -> "KeyIn":
        if self.carveout and self.overlap:
            raise ValueError("carveout and overlap both say what runs beside the GEMM: give one")
        if self.group_k and len(self.group_k) != self.groups:
            raise ValueError(f"group_k holds {len(self.group_k)} values for {self.groups} groups")
        if len(",".join(map(str, self.group_k))) > GROUP_K_CHARS:
            raise ValueError(f"group_k takes more than {GROUP_K_CHARS} characters as text")
        return self


class Record(BaseModel):
    """A stored winner in the export / import form (`tuner export`)."""

    key: Key
    name: str = ""
    config: Optional[dict] = None
    config_name: str
    scheduler: str
    ms: float
    baseline_ms: float
    speedup: Optional[float] = None
    best_by_scheduler: dict[str, float] = Field(default_factory=dict)
    trials: int = 0
    backend: str
    versions: dict[str, str]
    updated_at: Optional[datetime] = None


class RecordIn(Record):
    """A record to import: bounded to what the tables hold, its config one the
    pool can build. `speedup` is recomputed from the times."""

    model_config = ConfigDict(extra="forbid")

    key: KeyIn
    name: Annotated[str, Field(max_length=MAX_NAME)] = ""
    config_name: Annotated[str, Field(min_length=1, max_length=160)]
    scheduler: Annotated[str, Field(min_length=1, max_length=32)]
    ms: Millis
    baseline_ms: Millis
    best_by_scheduler: dict[Annotated[str, Field(max_length=32)], Millis] = Field(default_factory=dict, max_length=16)
    trials: Annotated[int, Field(ge=0, le=MAX_SIZE)] = 0
    backend: Backend
    versions: Versions

    @field_validator("config")
    @classmethod
    def _pool_config(cls, value: dict | None) -> dict | None:
        if value is not None:
            try:
                GemmConfig.from_dict(value)
            except (InvalidConfig, TypeError) as exc:
                raise ValueError(f"not a valid pool config: {exc}") from None
        return value


# The export file: a versioned envelope around the records (`tuner export`).
EXPORT_FORMAT = "gemm-tuner-winners"
EXPORT_VERSION = 1


class RecordError(ValueError):
    """A record that cannot be imported; the message names the record and field."""


def validate_records(data) -> list[dict]:
    """The records of an export (the versioned envelope, or the bare list of
    older exports), each checked as `POST /v1/results` checks it; the first bad
    one raises RecordError naming its index and field. Nothing is written here:
    an import stores all records or, on an error, none."""
    from pydantic import ValidationError

    if isinstance(data, dict):
        if data.get("format") != EXPORT_FORMAT:
            raise RecordError(f"not a winners export: format is {data.get('format')!r}, expected {EXPORT_FORMAT!r}")
        if data.get("version") != EXPORT_VERSION:
            raise RecordError(f"export version {data.get('version')!r}; this tuner reads version {EXPORT_VERSION}")
        data = data.get("records")
    if not isinstance(data, list):
        raise RecordError("expected a winners export: an object with 'records', or a list of records")
    out = []
    for i, raw in enumerate(data):
        try:
            out.append(RecordIn.model_validate(raw).model_dump())
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(map(str, first["loc"])) or "record"
            raise RecordError(f"record {i}: {field}: {first['msg']}") from None
    return out
