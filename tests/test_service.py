"""The HTTP service, end to end: a real `tuner serve` process over a SQLite
database filled by a real `tuner tune` run (model backend)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from db.store import Store
from tuner.backends.model import PER_TRIAL_ENV
from tuner.runtime.lookup import decide

TOKEN = "test-token"
MODEL_DEVICE = "H100-model"
# Gemma 3 4B attention output projection (N = hidden 2560, K = 8 heads x 256)
# at two token counts, and its QKV projection at one.
SHAPES = "128,2048 2560 2048 name=gemma3-4b.o\n16 4096 2560 name=gemma3-4b.qkv\n"
# Keys a concurrent tune adds while readers read: Gemma 3 4B MLP down projection.
MORE_SHAPES = "1,16,64,128,256,512,1024,2048 2560 10240 name=gemma3-4b.down\n"
ROOT = Path(__file__).resolve().parents[1]


def _tune(shapes: Path, db: Path, trials: int = 6, ladder: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--backend", "model", "--trials", str(trials),
           "--shapes", str(shapes), "--db", str(db), "--ladder" if ladder else "--no-ladder"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, db: Path, token: str | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "TUNER_TOKEN"}
        if token:
            env["TUNER_TOKEN"] = token
        cmd = [sys.executable, "-m", "tuner.cli", "serve", "--port", str(self.port), "--db", str(db)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise AssertionError("server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    d = tmp_path_factory.mktemp("svc")
    (d / "shapes.txt").write_text(SHAPES)
    proc = _tune(d / "shapes.txt", d / "t.db")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return d / "t.db"


@pytest.fixture(scope="module")
def server(tuned_db):
    s = _Server(tuned_db, TOKEN)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _best(client, **params):
    return client.get("/v1/best", params={"n": 2560, "k": 2048, **params})


def test_tuned_key_answers_with_the_rules_choice_from_the_store(client, tuned_db):
    r = _best(client, m=2048)
    assert r.status_code == 200, r.text
    body = r.json()
    store = Store(str(tuned_db), writer=False)
    family = dict(arch="sm90", device=MODEL_DEVICE, n=2560, k=2048)
    # The rule `gemm` and `explain` share, over what the tuning stored: the map
    # interval holding M (a kernel only where it beat cuBLAS by the margin).
    want = decide(2048, store.ranges(**family), store.winners(**family))
    store.close()
    assert body["key"]["device"] == MODEL_DEVICE
    assert (body["exact"], body["tuned_m"], body["stale"], body["how"]) == (True, 2048, False, want.how)
    assert (body["config_name"], body["config"]) == (want.config_name, want.config)
    assert body["ms"] == pytest.approx(want.ms)
    assert body["speedup"] == pytest.approx(want.speedup)
    assert body["versions"] == body["current_versions"] == want.versions
    assert client.get("/healthz").json() == {"status": "ok"}


def test_without_a_ladder_the_map_spans_the_listed_m_only(client):
    # Tuned at 128 and 2048 with --no-ladder: the map still measures between
    # them (1600 is served from the probes nearest it), and nothing below 128.
    mid = _best(client, m=1600, device=MODEL_DEVICE).json()
    assert (mid["exact"], mid["key"]["m"], mid["how"]) == (False, 1600, "range")
    assert mid["interval"][0] <= 1600 <= mid["interval"][1] and 1290 <= mid["tuned_m"] <= 2048
    below = _best(client, m=100)
    assert below.status_code == 404 and "no measured choice covers M=100" in below.json()["detail"]


def test_best_serves_the_family_map_by_the_rule_gemm_uses(tmp_path, monkeypatch):
    from tuner.runtime import dispatch
    from tuner.key import Key, Problem

    (tmp_path / "s.txt").write_text("64,700 1536 1152 name=gemma3-1b.qkv\n")
    db = tmp_path / "ladder.db"
    out, _ = _tune(tmp_path / "s.txt", db, trials=4, ladder=True).communicate(timeout=300)
    ranges = Store(str(db), writer=False).ranges(n=1536, k=1152)
    assert ranges[0].m_lo == 1 and ranges[-1].m_hi == 700
    server = _Server(db, None)
    monkeypatch.setattr(dispatch, "_versions", lambda device: ranges[0].versions)
    dispatch.configure(str(db))
    try:
        for m in (1, 3, 64, 65, 100, 333, 699, 700, 701):
            r = httpx.get(server.url + "/v1/best", params={"m": m, "n": 1536, "k": 1152})
            why = dispatch.explain_key(Key("sm90", MODEL_DEVICE, Problem(m, 1536, 1152)))
            if m > 700:
                assert r.status_code == 404 and why.path == "torch" and "no measured choice" in why.reason
                continue
            body = r.json()
            assert body["how"] == "range" and body["config_name"] == why.config_name
            assert tuple(body["interval"]) == why.interval and body["interval"][0] <= m <= body["interval"][1]
            assert body["reason"] in why.reason and body["evidence"]
    finally:
        dispatch.configure(None)
        server.stop()


def test_an_overlap_key_is_served_from_its_own_map(tmp_path, monkeypatch):
    from kernels.space import GemmConfig
    from tuner.key import Key, Problem
    from tuner.runtime import dispatch
    from tuner.runtime.lookup import family_of

    db = tmp_path / "overlap.db"
    store = Store(str(db))
    versions = {"torch": "x"}
    env = store.environment("gpu", "sm90", "dev", versions)
    names = {0: "sm90-single_tile-t64x16-c1x1-s8-w1m-ab", 1 << 20: "sm90-static_persistent-t128x128-c1x1-s4-w4m-sm116"}
    for nbytes, name in names.items():
        cfg = GemmConfig.from_name(name).to_dict()
        family = family_of(Key("sm90", "dev", Problem(16, 5376, 2688, overlap=nbytes)))
        store.set_ranges(family, env, [dict(m_lo=1, m_hi=64, config=cfg, config_name=name, scheduler=cfg["scheduler"],
                                            evidence=[{"m": 16, "ms": {"cublas": 0.02, name: 0.018}}])])
    store.close()
    server = _Server(db, None)
    monkeypatch.setattr(dispatch, "_versions", lambda device: versions)
    dispatch.configure(str(db))
    try:
        for nbytes, name in names.items():
            r = httpx.get(server.url + "/v1/best", params={"m": 16, "n": 5376, "k": 2688, "overlap": nbytes})
            assert r.status_code == 200 and r.json()["config_name"] == name
            assert dispatch.explain_key(Key("sm90", "dev", Problem(16, 5376, 2688, overlap=nbytes))).config_name == name
        r = httpx.get(server.url + "/v1/best", params={"m": 16, "n": 5376, "k": 2688, "overlap": 4096})
        assert r.status_code == 404 and "overlap=4096" in r.json()["detail"]
    finally:
        dispatch.configure(None)
        server.stop()


def test_staleness_against_the_callers_versions(client):
    fresh = _best(client, m=128).json()
    assert not fresh["stale"]
    other = json.dumps({**fresh["versions"], "model": "0-other"})
    assert _best(client, m=128, current_versions=other).json()["stale"]


def test_unknown_key_is_404_with_a_message(client):
    r = _best(client, m=128, n=2568)
    assert r.status_code == 404
    assert "no measured choice" in r.json()["detail"] and "N=2568" in r.json()["detail"]
    assert _best(client, m=128, device="H200-nowhere").status_code == 404


@pytest.mark.parametrize("path, params, field", [
    ("/v1/best", {"m": -1}, "m"),
    ("/v1/best", {"m": 0}, "m"),
    ("/v1/best", {"m": 2**31 + 1}, "m"),
    ("/v1/best", {"m": "many"}, "m"),
    ("/v1/best", {"m": 128, "n": None}, "n"),
    ("/v1/best", {"m": 128, "dtype": "int8"}, "dtype"),
    ("/v1/best", {"m": 128, "dtype_out": "fp64"}, "dtype_out"),
    ("/v1/best", {"m": 128, "arch": "sm70"}, "arch"),
    ("/v1/best", {"m": 128, "layout": "tt"}, "layout"),
    ("/v1/best", {"m": 128, "groups": 0}, "groups"),
    ("/v1/best", {"m": 128, "overlap": -1}, "overlap"),
    ("/v1/best", {"m": 128, "overlap": 2**41}, "overlap"),
    ("/v1/best", {"m": 128, "current_versions": "torch 2.13"}, "current_versions"),
    ("/v1/results", {"limit": 100_000}, "limit"),
    ("/v1/results", {"limit": 0}, "limit"),
    ("/v1/results", {"offset": -5}, "offset"),
    ("/v1/results", {"k": 2**40}, "k"),
])
def test_bad_input_is_422_naming_the_field(client, path, params, field):
    query = {"n": 2560, "k": 2048, **params} if path == "/v1/best" else params
    r = client.get(path, params={k: v for k, v in query.items() if v is not None})
    assert r.status_code == 422, r.text
    assert field in [e["loc"][-1] for e in r.json()["detail"]]


def test_results_filter_and_page(client):
    o_proj = {"device": MODEL_DEVICE, "n": 2560, "k": 2048}
    both = client.get("/v1/results", params=o_proj).json()
    assert both["total"] == 2 and [w["key"]["m"] for w in both["items"]] == [128, 2048]
    page = client.get("/v1/results", params={**o_proj, "limit": 1, "offset": 1}).json()
    assert page["total"] == 2 and page["items"] == both["items"][1:]
    qkv = client.get("/v1/results", params={"n": 4096, "backend": "model"}).json()
    assert qkv["total"] == 1 and qkv["items"][0]["key"]["m"] == 16
    assert client.get("/v1/results", params={"n": 4096, "backend": "gpu"}).json()["total"] == 0


def test_writes_need_the_token(client):
    record = client.get("/v1/results", params={"limit": 1}).json()["items"][0]
    assert client.post("/v1/results", json=[record]).status_code == 401
    wrong = client.post("/v1/results", json=[record], headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"] == "Bearer"


def test_authorized_import_is_served(client):
    record = _best(client, m=2048).json()
    answer_only = ("current_versions", "stale", "exact", "tuned_m", "how", "interval", "evidence", "reason")
    imported = {k: v for k, v in record.items() if k not in answer_only}
    imported["key"] = {**record["key"], "device": "NVIDIA H100 80GB HBM3", "m": 4096}
    imported["backend"] = "gpu"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = client.post("/v1/results", json=[imported], headers=auth)
    assert r.status_code == 200, r.text
    assert r.json() == {"received": 1, "imported": 1}
    served = _best(client, m=4096).json()
    assert served["key"]["device"] == "NVIDIA H100 80GB HBM3" and served["exact"]
    # The measured device now wins at its own M; the modeled one still serves 2048.
    assert _best(client, m=2048).json()["key"]["device"] == MODEL_DEVICE
    bad = {**imported, "ms": -1.0, "config": {"tile_m": 7}}
    r = client.post("/v1/results", json=[bad], headers=auth)
    assert r.status_code == 422
    assert {e["loc"][-1] for e in r.json()["detail"]} >= {"ms", "config"}


def test_imports_refused_without_a_configured_token(tuned_db, tmp_path):
    db = tmp_path / "copy.db"
    shutil.copy(tuned_db, db)
    s = _Server(db, token=None)
    try:
        r = httpx.post(s.url + "/v1/results", json=[], headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403 and "TUNER_TOKEN" in r.json()["detail"]
    finally:
        s.stop()


def test_readers_get_answers_while_a_tune_writes(client, tuned_db, tmp_path, monkeypatch):
    # The model searched one stored trial at a time, as the GPU backend is: a
    # commit every trial, for seconds (a bulk model search of these keys
    # commits a few times in about one).
    monkeypatch.setenv(PER_TRIAL_ENV, "1")
    shapes = tmp_path / "more.txt"
    shapes.write_text(MORE_SHAPES)
    tune = _tune(shapes, tuned_db, trials=8)
    statuses = []
    try:
        while tune.poll() is None:
            statuses.append(_best(client, m=2048).status_code)
            statuses.append(client.get("/v1/results", params={"limit": 50}).status_code)
    finally:
        out, _ = tune.communicate(timeout=300)
    assert tune.returncode == 0, out
    assert len(statuses) > 20 and set(statuses) == {200}
    # Winners stored by another process are served at once (the cache drops on a commit).
    down = client.get("/v1/best", params={"m": 1024, "n": 2560, "k": 10240})
    assert down.status_code == 200 and down.json()["exact"]


def test_no_server_error_under_schema_fuzzing(tuned_db, tmp_path):
    # Its own server: authorized fuzzing imports whatever it generates.
    db = tmp_path / "fuzz.db"
    shutil.copy(tuned_db, db)
    server = _Server(db, TOKEN)
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
        "--checks", "not_a_server_error", "--max-examples", "25", "--max-time", "30", "--seed", "7",
        "--phases", "coverage,fuzzing", "--generation-database", "none", "--no-color",
        "--header", f"Authorization: Bearer {TOKEN}", "--request-timeout", "20",
    ]
    try:
        done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_a_large_body_is_413_and_a_bad_one_is_a_short_422(client):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    huge = b"[" + b"1," * (3 * 1024 * 1024) + b"1]"
    r = client.post("/v1/results", content=huge, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 413 and "request body over" in r.json()["detail"]

    def chunks():
        for _ in range(80):
            yield b" " * 65536

    r = client.post("/v1/results", content=chunks(), headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 413
    bad = [{"key": {"m": -1}, "padding": "x" * 2000}] * 500
    r = client.post("/v1/results", json=bad, headers=auth)
    assert r.status_code == 422 and len(r.content) < 10_000
    assert "x" * 100 not in r.text and all("input" not in e for e in r.json()["detail"])
