import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def pg_server():
    """A throw-away PostgreSQL server (tests/postgres.py), shared by the session."""
    from tests.postgres import start_or_skip

    server = start_or_skip()
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server) -> str:
    """The URL of a fresh, empty database on `pg_server`."""
    return pg_server.new_database()
