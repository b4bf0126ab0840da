"""Our tables (prefixed: Optuna keeps its own `trials` and `studies` in the same database): environments (device + software versions), keys, trials, winners."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class Environment(Base):
    """A device with the software it was measured under; a winner measured
    under another environment of the same device is stale."""

    __tablename__ = "tuner_environments"
    __table_args__ = (UniqueConstraint("fingerprint"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    backend: Mapped[str] = mapped_column(String(16))
    arch: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(128))
    versions: Mapped[dict] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class _Family:
    """The columns of a family: everything of a key but M."""

    arch: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(128))
    dtype_in: Mapped[str] = mapped_column(String(8))
    dtype_out: Mapped[str] = mapped_column(String(8))
    layout: Mapped[str] = mapped_column(String(4))
    n: Mapped[int] = mapped_column(Integer)
    k: Mapped[int] = mapped_column(Integer)
    groups: Mapped[int] = mapped_column(Integer, default=1)
    # Comma-separated per-group K for the seed-000 grouped form; "" otherwise.
    group_k: Mapped[str] = mapped_column(String(256), default="")
    carveout: Mapped[int] = mapped_column(Integer, default=0)
    # Bytes of an all-reduce running beside the GEMM (tuner.key.Problem.overlap).
    overlap: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class GemmKey(_Family, Base):
    __tablename__ = "tuner_keys"
    __table_args__ = (
        UniqueConstraint(
            "arch", "device", "dtype_in", "dtype_out", "layout", "m", "n", "k", "groups",
            "group_k", "carveout", "overlap", name="uq_gemm_key",
        ),
        # A lookup reads every tuned M (of one or every device) of a key: the
        # unique key's index leads with arch and device, which barely narrow
        # it, and stops at M. This one puts M and device last.
        Index(
            "ix_tuner_keys_family", "n", "k", "arch", "dtype_in", "dtype_out", "layout", "groups",
            "group_k", "carveout", "overlap", "device", "m",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    m: Mapped[int] = mapped_column(Integer, index=True)
    name: Mapped[str] = mapped_column(String(128), default="")

    winner: Mapped["Winner | None"] = relationship(back_populates="key")


class Trial(Base):
    """One measured candidate: a pool config, or cuBLAS when `config` is None."""

    __tablename__ = "tuner_trials"

    id: Mapped[int] = mapped_column(primary_key=True)
    key_id: Mapped[int] = mapped_column(ForeignKey("tuner_keys.id", ondelete="CASCADE"), index=True)
    env_id: Mapped[int] = mapped_column(ForeignKey("tuner_environments.id"))
    config_name: Mapped[str] = mapped_column(String(160))
    scheduler: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    ok: Mapped[bool] = mapped_column(Boolean)
    ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    rel_err: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    detail: Mapped[dict] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)


class Winner(Base):
    __tablename__ = "tuner_winners"

    id: Mapped[int] = mapped_column(primary_key=True)
    key_id: Mapped[int] = mapped_column(
        ForeignKey("tuner_keys.id", ondelete="CASCADE"), unique=True
    )
    env_id: Mapped[int] = mapped_column(ForeignKey("tuner_environments.id"))
    config_name: Mapped[str] = mapped_column(String(160))
    scheduler: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    ms: Mapped[float] = mapped_column(Float)
    baseline_ms: Mapped[float] = mapped_column(Float)
    speedup: Mapped[float] = mapped_column(Float)
    best_by_scheduler: Mapped[dict] = mapped_column(JSON, default=dict)
    trials: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now, onupdate=_now)

    key: Mapped[GemmKey] = relationship(back_populates="winner")
    env: Mapped[Environment] = relationship()


class MRange(_Family, Base):
    """One interval of a family's M map (a family is a key without M): every
    M in [m_lo, m_hi] runs `config` (None: cuBLAS). `evidence` holds the
    interleaved measurements behind the choice, one entry per measured M
    ({"m": M, "ms": {candidate name: ms}}, cuBLAS under "cublas"); `source`
    says who measured them ("ladder": `tuner tune`, "online": a live call)."""

    __tablename__ = "tuner_m_ranges"
    __table_args__ = (
        Index(
            "ix_tuner_m_ranges_family", "n", "k", "arch", "dtype_in", "dtype_out", "layout", "groups",
            "group_k", "carveout", "overlap", "device", "m_lo",
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    env_id: Mapped[int] = mapped_column(ForeignKey("tuner_environments.id"))
    m_lo: Mapped[int] = mapped_column(Integer)
    m_hi: Mapped[int] = mapped_column(Integer)
    config_name: Mapped[str] = mapped_column(String(160))
    scheduler: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    evidence: Mapped[list] = mapped_column(JSON, default=list)
    source: Mapped[str] = mapped_column(String(16))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now, onupdate=_now)

    env: Mapped[Environment] = relationship()


class Lease(Base):
    """Who tunes a unit of work (a family under one environment) until when:
    processes sharing a database take a unit only when it is free or its
    holder's lease expired (the holder died), so nothing is measured twice."""

    __tablename__ = "tuner_leases"

    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LeaseEvent(Base):
    """The history of the leases: who took a unit (`take`, or `takeover` from
    `previous`, an owner whose lease expired or who died), gave it back
    (`release`) or found it taken over while working (`lost`). Written in the
    transaction that changes the lease, so it is what happened, in order."""

    __tablename__ = "tuner_lease_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(512), index=True)
    owner: Mapped[str] = mapped_column(String(128))
    event: Mapped[str] = mapped_column(String(16))
    previous: Mapped[str | None] = mapped_column(String(128), nullable=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=_now)
