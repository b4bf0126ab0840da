"""Request and response models of the HTTP service.

Every bound a request can break is stated on the request models, so that it
is answered with a 422 naming the field. Response models check nothing: what
the database holds is served as it is, never refused with a 500. The record
form (`Record`, `RecordIn`) lives in `tuner.records`, shared with the CLI.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, Json

from tuner.records import (
    Arch, Backend, Carveout, Device, DtypeIn, DtypeOut, Groups, Key, Layout, Overlap, Record, Size, Versions,
)

MAX_PAGE = 1000
MAX_OFFSET = 2**31
# An import stores a record in a few milliseconds: a request stays within seconds.
MAX_IMPORT = 1000


class BestQuery(BaseModel):
    """GET /v1/best. `device` omitted: the device with the best-matching winner
    of `arch`. `current_versions` omitted: the versions of the newest
    environment recorded for the winner's device and backend."""

    model_config = ConfigDict(extra="ignore")

    m: Size
    n: Size
    k: Size
    groups: Groups = 1
    dtype: DtypeIn = "bf16"
    dtype_out: Optional[DtypeOut] = Field(None, description="Output dtype; default: `dtype`.")
    layout: Layout = "tn"
    arch: Arch = "sm90"
    device: Optional[Device] = None
    carveout: Carveout = 0
    overlap: Overlap = Field(0, description="Bytes of an all-reduce running beside the GEMM (0: none).")
    current_versions: Optional[Json[Versions]] = Field(
        None, description='JSON object of the versions the caller runs, e.g. {"torch": "2.13.0", ...}.',
    )


class ResultsQuery(BaseModel):
    """GET /v1/results: every given field must match."""

    model_config = ConfigDict(extra="ignore")

    arch: Optional[Arch] = None
    device: Optional[Device] = None
    backend: Optional[Backend] = None
    m: Optional[Size] = None
    n: Optional[Size] = None
    k: Optional[Size] = None
    groups: Optional[Groups] = None
    limit: int = Field(100, ge=1, le=MAX_PAGE)
    offset: int = Field(0, ge=0, le=MAX_OFFSET)


class Best(BaseModel):
    """The choice serving a key. `key` is the key asked for (its device
    resolved). `how`: "range" (an interval of the family's M map, `interval`,
    with the measurements behind it in `evidence`), "exact" (the winner tuned
    at M) or "nearest" (a family without a map: the winner of a tuned M whose
    own interval holds M). `tuned_m` is the measured M nearest to the key's;
    `ms` and `baseline_ms` are the choice's and cuBLAS's times there. `config`
    is None when cuBLAS is the choice."""

    key: Key
    name: str
    config: Optional[dict]
    config_name: str
    scheduler: str
    ms: float
    baseline_ms: float
    speedup: float
    backend: str
    versions: dict[str, str]
    current_versions: dict[str, str]
    stale: bool
    exact: bool
    tuned_m: int
    how: str
    interval: Optional[tuple[int, int]] = None
    evidence: list[dict] = []
    reason: str
    updated_at: datetime


class Results(BaseModel):
    items: list[Record]
    total: int
    limit: int
    offset: int


class Imported(BaseModel):
    received: int
    imported: int


class Health(BaseModel):
    status: Literal["ok"]
