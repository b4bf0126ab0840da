"""The HTTP service over the winners database (OpenAPI at /docs).

`GET /v1/best` answers "which config for this key" by the rule `gemm` uses
(`tuner.lookup.decide`): the interval of the family's M map that covers M,
with the measurements behind it; for a family without a map, the winner
tuned at M or, within its own interval, the nearest tuned M's; else 404.
Without `device`, every device of the arch with results for the family
(dtypes, layout, N, K, groups) competes: a measured (gpu) result over a
modeled one, then a map interval, then the latest. `stale` compares the
choice's versions with `current_versions` when the caller sends them (what it
runs), else with the newest environment recorded for its device and backend:
a choice is stale once that device has been tuned under other software.

`POST /v1/results` imports records in the `tuner export` form behind a bearer
token: the server's TUNER_TOKEN. Without one configured imports are refused
with 403 (the server is read-only by choice, not unavailable); a missing or
wrong token gets 401.

Reads use a reader store (SQLite readers never wait behind a tuning process
writing in WAL mode) through a cache that drops its answers when the database
changes (`service.cache`); imports open a writer store on first use.
"""

from __future__ import annotations

import hmac
import math
import os
import threading
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Annotated

from fastapi import APIRouter, Body, Depends, FastAPI, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from db.engine import resolve_url, writable
from db.models import Environment
from db.store import Store
from service.cache import MISSING, Cache
from service.schemas import MAX_IMPORT, Best, BestQuery, Health, Imported, Results, ResultsQuery
from tuner.records import Key, Record, RecordIn
from tuner.runtime.lookup import RANGE, Decision, decide

TOKEN_ENV = "TUNER_TOKEN"
# A full import (MAX_IMPORT records of about 1 KB) fits with room to spare.
MAX_BODY_BYTES = 4 * 1024 * 1024
# Winners of one family (every M, every device of an arch) a lookup reads.
_MAX_FAMILY = 100_000


def create_app(db_url: str | None = None, *, token: str | None = None) -> FastAPI:
    """The app over `db_url` (None: $TUNER_DB, else the default file); imports
    need `token`, else $TUNER_TOKEN."""
    url = resolve_url(db_url)
    # Readers do not migrate: bring the schema up once here, unless the
    # database is read-only (then it is served as it is).
    if writable(url):
        Store(url).close()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.cache.close()
        app.state.store.close()
        if app.state.writer is not None:
            app.state.writer.close()

    app = FastAPI(
        title="GEMM tuner", version=_version(), lifespan=lifespan,
        description="Tuned GEMM kernel configs per (arch, device, dtypes, layout, M, N, K, groups) key.",
    )
    app.state.url = url
    app.state.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    app.state.store = Store(url, writer=False)
    app.state.cache = Cache(app.state.store.engine)
    app.state.writer = None
    app.state.writer_lock = threading.Lock()
    app.include_router(_router)
    app.add_middleware(_KnownAnswers, cache=app.state.cache)
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    app.add_exception_handler(SQLAlchemyError, _database_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    return app


# ---------------------------------------------------------------- dependencies


# Dependencies and fast routes are coroutines: a sync one costs a hop to the
# thread pool, and a thread holding the GIL delays the event loop's socket
# calls by up to the interpreter's switch interval.


async def reader(request: Request) -> Store:
    return request.app.state.store


async def answers(request: Request) -> Cache:
    return request.app.state.cache


def writer(request: Request) -> Store:
    state = request.app.state
    with state.writer_lock:
        if state.writer is None:
            state.writer = Store(state.url)
    return state.writer


_bearer = HTTPBearer(auto_error=False, description=f"The server's {TOKEN_ENV}.")


async def authorized(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    token = request.app.state.token
    if token is None:
        raise HTTPException(403, f"imports are disabled: the server was started without {TOKEN_ENV}")
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})


Reader = Annotated[Store, Depends(reader)]
Writer = Annotated[Store, Depends(writer)]
Answers = Annotated[Cache, Depends(answers)]


# ---------------------------------------------------------------- routes


_router = APIRouter()


@_router.get("/healthz", response_model=Health)
async def healthz(store: Reader) -> Health:
    with store.engine.connect() as conn:
        conn.exec_driver_sql("SELECT 1")
    return Health(status="ok")


@_router.get("/v1/best", response_model=Best, responses={404: {"description": "No measured choice covers the key."}})
async def best(q: Annotated[BestQuery, Query()], store: Reader, cache: Answers) -> Best:
    """The choice serving a key: its family's M map interval, else the exact or nearest winner."""
    # Blocks the loop on a cache miss (about a millisecond): cheaper than a
    # thread hop for every request.
    dtype_out = q.dtype_out or q.dtype
    fields = dict(
        arch=q.arch, device=q.device, dtype_in=q.dtype, dtype_out=dtype_out, layout=q.layout,
        n=q.n, k=q.k, groups=q.groups, group_k="", carveout=q.carveout, overlap=q.overlap,
    )
    ranges, winners = cache.get(
        ("family", *fields.values()),
        lambda: (store.ranges(**fields), store.winners(limit=_MAX_FAMILY, **fields)),
    )
    found = _pick(q.m, ranges, winners)
    if found is None:
        where = f"device {q.device!r}" if q.device else f"any {q.arch} device"
        raise HTTPException(404, (
            f"no measured choice covers M={q.m} for {q.arch} {q.dtype}>{dtype_out} {q.layout} N={q.n} "
            f"K={q.k} groups={q.groups}{f' carveout={q.carveout}' if q.carveout else ''}"
            f"{f' overlap={q.overlap}' if q.overlap else ''} on {where}"
        ))
    device, d = found
    current = q.current_versions
    if current is None:
        env = (device, d.backend)
        current = cache.get(("versions", *env), lambda: _newest_versions(store, *env))
    updated = _range_time(ranges, device, d)
    return Best(
        key=Key(**{**fields, "device": device, "m": q.m, "group_k": []}),
        name=d.winner.name if d.winner else _family_name(winners, device),
        config=d.config, config_name=d.config_name, scheduler=d.scheduler, ms=d.ms,
        baseline_ms=d.baseline_ms, speedup=d.speedup, backend=d.backend, versions=d.versions,
        current_versions=current, stale=d.stale(current), exact=d.exact, tuned_m=d.tuned_m,
        how=d.how, interval=d.interval, evidence=list(d.evidence), reason=d.describe(), updated_at=updated,
    )


@_router.get("/v1/results", response_model=Results)
def results(q: Annotated[ResultsQuery, Query()], store: Reader) -> Results:
    """Stored winners matching every given filter, ordered by N, K, M."""
    filters = q.model_dump(exclude={"limit", "offset"})
    rows = store.winners(limit=q.limit, offset=q.offset, **filters)
    items = [Record(**w.to_record()) for w in rows]
    return Results(items=items, total=store.count_winners(**filters), limit=q.limit, offset=q.offset)


@_router.post("/v1/results", response_model=Imported, dependencies=[Depends(authorized)])
def import_results(
    records: Annotated[list[RecordIn], Body(max_length=MAX_IMPORT)], store: Writer, cache: Answers,
) -> Imported:
    """Store winners; a stored winner is replaced only by a faster one."""
    count = store.import_records(r.model_dump() for r in records)
    cache.clear()
    return Imported(received=len(records), imported=count)


# ---------------------------------------------------------------- helpers


class _KnownAnswers:
    """Replays the bytes of a /v1/best answer already given for the same query
    string while the database is unchanged. Parsing, validating and encoding
    cost over ten times the replay (about 200 against 15 microseconds here): a fleet asking for its model's keys over
    and over gets them at the cost of the HTTP exchange. Only answers (200,
    404) are kept; rejected queries go through every time."""

    _PATH = "/v1/best"
    _KEPT = (200, 404)

    def __init__(self, app, cache: Cache) -> None:
        self.app, self.cache = app, cache

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != self._PATH or scope["method"] != "GET":
            return await self.app(scope, receive, send)
        key = ("answer", scope["query_string"])
        known, generation = self.cache.find(key)
        if known is not MISSING:
            for message in known:
                await send(message)
            return
        sent = []

        async def keep(message) -> None:
            sent.append(message)
            await send(message)

        await self.app(scope, receive, keep)
        if len(sent) == 2 and sent[0].get("status") in self._KEPT and not sent[1].get("more_body"):
            self.cache.put(key, tuple(sent), generation)



class _BodyLimit:
    """413 for a request body over `limit` bytes: by its Content-Length, or,
    sent in chunks without one, read up to the limit before the app sees it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.limit:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        chunks, seen, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                return await self._refuse(send)
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = f'{{"detail":"request body over {self.limit} bytes"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _pick(m: int, ranges: list, winners: list) -> tuple[str, Decision] | None:
    """`decide` on each device's results; among devices a measured (gpu)
    choice over a modeled one, then a map interval, then the latest."""
    devices = sorted({r.family["device"] for r in ranges} | {w.key["device"] for w in winners})
    found = []
    for device in devices:
        d = decide(m, [r for r in ranges if r.family["device"] == device],
                   [w for w in winners if w.key["device"] == device])
        if d is not None:
            found.append((device, d))
    if not found:
        return None
    return min(found, key=lambda pair: (pair[1].backend != "gpu", pair[1].how != RANGE,
                                        -_range_time(ranges, *pair).timestamp()))


def _range_time(ranges: list, device: str, d: Decision):
    """When the range (or winner) behind `d` was stored."""
    if d.winner is not None:
        return d.winner.updated_at
    return next(r.updated_at for r in ranges if r.family["device"] == device and r.covers(d.m))


def _family_name(winners: list, device: str) -> str:
    return next((w.name for w in winners if w.key["device"] == device and w.name), "")


def _newest_versions(store: Store, device: str, backend: str) -> dict[str, str]:
    stmt = (
        select(Environment.versions).filter_by(device=device, backend=backend)
        .order_by(Environment.created_at.desc(), Environment.id.desc()).limit(1)
    )
    with store.session() as s:
        return s.scalar(stmt)


# Errors of a 422 reported at most: a body with a million bad fields gets a short answer.
_MAX_ERRORS = 20


async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 naming each bad field, without echoing the input back
    (a large body would come back whole) and with at most `_MAX_ERRORS` errors."""
    errors = [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()[:_MAX_ERRORS]]
    return JSONResponse({"detail": _finite(jsonable_encoder(errors))}, status_code=422)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


async def _database_error(_request: Request, exc: SQLAlchemyError) -> JSONResponse:
    return JSONResponse({"detail": f"database unavailable: {type(exc).__name__}"}, status_code=503)


def _version() -> str:
    try:
        return metadata.version("gemm-tuner")
    except metadata.PackageNotFoundError:
        return "0"
