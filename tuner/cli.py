"""The `tuner` command line."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kernels.space import ARCHS, SCHEDULERS
from tuner.key import Key

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()

BACKENDS = ("model", "gpu")
# Trials per key when --trials is not given. A GPU trial costs a compile and
# a timing, so a GPU study leans on the model's picks (compiled in parallel
# up front) and samples a few more.
DEFAULT_TRIALS = {"model": 24, "gpu": 14}

DbOption = typer.Option(None, "--db", help="Database URL or SQLite path (default: $TUNER_DB, else the user data dir).")


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _backend(name: str, arch: str):
    if name not in BACKENDS:
        _fail(f"unknown backend {name!r}; expected one of {BACKENDS}")
    if arch not in ARCHS:
        _fail(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if name == "model":
        from tuner.model import ModelBackend

        return ModelBackend(arch)
    from tuner.gpu import GpuBackend, GpuUnavailable

    try:
        return GpuBackend(arch)
    except GpuUnavailable as exc:
        _fail(f"the gpu backend is not available here: {exc}")


@app.command()
def tune(
    shapes: Path = typer.Option(..., "--shapes", help="Shape file: one GEMM key per line."),
    backend: str = typer.Option("model", help="Measurement backend: model or gpu."),
    arch: str = typer.Option("sm90", help="Target architecture: sm90 or sm100."),
    trials: Optional[int] = typer.Option(None, min=1, help="Measured trials per key."),
    seconds: Optional[float] = typer.Option(None, min=1, help="Time budget per key, in seconds."),
    force: bool = typer.Option(False, help="Retune keys that already have a current winner."),
    only: Optional[str] = typer.Option(
        None, help="Only keys whose name matches this glob (e.g. 'gemma3-27b.*')."),
    db: Optional[str] = DbOption,
) -> None:
    """Search the kernel pool for every key of a shape file and store the winners."""
    from db.store import Store
    from tuner.search import Budget, tune_key
    from tuner.shapes import ShapeFileError, parse_shapes

    # The whole file is checked before the database is opened: a bad line
    # stores nothing.
    try:
        entries = parse_shapes(shapes)
    except ShapeFileError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{shapes}: {exc.strerror or exc}")
    if only is not None:
        entries = [e for e in entries if fnmatch.fnmatchcase(e.name, only)]
        if not entries:
            _fail(f"no key of {shapes} has a name matching {only!r}")
    bk = _backend(backend, arch)
    store = Store(db)
    budget = Budget(trials=trials or DEFAULT_TRIALS[backend], seconds=seconds)
    outcomes = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for entry in entries:
            key = Key(arch, bk.device_name, entry.problem)
            label = f"{entry.name or '-'} {entry.problem.label()}"
            task = progress.add_task(label, total=budget.trials)

            def advance(done: int, total: int, task=task) -> None:
                progress.update(task, completed=done, total=total)

            outcome = tune_key(key, bk, store, budget, name=entry.name, force=force, on_trial=advance)
            progress.update(task, completed=budget.trials, description=label + (" (done before)" if outcome.skipped else ""))
            outcomes.append(outcome)
    console.print(_winners_table([o.winner for o in outcomes], f"Winners ({bk.device_name}, {arch})"))
    store.close()


@app.command()
def show(
    arch: Optional[str] = typer.Option(None, help="Only this architecture."),
    device: Optional[str] = typer.Option(None, help="Only this device name."),
    backend: Optional[str] = typer.Option(None, help="Only results of this backend (model or gpu)."),
    m: Optional[int] = typer.Option(None, help="Only this M."),
    n: Optional[int] = typer.Option(None, help="Only this N."),
    k: Optional[int] = typer.Option(None, help="Only this K."),
    groups: Optional[int] = typer.Option(None, help="Only this group count."),
    limit: int = typer.Option(200, min=1, max=100_000, help="Rows at most."),
    db: Optional[str] = DbOption,
) -> None:
    """Show stored winners with each scheduler's best time and the cuBLAS baseline."""
    from db.store import Store

    store = Store(db)
    rows = store.winners(
        limit=limit, arch=arch, device=device, backend=backend, m=m, n=n, k=k, groups=groups,
    )
    if not rows:
        console.print("no winners match")
        return
    console.print(_winners_table(rows, f"{len(rows)} winners"))
    store.close()


@app.command("export")
def export_(
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="JSON file (default: stdout)."),
    db: Optional[str] = DbOption,
) -> None:
    """Write every stored winner as JSON."""
    from db.store import Store

    text = json.dumps(Store(db).export(), indent=1)
    if output is None:
        print(text)
    else:
        output.write_text(text + "\n")
        console.print(f"wrote {output}")


@app.command("import")
def import_(
    source: Path = typer.Argument(..., help="JSON file written by `tuner export`."),
    db: Optional[str] = DbOption,
) -> None:
    """Store winners from a JSON export; a stored winner is replaced only by a faster one."""
    from db.store import Store

    try:
        records = json.loads(source.read_text())
        if not isinstance(records, list):
            raise ValueError("expected a JSON list of winner records")
    except (OSError, ValueError) as exc:
        _fail(f"{source}: {exc}")
    try:
        count = Store(db).import_records(records)
    except (KeyError, TypeError, ValueError) as exc:
        _fail(f"{source}: malformed record: {exc}")
    console.print(f"imported {count} of {len(records)} winners")


@app.command("shapes")
def shapes_(
    from_config: Path = typer.Option(..., "--from-config", help="A Hugging Face style config.json."),
    m: str = typer.Option("1,16,128,512,2048,8192", help="Token counts M, comma-separated."),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="Shape file to write (default: stdout)."),
) -> None:
    """Write a shape file with a model's QKV, O, gate+up and down GEMMs."""
    from tuner.shapes import ShapeFileError, write_shapes_from_config

    try:
        m_values = [int(v) for v in m.split(",")]
    except ValueError:
        _fail(f"--m must be comma-separated integers, got {m!r}")
    try:
        text = write_shapes_from_config(from_config, m_values, output)
    except (OSError, ValueError, ShapeFileError) as exc:
        _fail(f"{from_config}: {exc}")
    if output is None:
        print(text, end="")
    else:
        console.print(f"wrote {output}")


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on."),
    workers: int = typer.Option(1, min=1, max=64, help="Server processes sharing the port."),
    db: Optional[str] = DbOption,
) -> None:
    """Serve the stored winners over HTTP (OpenAPI at /docs)."""
    import os

    import uvicorn

    from db.engine import ENV_VAR, resolve_url

    # Every worker process builds its own app from the factory and finds the
    # database through the environment.
    os.environ[ENV_VAR] = resolve_url(db)
    uvicorn.run(
        "service.app:create_app", factory=True, host=host, port=port, workers=workers,
        access_log=False, log_level="warning",
    )


def _winners_table(rows, title: str) -> Table:
    scheds = [s for s in SCHEDULERS if any(s in w.best_by_scheduler for w in rows)]
    table = Table(title=title)
    for col in ("name", "M", "N", "K", "G", "winner", "ms", "cuBLAS ms", "speedup"):
        table.add_column(col, justify="right" if col not in ("name", "winner") else "left")
    for s in scheds:
        table.add_column(f"{s} ms", justify="right")
    for w in rows:
        k = w.key
        kk = ",".join(map(str, k["group_k"])) if k["group_k"] else str(k["k"])
        cells = [
            w.name or "-", str(k["m"]), str(k["n"]), kk, str(k["groups"]),
            w.config_name, f"{w.ms:.4f}", f"{w.baseline_ms:.4f}", f"{w.speedup:.2f}x",
        ]
        cells += [f"{w.best_by_scheduler[s]:.4f}" if s in w.best_by_scheduler else "-" for s in scheds]
        table.add_row(*cells)
    return table


if __name__ == "__main__":
    app()
