"""The `tuner` command line."""

from __future__ import annotations

import fnmatch
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from kernels.space import ARCHS
from tuner.key import Key, overlap_text
from tuner.search.progress import count

# Plain help (click's): rich's boxed option table leaves its help column
# about 20 characters wide at 80 columns.
app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, rich_markup_mode=None)
console = Console()
# Progress and `tune`'s lines go to stderr, so stdout stays the tables (or
# JSON) alone.
err_console = Console(stderr=True)

BACKENDS = ("model", "gpu")
# Trials per key when --trials is not given. A GPU trial costs a compile and
# a timing, so a GPU study leans on the model's picks (compiled in parallel
# up front) and samples a few more.
DEFAULT_TRIALS = {"model": 24, "gpu": 14}

DbOption = typer.Option(None, "--db", help="Database URL or SQLite path (default: $TUNER_DB, else the user data dir).")


def _fail(message: str, code: int = 2) -> None:
    # One line however long: a script reads it, and a terminal wraps it anyway.
    console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _open(db: str | None, *, writer: bool = True, current: bool = True):
    """The store at `db`, or a one-line error (a missing, unreadable or
    non-database file; a read-only one when writing; for a reader, one of an
    older schema unless not `current`)."""
    from db.store import Store, StoreError

    try:
        return Store(db, writer=writer, current=current)
    except StoreError as exc:
        _fail(str(exc))


def _backend(name: str, arch: str, tp: int = 1):
    if name not in BACKENDS:
        _fail(f"unknown backend {name!r}; expected one of {BACKENDS}")
    if arch not in ARCHS:
        _fail(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if name == "model":
        from tuner.backends.model import ModelBackend

        return ModelBackend(arch)
    from tuner.backends.gpu import GpuBackend, GpuUnavailable

    try:
        return GpuBackend(arch, overlap_devices=tuple(range(1, tp)))
    except GpuUnavailable as exc:
        _fail(f"the gpu backend is not available here: {exc}")


@app.command()
def tune(
    shapes: Optional[Path] = typer.Option(None, "--shapes", help="Shape file: one GEMM key per line."),
    model: Optional[str] = typer.Option(
        None, "--model", help="Tune every linear layer of a model instead: a config.json, a shipped "
        "config's name or package.module:attr (see `shapes --from-model`)."),
    model_m: str = typer.Option("1,16,128,512,2048,8192", "--m", help="With --model: token counts M."),
    fuse: bool = typer.Option(
        False, "--fuse", help="With --model: also the products patch(model, fuse=True) computes (q, k "
        "and v; gate and up: one product over their weights together)."),
    backend: str = typer.Option("model", help="Measurement backend: model or gpu."),
    arch: str = typer.Option("sm90", help="Target architecture: sm90 or sm100."),
    trials: Optional[int] = typer.Option(
        None, min=1, help="Measured trials per listed key (12/7 as many where cuBLAS takes 0.5 ms or more).",
    ),
    seconds: Optional[float] = typer.Option(None, min=1, help="Time budget per key, in seconds."),
    budget_s: Optional[float] = typer.Option(
        None, "--budget-s", min=1,
        help="Time budget of the whole tune, in seconds: families share it, the smallest first; "
             "those it does not reach stay on cuBLAS."),
    ladder: bool = typer.Option(
        True, help="Also tune every power of two of M up to each family's largest, then measure "
        "where each winner holds (the M map gemm serves from)."),
    force: bool = typer.Option(False, help="Retune keys that already have a current winner."),
    revalidate: bool = typer.Option(
        False, help="Measure the M maps again (current winners are kept, not retuned)."),
    only: Optional[str] = typer.Option(
        None, help="Only keys whose name matches this glob (e.g. 'gemma3-27b.*')."),
    as_json: bool = typer.Option(
        False, "--json", help="Also print the run as JSON on stdout: each family's state, the M tuned "
        "anew, its map's spans, best speedup and seconds; the totals; the run's M maps (as `show "
        "--family --json`); with --devices, each worker's summary."),
    devices: Optional[str] = typer.Option(
        None, help="GPUs of this host to tune on, e.g. 0,1: one worker process each, sharing the "
        "families with each other and with any other tuner on the same database."),
    lease_ttl: Optional[float] = typer.Option(
        None, "--lease-ttl", envvar="TUNER_LEASE_TTL_S", min=0.5,
        help="Seconds a family's lease outlives its holder's last heartbeat (default 600): a worker "
        "that died on another host is taken over after this."),
    tp: int = typer.Option(
        1, "--tp", min=1, help="GPUs an overlap key's all-reduce spans (overlap=allreduce:BYTES): "
        "GPU 0 times the GEMM, GPUs 1 to TP-1 run their share of the all-reduce."),
    worker_events: bool = typer.Option(False, "--worker-events", hidden=True),
    db: Optional[str] = DbOption,
) -> None:
    """Search the kernel pool for each family and store its M map.

    Every family of a shape file (--shapes), or of a model's linear layers
    (--model). On stderr: in a terminal, a live line per family being tuned
    (M, trials, best speedup so far); a line per family tuned; a totals
    line. `tuner show --family` prints the stored M maps."""
    # A time budget counts from here: starting the GPU worker is part of the tune.
    started = time.monotonic()
    from tuner.backends.model import model_source
    from tuner.search.ladder import owner_id, tune_families
    from tuner.runtime.lookup import family_of
    from tuner.search.study import Budget
    from tuner.shapes import ShapeFileError, parse_shapes, parse_text, resolve

    if (shapes is None) == (model is None):
        _fail("give one of --shapes FILE and --model CONFIG")
    # The whole file is checked before the database is opened: a bad line
    # stores nothing.
    try:
        entries = parse_shapes(shapes) if model is None else parse_text(_model_shapes(model, model_m, fuse), model)
    except ShapeFileError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{shapes}: {exc.strerror or exc}")
    shapes = shapes or Path(model)
    if only is not None:
        entries = [e for e in entries if fnmatch.fnmatchcase(e.name, only)]
        if not entries:
            _fail(f"no key of {shapes} has a name matching {only!r}")
    for e in entries:
        # Timing beside an all-reduce takes the GPUs it spans, one process each.
        why = ("the model does not price an all-reduce" if backend == "model"
               else "give the GPUs its all-reduce spans with --tp 2 or more" if tp < 2
               else "--devices shares families between workers; tune overlap keys apart" if devices is not None
               else None)
        if e.problem.overlap and why:
            _fail(f"{resolve(shapes)}:{e.line}: overlap={overlap_text(e.problem.overlap)}: {why}")
    if devices is not None:
        if model is not None:
            _fail("--devices tunes a shape file: write the model's with `tuner shapes --from-model` first")
        _tune_on_devices(devices, dict(
            shapes=str(resolve(shapes)), backend=backend, arch=arch, trials=trials, seconds=seconds, budget_s=budget_s,
            ladder=ladder, force=force, revalidate=revalidate, only=only, lease_ttl=lease_ttl, db=db,
        ), as_json, entries)
        return
    bk = _backend(backend, arch, tp)
    for e in entries:
        if e.problem.carveout >= bk.sm_count:
            _fail(f"{resolve(shapes)}:{e.line}: held={e.problem.carveout}: {bk.device_name} has "
                  f"{bk.sm_count} SMs; hold fewer")
    store = _open(db)
    if backend != "model":
        err_console.print(f"model: {model_source(arch, bk.device_name)}", highlight=False, soft_wrap=True)
    budget = Budget(trials=trials or DEFAULT_TRIALS[backend], seconds=seconds,
                    until=started + budget_s if budget_s else None)
    families: dict[tuple, list] = {}
    for entry in entries:
        key = Key(arch, bk.device_name, entry.problem)
        families.setdefault(tuple(map(str, family_of(key).values())), []).append((entry.name, key))
    work = [(members[0][0], [k for _, k in members]) for members in families.values()]
    options = dict(ladder=ladder, force=force, revalidate=revalidate, lease_ttl_s=lease_ttl)
    if worker_events:
        # A worker of `--devices`: its parent shows the progress.
        from tuner.search.progress import Tracker
        from tuner.search.workers import Events, EventSink

        events = Events()
        events.emit("start", owner=owner_id(), device_name=bk.device_name, arch=arch)
        tracker = Tracker(EventSink(events))
        tune_families(work, bk, store, budget, **options, on_rung=tracker.on_rung, on_family=tracker.on_family)
        store.close()
        return
    from tuner.search.progress import Report, ReportSink, Tracker

    with Report(err_console) as report:
        tracker = Tracker(ReportSink(report))
        tune_families(work, bk, store, budget, **options, on_rung=tracker.on_rung, on_family=tracker.on_family)
    report.totals(len(entries))
    if as_json:
        maps = _run_maps(store, arch, bk.device_name, entries)
        spent = {f"{stage}_s": round(s, 2) for stage, s in getattr(bk, "seconds", {}).items()}
        print(json.dumps({"device": bk.device_name, "arch": arch, "model": model_source(arch, bk.device_name),
                          **report.to_json(len(entries)), **spent, "timed": getattr(bk, "timed", None),
                          "maps": [fm.to_json() for fm in maps]}, indent=1))
    store.close()


def _run_maps(store, arch: str, device: str, entries) -> list[FamilyMap]:
    """The stored M maps of the families of a shape file's `entries`."""
    from tuner.runtime.lookup import family_id, family_of

    run = {family_id(family_of(Key(arch, device, e.problem))) for e in entries}
    return [fm for fm in _family_maps(store, arch=arch, device=device) if family_id(fm.family) in run]


def _tune_on_devices(devices: str, options: dict, as_json: bool, entries) -> None:
    """`tune --devices`: one worker process per GPU (`tuner.search.workers`),
    shown as one `Report`."""
    from db.engine import resolve_url
    from tuner.search import workers
    from tuner.search.progress import Report

    try:
        visible = workers.parse_devices(devices)
    except ValueError as exc:
        _fail(str(exc))
    # Every worker opens the same database: one URL, migrated once up front
    # (a database that cannot be opened is one error here, not one per worker).
    options["db"] = resolve_url(options["db"])
    _open(options["db"]).close()
    args = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            args += [flag, str(value)]
    with Report(err_console) as report:
        ran = workers.run(visible, args, report)
    report.totals(len(entries))
    failed = [w for w in ran if w.rc != 0]
    if as_json:
        named = [w for w in ran if w.device_name]
        maps = []
        if named:
            store = _open(options["db"], writer=False)
            maps = _run_maps(store, named[0].arch, named[0].device_name, entries)
            store.close()
        print(json.dumps({"workers": [w.summary() for w in ran], **report.to_json(len(entries)),
                          "maps": [fm.to_json() for fm in maps]}, indent=1))
    if failed:
        _fail("worker(s) failed: " + ", ".join(f"gpu{w.device} (exit code {w.rc})" for w in failed), code=1)


@app.command()
def show(
    arch: Optional[str] = typer.Option(None, help="Only this architecture."),
    device: Optional[str] = typer.Option(None, help="Only this device name."),
    backend: Optional[str] = typer.Option(None, help="Only results of this backend (model or gpu)."),
    m: Optional[int] = typer.Option(None, help="Only this M."),
    n: Optional[int] = typer.Option(None, help="Only this N."),
    k: Optional[int] = typer.Option(None, help="Only this K."),
    groups: Optional[int] = typer.Option(None, help="Only this group count."),
    family: bool = typer.Option(False, "--family", help="Show each family's M map instead of the winners."),
    limit: int = typer.Option(
        200, min=1, max=100_000, help="Winners at most (the table says how many match when it cuts)."),
    as_json: bool = typer.Option(
        False, "--json", help='Print JSON instead of a table: {"total": winners matching, "shown": '
        'winners printed, "limit": --limit, "items": [winner, ...]}; with --family, a list of maps.'),
    db: Optional[str] = DbOption,
) -> None:
    """Show stored winners, or each family's M map (--family).

    A winner's time against cuBLAS's; --json adds each scheduler's best."""
    store = _open(db, writer=False)
    if family:
        maps = _family_maps(store, arch=arch, device=device, n=n, k=k, groups=groups)
        store.close()
        _print_maps(maps, as_json, count(len(maps), "family", "families"))
        return
    filters = dict(arch=arch, device=device, backend=backend, m=m, n=n, k=k, groups=groups)
    rows = store.winners(limit=limit, **filters)
    total = len(rows) if len(rows) < limit else store.count_winners(**filters)
    store.close()
    if as_json:
        print(json.dumps({"total": total, "shown": len(rows), "limit": limit,
                          "items": [w.to_record() for w in rows]}, indent=1))
    elif not rows:
        console.print("no winners match")
    elif total > len(rows):
        cut = f"showing {len(rows)} of {total} winners (--limit {limit}; --limit {total} shows all)"
        _print_winners(rows, cut)
        console.print(f"\n{cut}", highlight=False)
    else:
        _print_winners(rows, count(total, "winner"))


@app.command()
def remap(
    as_json: bool = typer.Option(False, "--json", help="Print each changed map's ranges, before and after."),
    db: Optional[str] = DbOption,
) -> None:
    """Build every M map again from its stored measurements.

    Under this release's map rule, with nothing measured (no GPU needed):
    `tune` keeps a current map as it is, so a map an earlier release built
    follows that release's rule until it is rebuilt here or measured again
    (`tune --revalidate`)."""
    from tuner.search.ladder import remap as remap_maps
    from tuner.runtime.lookup import family_id

    # It rebuilds maps that exist: a mistyped path is an error, not a new
    # empty database (the reader's open refuses one).
    _open(db, writer=False, current=False).close()
    store = _open(db)
    changed = remap_maps(store)
    names = {family_id(fm.family): fm.name for fm in _family_maps(store)}
    store.close()
    rows = []
    for family, old, new in changed:
        moved = sum(_choice_at(old, m) != _choice_at(new, m) for m in range(old[0][0], old[-1][1] + 1))
        rows.append((names.get(family_id(family), "-"), family, old, new, moved))
    if as_json:
        print(json.dumps([{"name": name, "family": family, "m_changed": moved,
                           "before": [dict(zip(("m_lo", "m_hi", "choice"), r)) for r in old],
                           "after": [dict(zip(("m_lo", "m_hi", "choice"), r)) for r in new]}
                          for name, family, old, new, moved in rows], indent=1))
        return
    if not rows:
        console.print("every M map already follows this release's rule")
        return
    table = _table(f"{len(rows)} M maps rebuilt", ["family", "ranges", "M changed"], ("family",))
    for name, _, old, new, moved in rows:
        table.add_row(name, f"{len(old)} -> {len(new)}", str(moved))
    console.print(table)


@app.command()
def migrate(db: Optional[str] = DbOption) -> None:
    """Upgrade a database to this release's schema, keeping every row.

    Commands that write upgrade a database an earlier release wrote on their
    own; readers (`show`, `serve`, `export` ...) refuse it and name this."""
    from db.migrate import revisions

    _open(db, writer=False, current=False).close()
    store = _open(db)
    with store.engine.connect() as conn:
        found, _ = revisions(conn)
    store.close()
    console.print(f"database at schema revision {found}")


def _choice_at(spans: list[tuple[int, int, str]], m: int) -> str:
    return next(choice for lo, hi, choice in spans if lo <= m <= hi)


@app.command()
def plot(
    family: str = typer.Option(
        ..., "--family", help="Key name of the family, or a glob of several (e.g. 'gemma3-27b.*': one "
        "PNG each)."),
    output: Path = typer.Option(
        ..., "-o", "--output", help="PNG file to write, or a directory to write NAME.png files into "
        "(created; a path not ending in .png is one). A FILE.png with several families matching "
        "writes FILE-NAME.png for each."),
    device: Optional[str] = typer.Option(None, help="Only this device name."),
    db: Optional[str] = DbOption,
) -> None:
    """Draw families' M maps: time against M, the choice and cuBLAS.

    One PNG a family; prints the path of each."""
    from tuner.observe.plots import plot_family, plot_names

    store = _open(db, writer=False)
    maps = [fm for fm in _family_maps(store, device=device) if fnmatch.fnmatchcase(fm.name, family)]
    store.close()
    if not maps:
        _fail(f"no family with an M map has a name matching {family!r}")
    maps.sort(key=lambda fm: (fm.name, fm.family["device"]))
    if output.suffix.lower() == ".png" and not output.is_dir():
        paths = ([output] if len(maps) == 1 else
                 [output.with_name(f"{output.stem}-{name}.png") for name in plot_names(maps)])
        folder = output.parent
    else:
        paths = [output / f"{name}.png" for name in plot_names(maps)]
        folder = output
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for fm, path in zip(maps, paths, strict=True):
            plot_family(fm, path)
            console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    except OSError as exc:
        _fail(f"cannot write {exc.filename or folder}: {exc.strerror or exc}")


@app.command("export")
def export_(
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="JSON file (default: stdout)."),
    db: Optional[str] = DbOption,
) -> None:
    """Write every stored winner as JSON (a versioned export)."""
    from tuner.records import EXPORT_FORMAT, EXPORT_VERSION

    store = _open(db, writer=False)
    text = json.dumps({"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "records": store.export()}, indent=1)
    store.close()
    if output is None:
        print(text)
        return
    try:
        output.write_text(text + "\n")
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror or exc}")
    console.print(f"wrote {output}")


@app.command("import")
def import_(
    source: Path = typer.Argument(..., help="JSON file written by `tuner export`."),
    db: Optional[str] = DbOption,
) -> None:
    """Store winners from a JSON export.

    A stored winner is replaced only by a faster one. Every record is checked
    first: one bad record stores nothing."""
    from tuner.records import RecordError, validate_records

    try:
        records = validate_records(json.loads(source.read_bytes()))
    except OSError as exc:
        _fail(f"{source}: {exc.strerror or exc}")
    except (ValueError, RecordError) as exc:  # JSON and encoding errors are ValueErrors too
        _fail(f"{source}: {exc}")
    store = _open(db)
    stored = store.import_records(records)
    store.close()
    console.print(f"imported {stored} of {len(records)} winners")


@app.command("shapes")
def shapes_(
    from_config: Optional[Path] = typer.Option(None, "--from-config", help="A Hugging Face style config.json."),
    from_model: Optional[str] = typer.Option(
        None, "--from-model", help="Every linear layer of a model: a config.json (built with transformers, "
        "nothing downloaded), a shipped config's name (gemma-3-27b, llama-3.1-8b, qwen2.5-7b) or "
        "package.module:attr (an nn.Module or a function returning one)."),
    m: str = typer.Option("1,16,128,512,2048,8192", help="Token counts M, comma-separated."),
    ep: int = typer.Option(1, "--ep", min=1, help="With --from-config: GPUs the experts are spread over."),
    fuse: bool = typer.Option(
        False, "--fuse", help="With --from-model: also the products patch(model, fuse=True) computes."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Shape file to write (default: stdout)."),
) -> None:
    """Write a shape file of a model's GEMMs.

    A config's attention, MLP and mixture-of-experts GEMMs as a serving
    engine runs them (--from-config), or every distinct linear layer of a
    model (--from-model)."""
    from tuner.config_shapes import write_shapes_from_config
    from tuner.shapes import ShapeFileError

    if (from_config is None) == (from_model is None):
        _fail("give one of --from-config CONFIG and --from-model MODEL")
    if fuse and from_model is None:
        _fail("--fuse goes with --from-model (a config's shapes are fused already)")
    if from_model is not None:
        text = _model_shapes(from_model, m, fuse)
        if output is not None:
            try:
                output.write_text(text)
            except OSError as exc:
                _fail(f"cannot write {output}: {exc.strerror or exc}")
    else:
        try:
            text = write_shapes_from_config(from_config, _m_values(m), output, ep)
        except (OSError, ValueError, ShapeFileError) as exc:
            _fail(f"{from_config}: {exc}")
    if output is None:
        print(text, end="")
    else:
        console.print(f"wrote {output}")


def _m_values(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        _fail(f"--m must be comma-separated integers, got {text!r}")


def _model_shapes(source: str, m: str, fuse: bool) -> str:
    """The shape file text of a model's linear layers (and with `fuse`, their
    fused siblings'), or a one-line error naming the source."""
    from tuner.runtime.linears import ModelSourceError, shapes_from_model

    m_values = _m_values(m)
    try:
        return shapes_from_model(source, m_values, fuse)
    except ModelSourceError as exc:
        _fail(str(exc))
    except ValueError as exc:
        _fail(f"{source}: {exc}")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on."),
    workers: int = typer.Option(1, min=1, max=64, help="Server processes sharing the port."),
    db: Optional[str] = DbOption,
) -> None:
    """Serve the stored winners over HTTP (OpenAPI at /docs).

    Says on stderr where it listens and which database it serves."""
    import os
    import socket

    import uvicorn
    from sqlalchemy.engine import make_url

    from db.engine import ENV_VAR, resolve_url, writable

    url = resolve_url(db)
    read_only = not writable(url)
    # A database that cannot be opened is a one-line error here, not a
    # traceback from every worker; a read-only one is served as it is.
    _open(url, writer=not read_only).close()
    # Every worker process builds its own app from the factory and finds the
    # database through the environment.
    os.environ[ENV_VAR] = url
    config = uvicorn.Config(
        "service.app:create_app", factory=True, host=host, port=port, workers=workers,
        access_log=False, log_level="warning",
    )
    # Bound and listening here, not in uvicorn: a port in use is a one-line
    # error, and the address printed is the one listened on (--port 0 picks
    # a free port), reachable once printed (connections queue until served).
    v6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(config.backlog)
    except OSError as exc:
        sock.close()
        _fail(f"cannot listen on {host} port {port}: {exc.strerror or exc}")
    sock.set_inheritable(True)
    address = f"http://{f'[{host}]' if v6 else host}:{sock.getsockname()[1]}"
    shown = make_url(url).render_as_string(hide_password=True)
    print(f"serving {address} (API docs at /docs" + (f", {workers} workers" if workers > 1 else "")
          + "; Ctrl-C stops)\n" + f"  database {shown}" + (" (read-only)" if read_only else ""),
          file=sys.stderr, flush=True)
    try:
        if workers > 1:
            from uvicorn.supervisors import Multiprocess

            Multiprocess(config, sockets=[sock]).run()
        else:
            uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()


@app.command()
def report(
    output: Path = typer.Option(..., "-o", "--output", help="Directory to write index.html and its PNGs into."),
    db: Optional[str] = DbOption,
) -> None:
    """Write an HTML report of the stored results.

    Speedups, schedulers, M maps, and the model against measurement."""
    from tuner.observe.report import write_report

    store = _open(db, writer=False)
    try:
        page = write_report(store, _family_maps(store), output)
    except OSError as exc:
        _fail(f"cannot write the report to {output}: {exc.strerror or exc}")
    finally:
        store.close()
    console.print(f"wrote {page}", highlight=False, soft_wrap=True)


@app.command()
def calibrate(
    device: Optional[str] = typer.Option(
        None, help="Device name to fit (default: every measured device in the database)."),
    holdout_every: int = typer.Option(
        3, min=2, help="Hold every Nth family out of the fit, to score it on."),
    output: Optional[Path] = typer.Option(
        None, "-o", "--output", help="Calibration file to update (default: $TUNER_CALIBRATION, else the "
        "one the package ships)."),
    quick: bool = typer.Option(
        False, "--quick", help="Probe this machine's GPU instead (seconds of micro-benchmarks) and store "
        "its entry."),
    arch: str = typer.Option("sm90", help="With --quick: the architecture whose model the entry is for."),
    figures: Optional[Path] = typer.Option(
        None, "--figures", help="With --quick: the figures a `calibrate --quick --json` printed, instead of "
        "a probe (no GPU needed: rebuilds the entry after its reference was fitted again)."),
    also: list[str] = typer.Option(
        [], "--also", help="Another database whose trials join the fit (repeatable): more families, "
        "fewer held out by chance."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit and its scores as JSON."),
    db: Optional[str] = DbOption,
) -> None:
    """Fit the analytic model's constants to measured trials.

    The trials of one device; the fitted constants are stored. With
    --quick, the GPU here instead: its driver's figures and a probe of its
    bandwidth, tensor-core rate and launch cost."""
    from tuner.backends.calibration import calibrate as fit_device, devices, save
    from tuner.backends.model import calibration_path

    if figures is not None and not quick:
        _fail("--figures goes with --quick")
    if quick:
        _calibrate_quick(arch, output or calibration_path(), as_json, figures)
        return

    stores = [_open(db, writer=False)] + [_open(url, writer=False) for url in also]
    found = sorted({d for store in stores for d in devices(store)})
    if device is not None:
        found = [d for d in found if d[1] == device]
    try:
        if not found:
            _fail(f"no measured trials of {device!r} in the databases" if device else
                  "no measured trials in the databases (the model's own are not fitted)")
        path = output or calibration_path()
        results = []
        for arch, name in found:
            with err_console.status(f"fitting {name} ({arch})"):
                results.append(fit_device(stores, arch, name, holdout_every))
            save(path, results[-1])
    except ValueError as exc:
        _fail(str(exc))
    finally:
        for store in stores:
            store.close()
    if as_json:
        print(json.dumps([r.to_json() for r in results], indent=1))
        return
    for cal in results:
        _print_calibration(cal)
    console.print(f"wrote {path}", highlight=False, soft_wrap=True)


def _calibrate_quick(arch: str, path: Path, as_json: bool, recorded: Path | None) -> None:
    """`calibrate --quick`: probe the local GPU (or read figures it
    recorded), store its entry at `path`."""
    from tuner.backends.calibration import quick_entry, save_entry
    from tuner.backends.model import read_calibrations

    if recorded is None:
        bk = _backend("gpu", arch)
        try:
            driver, figures = bk.facts, bk.probe()
        finally:
            bk.close()
    else:
        driver, figures = _recorded_figures(recorded)
    name = driver["name"]
    try:
        entry, how = quick_entry(arch, driver, figures, read_calibrations(path))
        save_entry(path, name, entry)
    except ValueError as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps({"device": name, "path": str(path), "how": how, **entry}, indent=1))
        return
    facts = entry.get("facts", {})
    console.print(f"{name}: {driver.get('sms')} SMs, L2 {(driver.get('l2_bytes') or 0) / 2**20:.0f} MiB, "
                  f"driver peak DRAM {driver.get('hbm_bw') or 0:.3g} B/s", highlight=False)
    console.print(f"probe ({figures['seconds']:.0f} s): copy {figures['copy_gbps']:.0f} GB/s, "
                  f"bf16 {figures['mma_tflops']:.0f} TFLOP/s, launch {figures['launch_us']:.2f} us",
                  highlight=False)
    if facts:
        console.print(f"model: {facts['sms']} SMs at {facts['clock_hz'] / 1e9:.2f} GHz, "
                      f"DRAM {facts['hbm_bw'] / 1e12:.2f} TB/s", highlight=False)
    console.print(how, highlight=False, soft_wrap=True)
    console.print(f"wrote {path}", highlight=False, soft_wrap=True)


def _recorded_figures(path: Path) -> tuple[dict, dict]:
    """(driver figures, probe figures) of a `calibrate --quick --json` output."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        _fail(f"{path}: not readable as JSON: {exc}")
    for field, keys in (("driver", ("name",)), ("probe", ("copy_gbps", "mma_tflops", "launch_us", "seconds"))):
        part = data.get(field) if isinstance(data, dict) else None
        missing = [k for k in keys if not isinstance(part, dict) or k not in part]
        if missing:
            _fail(f"{path}: {field}.{missing[0]} missing: expected what `tuner calibrate --quick --json` prints")
    return data["driver"], data["probe"]


@app.command()
def trace(
    key: str = typer.Option(..., "--key", help="The key as a shape file line, e.g. '2048 4096 4096 held=16'."),
    config: Optional[str] = typer.Option(None, "--config", help="Name of the config to trace."),
    winner: bool = typer.Option(False, "--winner", help="Trace the key's stored winner instead."),
    arch: Optional[str] = typer.Option(None, help="Target architecture: sm90 or sm100 (default: the config's, "
                                                  "else sm90)."),
    output: Path = typer.Option(..., "-o", "--output", help="Directory for trace.json and the PNGs."),
    db: Optional[str] = DbOption,
) -> None:
    """Run one traced launch on the GPU and draw what each SM did.

    A per-SM timeline, tiles per SM and SM idle time."""
    from kernels.space import GemmConfig, InvalidConfig
    from tuner.shapes import parse_key

    if (config is not None) == winner:
        _fail("give exactly one of --config NAME and --winner")
    try:
        problem = parse_key(key).problem
    except ValueError as exc:
        _fail(f"--key: {exc}")
    cfg = None
    if config is not None:
        try:
            cfg = GemmConfig.from_name(config)
        except InvalidConfig as exc:
            _fail(f"--config: {exc}")
        if arch not in (None, cfg.arch):
            _fail(f"--config: {config} is an {cfg.arch} config, not {arch}")
        arch = cfg.arch
    arch = arch or "sm90"
    import torch

    from kernels.compile import device_arch

    if not torch.cuda.is_available():
        _fail(f"tracing runs a kernel: no CUDA device here (an {arch} GPU is needed)")
    here = device_arch(torch.cuda.current_device())
    if here != arch:
        _fail(f"tracing runs a kernel: an {arch} GPU is needed; {torch.cuda.get_device_name()} is {here}")
    k = Key(arch, torch.cuda.get_device_name(), problem)
    if winner:
        store = _open(db, writer=False)
        found = store.winner(k.to_dict())
        store.close()
        if found is None or found.config is None:
            _fail(f"no kernel winner stored for {problem.label()} on {k.device}")
        cfg = GemmConfig.from_dict(found.config)
    from tuner.observe.trace import run, summarise, write

    try:
        result = run(k, cfg)
    except InvalidConfig as exc:
        _fail(str(exc))
    files = write(result, output)
    s = summarise(result)
    console.print(f"{cfg.name()} on {problem.label()}: {s['tiles_run']} tiles run "
                  f"({s.get('tiles_in_problem', 0)} of the problem's {result.tiles}) on {s.get('sms_used', 0)} "
                  f"SMs in {s.get('span_us', 0):.1f} us; SM idle {s.get('idle_us_total', 0):.0f} us",
                  highlight=False)
    for f in files:
        console.print(f"wrote {f}", highlight=False, soft_wrap=True)


def _print_calibration(cal) -> None:
    from tuner.backends.calibration import NOISE

    console.print(f"{cal.device} ({cal.arch}): fitted on {len(cal.train_families)} families, "
                  f"scored on {len(cal.heldout_families)} held out", highlight=False)
    table = _table("", ["held-out keys", "before", "after"], ("held-out keys",))
    before, after = cal.before["heldout"], cal.after["heldout"]
    rows = [
        ("keys (with >= 3 configs)", f"{before.keys}", f"{after.keys}"),
        ("median Spearman", f"{before.median_spearman:.3f}", f"{after.median_spearman:.3f}"),
        ("model's pick vs best", f"{before.mean_pick_slowdown:+.2%}", f"{after.mean_pick_slowdown:+.2%}"),
        (f"keys with >= 3 levels {NOISE:.0%} apart", f"{before.distinct_keys}", f"{after.distinct_keys}"),
        ("  median Spearman", f"{before.distinct_median_spearman:.3f}", f"{after.distinct_median_spearman:.3f}"),
        ("  model's pick vs best", f"{before.distinct_mean_pick_slowdown:+.2%}",
         f"{after.distinct_mean_pick_slowdown:+.2%}"),
        ("mean |time error|", f"{before.mean_abs_error:.1%}", f"{after.mean_abs_error:.1%}"),
        ("cuBLAS estimate, worst", *(f"{s.cublas_max_ratio:.2f}x" if s.cublas_max_ratio else "-"
                                     for s in (before, after))),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    constants = _table("", ["constant", "datasheet", "fitted"], ("constant",))
    for name, value in cal.constants.items():
        constants.add_row(name, f"{cal.before_constants[name]:.4g}", f"{value:.4g}")
    console.print(constants)


_SCHEDULER_SHORT = {
    "single_tile": "single", "static_persistent": "static", "dynamic_persistent": "dynamic", "stream_k": "streamk",
}


def short_config(config_name: str) -> str:
    """A config name without its arch, the scheduler abbreviated: fits a table column."""
    if "-" not in config_name:
        return config_name
    sched, rest = config_name.split("-", 2)[1:]
    return f"{_SCHEDULER_SHORT.get(sched, sched)}-{rest}"


def _table(title: str, columns: list[str], left: tuple[str, ...]) -> Table:
    """A table that fits 80 columns and folds rather than cutting a cell to "…"."""
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, title_justify="left")
    _add_columns(table, columns, left)
    return table


def _family_table(columns: list[str], left: tuple[str, ...]) -> Table:
    """A family's table, without a title: its head goes above it as a line of
    its own (`_print_family`), since a title wraps at the table's width."""
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    _add_columns(table, columns, left)
    return table


def _print_family(head: str, table: Table) -> None:
    console.print(f"\n{head}", highlight=False)
    console.print(table)


def _add_columns(table: Table, columns: list[str], left: tuple[str, ...]) -> None:
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", overflow="fold")


def _print_winners(rows, title: str) -> None:
    """One table a family (name and everything of the key but M), so that a
    row holds M, the winner and its times and fits 80 columns unfolded."""
    from tuner.runtime.lookup import family_id

    families: dict[tuple, list] = {}
    for w in rows:
        families.setdefault((w.name, family_id(w.key)), []).append(w)
    console.print(title, highlight=False)
    for (name, _), winners in families.items():
        table = _family_table(["M", "winner", "ms", "cuBLAS", "x"], ("winner",))
        for w in winners:
            table.add_row(str(w.key["m"]), short_config(w.config_name), f"{w.ms:.4f}", f"{w.baseline_ms:.4f}",
                          f"{w.speedup:.2f}")
        _print_family(_family_head(name or "-", winners[0].key), table)


def _family_head(name: str, f: dict) -> str:
    """A family's table title: its name and its key but M, the device on a
    line of its own where one line would pass 80 columns (and wrap mid-name)."""
    k = ",".join(map(str, f["group_k"])) if f.get("group_k") else str(f["k"])
    head = (f"{name}: N={f['n']} K={k}" + (f" G={f['groups']}" if f["groups"] > 1 else "")
            + f" {f['dtype_in']}>{f['dtype_out']} {f['layout']} {f['arch']}"
            + (f" held={f['carveout']}" if f.get("carveout") else "")
            + (f" overlap={overlap_text(f['overlap'])}" if f.get("overlap") else ""))
    return f"{head} {f['device']}" if len(head) + 1 + len(f["device"]) <= 80 else f"{head}\n  {f['device']}"


@dataclass(frozen=True)
class FamilyMap:
    name: str
    family: dict
    ranges: list

    def to_json(self) -> dict:
        return {
            "name": self.name, "family": self.family,
            "ranges": [
                {"m_lo": r.m_lo, "m_hi": r.m_hi, "choice": r.config_name, "config": r.config,
                 "source": r.source, "backend": r.backend, "evidence": r.evidence}
                for r in self.ranges
            ],
        }


def _family_maps(store, names: list[str] | None = None, **filters) -> list[FamilyMap]:
    """Stored M maps, one per family and device, named after their keys' name."""
    from db.store import FAMILY_FIELDS
    from tuner.runtime.lookup import family_id

    named = {}
    for w in store.winners(limit=1_000_000, **filters):
        named.setdefault(family_id(w.key), w.name)
    maps: dict[tuple, list] = {}
    for r in store.ranges(**filters):
        maps.setdefault(family_id(r.family), []).append(r)
    out = [FamilyMap(named.get(fid, "-"), {f: rs[0].family[f] for f in FAMILY_FIELDS}, rs)
           for fid, rs in maps.items()]
    if names is not None:
        out = [fm for fm in out if fm.name in names]
    return out


def _print_maps(maps: list[FamilyMap], as_json: bool, title: str) -> None:
    from tuner.runtime.lookup import BASELINE, speedup_at

    if as_json:
        print(json.dumps([fm.to_json() for fm in maps], indent=1))
        return
    if not maps:
        console.print("no M maps match")
        return
    console.print(title, highlight=False)
    for fm in maps:
        table = _family_table(["M from", "M to", "choice", "pts", "x min", "x max"], ("choice",))
        for r in fm.ranges:
            if r.config is None:
                # cuBLAS: how close the best kernel came at the points the range covers.
                covered = [p for p in r.evidence if r.covers(p["m"])] or r.evidence
                ratios = [speedup_at(p, n) for p in covered for n in p["ms"] if n != BASELINE]
            else:
                ratios = [speedup_at(p, r.config_name) for p in r.evidence]
            spread = (f"{min(ratios):.2f}", f"{max(ratios):.2f}") if ratios else ("-", "-")
            table.add_row(str(r.m_lo), str(r.m_hi), short_config(r.config_name) + _source_mark(r.source),
                          str(len(r.evidence)), *spread)
        _print_family(_family_head(fm.name, fm.family), table)
    console.print("x: cuBLAS time / choice time at the measured points (cuBLAS rows: the\n"
                  "best kernel's at the points they cover); * measured online", highlight=False)


def _source_mark(source: str) -> str:
    return " *" if source == "online" else ""


if __name__ == "__main__":
    app()
