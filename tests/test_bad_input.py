"""Every bad input a user can hand the CLI: a one-line error naming the file
and line or the record and field, exit code 2, nothing stored."""

import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def tuner(*args, db=None):
    cmd = [sys.executable, "-m", "tuner.cli", *args, *(["--db", str(db)] if db else [])]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in lines[0], lines
    return lines[0]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "s.txt").write_text("16 1024 1024 name=a\n")
    db = d / "t.db"
    assert tuner("tune", "--shapes", str(d / "s.txt"), "--trials", "3", "--no-ladder", db=db).returncode == 0
    return db


@pytest.mark.parametrize("content, words", [
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe\xfd", "not utf-8"),
    (b"16 1024 1024\n1099511627776 1024 1024\n", "over the largest size"),
    (b"16 1024 1099511627776\n", "over the largest size"),
    (b"16 1024 1024 held=132\n", "has 132 sms"),
    (b"16 1024 1024 held=5000\n", "held sms must be"),
    (b"16 1024 1024\n16 1024 1024 overlap=allreduce:32768\n", "the model does not price an all-reduce"),
    (b"16 1024 1024 overlap=allreduce:2199023255552\n", "bytes must be 1 to"),
    (b"1024 1024 1024 groups=99999999\n", "groups=99999999"),
    (b"16 1024 1024 groups=2 groups=3\n", "given twice"),
    (b"16 1024 1024 name=" + b"x" * 129 + b"\n", "at most 128"),
])
def test_bad_shape_file_is_one_line_naming_file_and_line(tuned, tmp_path, content, words):
    before = digest(tuned)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    line = one_line_error(tuner("tune", "--shapes", str(bad), db=tuned))
    assert str(bad) in line and words in line.lower()
    assert digest(tuned) == before


@pytest.mark.parametrize("args, words", [
    ((), "give the gpus its all-reduce spans with --tp 2 or more"),
    (("--tp", "2", "--devices", "0,1"), "--devices shares families between workers"),
])
def test_an_overlap_key_on_the_gpu_needs_its_all_reduce_s_gpus_and_one_worker(tuned, tmp_path, args, words):
    before = digest(tuned)
    shapes = tmp_path / "o.txt"
    shapes.write_text("16 1024 1024\n16 1024 1024 overlap=allreduce:32768\n")
    line = one_line_error(tuner("tune", "--shapes", str(shapes), "--backend", "gpu", *args, db=tuned))
    assert f"{shapes}:2: overlap=allreduce:32768" in line and words in line.lower()
    assert digest(tuned) == before


def test_a_byte_order_mark_is_not_part_of_m(tmp_path):
    shapes = tmp_path / "bom.txt"
    shapes.write_bytes("\ufeff16 1024 1024 name=bom\n".encode("utf-8"))
    assert tuner("tune", "--shapes", str(shapes), "--trials", "2", "--no-ladder", db=tmp_path / "t.db").returncode == 0


def test_a_file_that_is_not_a_database(tmp_path):
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    shapes = tmp_path / "s.txt"
    shapes.write_text("16 1024 1024\n")
    for args in (("tune", "--shapes", str(shapes)), ("show",), ("show", "--family"), ("export",),
                 ("serve", "--port", "0")):
        assert "not a database" in one_line_error(tuner(*args, db=junk))
    export = tmp_path / "e.json"
    export.write_text("[]")
    assert "not a database" in one_line_error(tuner("import", str(export), db=junk))


def test_readers_never_write_and_a_misspelt_path_creates_nothing(tuned, tmp_path):
    before = digest(tuned)
    for args in (("show",), ("show", "--family", "--json"), ("export",)):
        assert tuner(*args, db=tuned).returncode == 0
    assert digest(tuned) == before
    missing = tmp_path / "tunr.db"
    assert "no database at" in one_line_error(tuner("show", db=missing))
    assert not missing.exists()
    assert "cannot write" in one_line_error(tuner("export", "-o", str(tmp_path / "no" / "x.json"), db=tuned))


def _as_another_user() -> list[str]:
    """A command prefix under which file modes bind (root ignores them)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file modes do not bind")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_a_read_only_database_in_a_read_only_directory_is_read_but_not_written(tuned):
    prefix = _as_another_user()
    d = Path(tempfile.mkdtemp())
    db, shapes, export = d / "ro.db", d / "s.txt", d / "e.json"
    db.write_bytes(tuned.read_bytes())
    shapes.write_text("32 1024 1024\n")
    export.write_text(json.dumps(_export(tuned)))
    db.chmod(0o444)
    d.chmod(0o555)
    try:
        def run(*args):
            cmd = [*prefix, sys.executable, "-m", "tuner.cli", *args, "--db", str(db)]
            return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)

        for args in (("show",), ("show", "--family"), ("export",)):
            proc = run(*args)
            assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
        for args in (("tune", "--shapes", str(shapes)), ("import", str(export))):
            assert str(db) in one_line_error(run(*args))
        port = _free_port()
        server = subprocess.Popen([*prefix, sys.executable, "-m", "tuner.cli", "serve", "--port", str(port),
                                   "--db", str(db)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            assert _get(port, "/v1/best?m=16&n=1024&k=1024").status_code == 200
        finally:
            server.terminate()
            server.wait(timeout=30)
    finally:
        d.chmod(0o755)
        shutil.rmtree(d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str):
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _export(db: Path) -> dict:
    proc = tuner("export", db=db)
    assert proc.returncode == 0
    return json.loads(proc.stdout)


def test_an_overlap_keys_winner_imports_and_shows_as_its_own(tuned, tmp_path):
    exported = _export(tuned)
    record = json.loads(json.dumps(exported["records"][0]))
    record["key"]["overlap"] = 1 << 20
    path = tmp_path / "o.json"
    path.write_text(json.dumps({**exported, "records": [exported["records"][0], record]}))
    db = tmp_path / "o.db"
    assert "imported 2 of 2" in tuner("import", str(path), db=db).stdout
    keys = {json.dumps(r["key"], sort_keys=True) for r in _export(db)["records"]}
    assert len(keys) == 2 and {json.loads(k).get("overlap", 0) for k in keys} == {0, 1 << 20}
    # `show` tells the two families apart.
    assert tuner("show", db=db).stdout.count("overlap=allreduce:1048576") == 1


def test_export_is_versioned_and_imports_into_a_fresh_database(tuned, tmp_path):
    exported = _export(tuned)
    assert exported["format"] == "gemm-tuner-winners" and exported["version"] == 1 and exported["records"]
    for form in (exported, exported["records"]):  # the envelope, and the bare list of older exports
        path = tmp_path / "e.json"
        path.write_text(json.dumps(form))
        proc = tuner("import", str(path), db=tmp_path / f"fresh{isinstance(form, list)}.db")
        assert proc.returncode == 0 and "imported 1 of 1" in proc.stdout
    path.write_text(json.dumps({**exported, "version": 99}))
    assert "version 99" in one_line_error(tuner("import", str(path), db=tmp_path / "x.db"))


@pytest.mark.parametrize("change, field", [
    (lambda r: r.update(ms=0), "ms"),
    (lambda r: r.update(ms=math.nan), "ms"),
    (lambda r: r.update(ms=-1.0), "ms"),
    (lambda r: r["key"].update(m=-5), "key.m"),
    (lambda r: r["key"].update(arch="sm70"), "key.arch"),
    (lambda r: r["key"].update(dtype_in="int4"), "key.dtype_in"),
    (lambda r: r["key"].update(overlap=-1), "key.overlap"),
    (lambda r: r["key"].update(overlap=4096, carveout=8), "key"),
    (lambda r: r.update(config={**(r["config"] or {"arch": "sm90"}), "tile_m": 99999}), "config"),
    (lambda r: r.pop("key"), "key"),
])
def test_a_bad_record_in_the_middle_stores_nothing(tuned, tmp_path, change, field):
    exported = _export(tuned)
    good = exported["records"][0]
    bad = json.loads(json.dumps(good))
    change(bad)
    other = json.loads(json.dumps(good))
    other["key"]["m"] = 99
    records = [other, bad, json.loads(json.dumps(good))]
    path = tmp_path / "e.json"
    path.write_text(json.dumps({**exported, "records": records}))
    db = tmp_path / "fresh.db"
    line = one_line_error(tuner("import", str(path), db=db))
    assert f"record 1: {field}" in line
    assert not db.exists() or "no winners" in tuner("show", db=db).stdout
