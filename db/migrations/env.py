"""Alembic environment: migrates the database given in the config's URL.

Our version table has its own name: Optuna keeps its study tables, with its
own Alembic history, in the same database under `alembic_version`.
"""

from alembic import context

from db.engine import make_engine
from db.migrate import VERSION_TABLE, foreign_keys_off
from db.models import Base

config = context.config
connection = config.attributes.get("connection")


def _run(conn) -> None:
    context.configure(
        connection=conn,
        target_metadata=Base.metadata,
        version_table=VERSION_TABLE,
        render_as_batch=conn.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as conn, foreign_keys_off(conn):
        _run(conn)
    engine.dispose()
