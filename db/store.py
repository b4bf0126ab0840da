"""Store functions over the tables: the only way the rest of the project touches them.

Keys are passed as plain dicts of the `KEY_FIELDS` (db knows nothing of
the tuner's classes or of CUDA).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Iterable

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from db.engine import configure, engine_kwargs, make_engine, resolve_url, sqlite_path
from db.migrate import init_lock, revisions, upgrade
from db.models import Environment, GemmKey, Lease, LeaseEvent, MRange, Trial, Winner

KEY_FIELDS = (
    "arch", "device", "dtype_in", "dtype_out", "layout", "m", "n", "k", "groups", "group_k", "carveout", "overlap",
)
# Fields a key written before they existed lacks (their value then).
_KEY_DEFAULTS = {"overlap": 0}
# A family is a key without M: the unit an M map covers.
FAMILY_FIELDS = tuple(f for f in KEY_FIELDS if f != "m")


# Who measured a range of an M map.
LADDER = "ladder"
ONLINE = "online"


@dataclass(frozen=True)
class WinnerView:
    """A winner with its key and environment, detached from the session."""

    key: dict[str, Any]
    name: str
    config_name: str
    scheduler: str
    config: dict | None
    ms: float
    baseline_ms: float
    speedup: float
    best_by_scheduler: dict[str, float]
    trials: int
    backend: str
    versions: dict[str, str]
    updated_at: datetime

    def stale(self, versions: dict[str, str]) -> bool:
        return self.versions != versions

    def to_record(self) -> dict[str, Any]:
        """The export / import form."""
        return {
            "key": self.key, "name": self.name, "config": self.config, "config_name": self.config_name,
            "scheduler": self.scheduler, "ms": self.ms, "baseline_ms": self.baseline_ms,
            "speedup": self.speedup, "best_by_scheduler": self.best_by_scheduler, "trials": self.trials,
            "backend": self.backend, "versions": self.versions, "updated_at": self.updated_at.isoformat(),
        }


@dataclass(frozen=True)
class RangeView:
    """One interval of a family's M map, detached from the session: every M in
    [m_lo, m_hi] runs `config` (None: cuBLAS); `evidence` is the measurements
    behind the choice ({"m": M, "ms": {candidate: ms}}, cuBLAS as "cublas")."""

    family: dict[str, Any]
    m_lo: int
    m_hi: int
    config_name: str
    scheduler: str
    config: dict | None
    evidence: list[dict]
    source: str
    backend: str
    versions: dict[str, str]
    updated_at: datetime

    def covers(self, m: int) -> bool:
        return self.m_lo <= m <= self.m_hi

    def stale(self, versions: dict[str, str]) -> bool:
        return self.versions != versions

    def nearest_point(self, m: int) -> dict:
        """The evidence point nearest to `m` in ratio."""
        return min(self.evidence, key=lambda p: (abs(math.log(p["m"] / m)), -p["m"]))


@dataclass(frozen=True)
class TrialView:
    config_name: str
    scheduler: str
    config: dict | None
    ok: bool
    ms: float | None
    error: str | None


@dataclass(frozen=True)
class LeaseEventView:
    name: str
    owner: str
    event: str
    previous: str | None
    at: datetime


@dataclass(frozen=True)
class KeyTrials:
    """Every trial of one key measured under one environment."""

    key: dict[str, Any]
    name: str
    backend: str
    trials: list[TrialView]


def fingerprint(backend: str, arch: str, device: str, versions: dict[str, str]) -> str:
    text = json.dumps([backend, arch, device, versions], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class StoreError(RuntimeError):
    """A database that cannot be opened as asked; the message says which and why."""


class Store:
    """One database: our tables plus Optuna's studies. A writer migrates it on
    open; a reader writes nothing (a read-only file or directory serves), and
    a SQLite file that does not exist is an error rather than a new empty one,
    as is (unless not `current`) one of an older schema."""

    def __init__(self, url: str | None = None, *, writer: bool = True, current: bool = True) -> None:
        self.url = resolve_url(url)
        where = make_url(self.url).render_as_string(hide_password=True)
        path = sqlite_path(self.url)
        if not writer and path is not None and not path.is_file():
            raise StoreError(f"no database at {path}")
        try:
            self.engine = make_engine(self.url, writer=writer)
            if writer:
                upgrade(self.engine)
            else:
                with self.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1 FROM tuner_environments LIMIT 1")
                    found, head = revisions(conn)
        except (SQLAlchemyError, OSError) as exc:
            raise StoreError(f"cannot open database {where}: {_reason(exc)}") from None
        if not writer and current and found != head:
            raise StoreError(f"database {where} has schema revision {found}, this release reads {head}: "
                             f"`tuner migrate` upgrades it, keeping every row")
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._optuna = None

    def close(self) -> None:
        self.engine.dispose()

    def session(self) -> Session:
        return self._sessions()

    def optuna_storage(self):
        """Optuna's RDB storage on the same database, with the same SQLite handling."""
        if self._optuna is None:
            import optuna

            # Optuna creates its tables on first use: once, under the set-up lock.
            with init_lock(self.engine):
                storage = optuna.storages.RDBStorage(self.url, engine_kwargs=engine_kwargs(self.url))
            configure(storage.engine)
            self._optuna = storage
        return self._optuna

    # -- environments and keys ------------------------------------------------

    def environment(self, backend: str, arch: str, device: str, versions: dict[str, str]) -> int:
        fp = fingerprint(backend, arch, device, versions)
        return self._get_or_create(
            Environment, {"fingerprint": fp},
            dict(backend=backend, arch=arch, device=device, versions=versions),
        )

    def key_id(self, key: dict[str, Any], name: str = "") -> int:
        return self._get_or_create(GemmKey, _key_filter(key), {"name": name})

    def _get_or_create(self, model, match: dict, extra: dict) -> int:
        with self.session() as s:
            try:
                with s.begin():
                    found = s.scalar(select(model.id).filter_by(**match))
                    if found is None:
                        row = model(**match, **extra)
                        s.add(row)
                        s.flush()
                        found = row.id
                return found
            except IntegrityError:
                # PostgreSQL: another process inserted it between our read and insert.
                with s.begin():
                    return s.scalar(select(model.id).filter_by(**match))

    # -- trials -----------------------------------------------------------------

    def record_trials(self, key_id: int, env_id: int, rows: Iterable[dict[str, Any]]) -> None:
        """Store measured trials of one key in one transaction (one insert).
        A row holds config_name, scheduler, config, ok and ms, and may hold
        rel_err, error and detail."""
        values = [
            dict(key_id=key_id, env_id=env_id, config_name=r["config_name"], scheduler=r["scheduler"],
                 config=r["config"], ok=r["ok"], ms=r["ms"], rel_err=r.get("rel_err"),
                 error=(r.get("error") or None) and r["error"][:1000], detail=r.get("detail") or {})
            for r in rows
        ]
        if not values:
            return
        with self.session() as s, s.begin():
            s.execute(insert(Trial), values)

    def trials(self, key_id: int, env_id: int) -> list[TrialView]:
        with self.session() as s:
            rows = s.scalars(select(Trial).filter_by(key_id=key_id, env_id=env_id).order_by(Trial.id))
            return [TrialView(t.config_name, t.scheduler, t.config, t.ok, t.ms, t.error) for t in rows]

    def key_trials(self, backend: str | None = None, **filters: Any) -> list[KeyTrials]:
        """The trials of every key matching the given fields (None = any), one
        entry per key and environment, by key."""
        unknown = set(filters) - set(KEY_FIELDS)
        if unknown:
            raise ValueError(f"unknown filter fields: {sorted(unknown)}")
        stmt = (
            select(Trial, GemmKey, Environment)
            .join(GemmKey, Trial.key_id == GemmKey.id)
            .join(Environment, Trial.env_id == Environment.id)
        )
        clean = {f: v for f, v in filters.items() if v is not None}
        for name, value in _key_filter(clean, partial=True).items():
            stmt = stmt.where(getattr(GemmKey, name) == value)
        if backend is not None:
            stmt = stmt.where(Environment.backend == backend)
        stmt = stmt.order_by(GemmKey.n, GemmKey.k, GemmKey.m, GemmKey.id, Environment.id, Trial.id)
        out: dict[tuple[int, int], KeyTrials] = {}
        with self.session() as s:
            for t, k, e in s.execute(stmt):
                entry = out.get((k.id, e.id))
                if entry is None:
                    entry = out[k.id, e.id] = KeyTrials(_key_dict(k), k.name, e.backend, [])
                entry.trials.append(TrialView(t.config_name, t.scheduler, t.config, t.ok, t.ms, t.error))
        return list(out.values())

    # -- winners ----------------------------------------------------------------

    def set_winner(
        self, key_id: int, env_id: int, *, config_name: str, scheduler: str, config: dict | None,
        ms: float, baseline_ms: float, best_by_scheduler: dict[str, float], trials: int,
    ) -> None:
        values = dict(
            env_id=env_id, config_name=config_name, scheduler=scheduler, config=config, ms=ms,
            baseline_ms=baseline_ms, speedup=baseline_ms / ms, best_by_scheduler=best_by_scheduler,
            trials=trials,
        )
        with self.session() as s, s.begin():
            row = s.scalar(select(Winner).filter_by(key_id=key_id))
            if row is None:
                s.add(Winner(key_id=key_id, **values))
            else:
                for name, value in values.items():
                    setattr(row, name, value)

    def winner(self, key: dict[str, Any]) -> WinnerView | None:
        found = self.winners(limit=1, **_key_filter(key))
        return found[0] if found else None

    def winners(
        self, *, limit: int = 100, offset: int = 0, order_by_m: bool = False, **filters: Any,
    ) -> list[WinnerView]:
        """Winners whose key matches every given field (None = any)."""
        stmt = self._winner_query(filters)
        stmt = stmt.order_by(GemmKey.n, GemmKey.k, GemmKey.m, GemmKey.id).limit(limit).offset(offset)
        with self.session() as s:
            return [_view(w, k, e) for w, k, e in s.execute(stmt)]

    def count_winners(self, **filters: Any) -> int:
        stmt = select(func.count()).select_from(self._winner_query(filters).subquery())
        with self.session() as s:
            return s.scalar(stmt)

    def tuned_m(self, key: dict[str, Any]) -> list[int]:
        """M values with a winner for `key`'s other fields (for nearest-M lookup)."""
        match = {f: key[f] for f in KEY_FIELDS if f != "m"}
        stmt = (
            select(GemmKey.m).join(Winner, Winner.key_id == GemmKey.id)
            .where(*(getattr(GemmKey, f) == v for f, v in _key_filter(match, partial=True).items()))
            .order_by(GemmKey.m)
        )
        with self.session() as s:
            return list(s.scalars(stmt))

    def _winner_query(self, filters: dict[str, Any]):
        unknown = set(filters) - set(KEY_FIELDS) - {"backend"}
        if unknown:
            raise ValueError(f"unknown filter fields: {sorted(unknown)}")
        backend = filters.pop("backend", None)
        stmt = (
            select(Winner, GemmKey, Environment)
            .join(GemmKey, Winner.key_id == GemmKey.id)
            .join(Environment, Winner.env_id == Environment.id)
        )
        clean = {f: v for f, v in filters.items() if v is not None}
        for name, value in _key_filter(clean, partial=True).items():
            stmt = stmt.where(getattr(GemmKey, name) == value)
        if backend is not None:
            stmt = stmt.where(Environment.backend == backend)
        return stmt

    # -- M maps -------------------------------------------------------------------

    def set_ranges(self, family: dict[str, Any], env_id: int, ranges: list[dict[str, Any]]) -> None:
        """Replace `family`'s map (on its device) by `ranges` (dicts of m_lo, m_hi,
        config_name, scheduler, config, evidence), measured by `tuner tune`.
        Online points the new map covers go; those beyond it stay."""
        match = _key_filter(family, fields=FAMILY_FIELDS)
        lo, hi = min(r["m_lo"] for r in ranges), max(r["m_hi"] for r in ranges)
        with self.session() as s, s.begin():
            s.execute(delete(MRange).filter_by(**match).where(
                (MRange.source != ONLINE) | ((MRange.m_hi >= lo) & (MRange.m_lo <= hi))))
            s.add_all(MRange(**match, env_id=env_id, source=LADDER, **r) for r in ranges)

    def add_online_range(self, family: dict[str, Any], env_id: int, rng: dict[str, Any]) -> bool:
        """Store a choice a live call measured, unless a range already covers
        its M (another process got there first). True when stored."""
        match = _key_filter(family, fields=FAMILY_FIELDS)
        with self.session() as s, s.begin():
            taken = s.scalar(select(MRange.id).filter_by(**match).where(
                MRange.m_lo <= rng["m_hi"], MRange.m_hi >= rng["m_lo"]).limit(1))
            if taken is not None:
                return False
            s.add(MRange(**match, env_id=env_id, source=ONLINE, **rng))
            return True

    def ranges(self, **filters: Any) -> list[RangeView]:
        """Map intervals whose family matches every given field (None = any),
        by device and M."""
        unknown = set(filters) - set(FAMILY_FIELDS)
        if unknown:
            raise ValueError(f"unknown filter fields: {sorted(unknown)}")
        clean = {f: v for f, v in filters.items() if v is not None}
        stmt = select(MRange, Environment).join(Environment, MRange.env_id == Environment.id)
        for name, value in _key_filter(clean, partial=True, fields=FAMILY_FIELDS).items():
            stmt = stmt.where(getattr(MRange, name) == value)
        stmt = stmt.order_by(MRange.n, MRange.k, MRange.device, MRange.m_lo, MRange.id)
        with self.session() as s:
            return [_range_view(r, e) for r, e in s.execute(stmt)]

    # -- leases -------------------------------------------------------------------

    def acquire(self, name: str, owner: str, ttl_s: float, dead: Callable[[str], bool] | None = None) -> bool:
        """Take the lease `name` for `ttl_s` seconds if it is free, expired,
        already `owner`'s, or held by an owner `dead` says has died. False when
        another owner holds it. Taking a lease from another owner is logged as
        a takeover (`lease_events`)."""
        now = datetime.now(timezone.utc)
        expires = now + timedelta(seconds=ttl_s)
        with self.session() as s:
            try:
                with s.begin():
                    row = s.get(Lease, name, with_for_update=True)
                    if row is None:
                        s.add(Lease(name=name, owner=owner, expires_at=expires))
                        s.add(LeaseEvent(name=name, owner=owner, event="take", at=now))
                        return True
                    if row.owner != owner:
                        if _utc(row.expires_at) > now and not (dead and dead(row.owner)):
                            return False
                        s.add(LeaseEvent(name=name, owner=owner, event="takeover", previous=row.owner, at=now))
                    row.owner, row.expires_at = owner, expires
                    return True
            except IntegrityError:  # PostgreSQL: another process inserted it first
                return False

    def renew(self, name: str, owner: str, ttl_s: float) -> bool:
        """Extend `owner`'s lease; False (logged as `lost`) when it is no
        longer `owner`'s: it expired and another owner took it over."""
        now = datetime.now(timezone.utc)
        with self.session() as s, s.begin():
            held = s.execute(update(Lease).filter_by(name=name, owner=owner).values(
                expires_at=now + timedelta(seconds=ttl_s))).rowcount == 1
            if not held:
                s.add(LeaseEvent(name=name, owner=owner, event="lost", at=now))
            return held

    def release(self, name: str, owner: str) -> None:
        with self.session() as s, s.begin():
            if s.execute(delete(Lease).filter_by(name=name, owner=owner)).rowcount:
                s.add(LeaseEvent(name=name, owner=owner, event="release"))

    def lease_events(self, name: str | None = None) -> list[LeaseEventView]:
        """The lease history (of one lease, or all), oldest first."""
        stmt = select(LeaseEvent).order_by(LeaseEvent.id)
        if name is not None:
            stmt = stmt.where(LeaseEvent.name == name)
        with self.session() as s:
            return [LeaseEventView(e.name, e.owner, e.event, e.previous, _utc(e.at)) for e in s.scalars(stmt)]

    # -- export / import ---------------------------------------------------------

    def export(self, **filters: Any) -> list[dict[str, Any]]:
        total = self.count_winners(**filters)
        return [w.to_record() for w in self.winners(limit=max(total, 1), **filters)]

    def import_records(self, records: Iterable[dict[str, Any]]) -> int:
        """Store exported winners; a record replaces a stored winner only if faster."""
        count = 0
        for rec in records:
            key = rec["key"]
            env_id = self.environment(rec["backend"], key["arch"], key["device"], rec["versions"])
            key_id = self.key_id(key, rec.get("name", ""))
            current = self.winner(key)
            if current is not None and current.ms <= rec["ms"]:
                continue
            self.set_winner(
                key_id, env_id, config_name=rec["config_name"], scheduler=rec["scheduler"],
                config=rec["config"], ms=rec["ms"], baseline_ms=rec["baseline_ms"],
                best_by_scheduler=rec.get("best_by_scheduler", {}), trials=rec.get("trials", 0),
            )
            count += 1
        return count


def _key_filter(key: dict[str, Any], partial: bool = False, fields: tuple[str, ...] = KEY_FIELDS) -> dict[str, Any]:
    out = {}
    for name in fields:
        if name in key:
            value = key[name]
        elif partial:
            continue
        elif name in _KEY_DEFAULTS:
            value = _KEY_DEFAULTS[name]
        else:
            raise ValueError(f"key is missing field {name!r}")
        if name == "group_k" and not isinstance(value, str):
            value = ",".join(map(str, value))
        out[name] = value
    return out


def _reason(exc: BaseException) -> str:
    """The driver's own words, one line, without SQLAlchemy's statement dump."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _utc(moment: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; they were stored in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _range_view(r: MRange, e: Environment) -> RangeView:
    family = {name: getattr(r, name) for name in FAMILY_FIELDS}
    family["group_k"] = [int(x) for x in r.group_k.split(",")] if r.group_k else []
    return RangeView(
        family=family, m_lo=r.m_lo, m_hi=r.m_hi, config_name=r.config_name, scheduler=r.scheduler,
        config=r.config, evidence=r.evidence, source=r.source, backend=e.backend, versions=e.versions,
        updated_at=r.updated_at,
    )


def _key_dict(k: GemmKey) -> dict[str, Any]:
    key = {name: getattr(k, name) for name in KEY_FIELDS}
    key["group_k"] = [int(x) for x in k.group_k.split(",")] if k.group_k else []
    return key


def _view(w: Winner, k: GemmKey, e: Environment) -> WinnerView:
    return WinnerView(
        key=_key_dict(k), name=k.name, config_name=w.config_name, scheduler=w.scheduler, config=w.config,
        ms=w.ms, baseline_ms=w.baseline_ms, speedup=w.speedup,
        best_by_scheduler=w.best_by_scheduler, trials=w.trials, backend=e.backend,
        versions=e.versions, updated_at=w.updated_at,
    )
