"""``isocost profile``: a catalog GPU entry fitted to one idle replica's measured times."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.table import Table

from isocost.cli._app import app, console, err_console, fail
from isocost.cli._options import CatalogOption, checked
from isocost.cli._outputs import check_outputs
from isocost.core.bounds import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Bounds
from isocost.core.hardware import GpuSpec
from isocost.core.profile import Profile


@app.command()
def profile(
    url: str = typer.Argument(..., help="The replica's base URL; nothing else may use it."),
    gpu_id: str = typer.Option(..., "--id", help="Catalog id of the fitted entry."),
    cost_model: str | None = typer.Option(
        None, "--cost-model", help="Catalog id or HF folder of the served model (default: --model)."
    ),
    model: str | None = typer.Option(None, "--model", help="Served name (default: first listed)."),
    like: str = typer.Option(
        "a100-80g", "--like", help="GPU whose unmeasured figures the entry keeps."
    ),
    usd_per_hour: float | None = typer.Option(
        None, "--usd-per-hour", callback=checked(NON_NEGATIVE), help="Its price."
    ),
    out: str | None = typer.Option(None, "--out", help="Write the catalog YAML here."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    catalog: CatalogOption = None,
    max_prompt_tokens: int = typer.Option(
        2048,
        "--max-prompt-tokens",
        callback=checked(Bounds(64)),
        help="Longest prompt (capped by max_model_len).",
    ),
    repeats: int = typer.Option(
        3, "--repeats", callback=checked(AT_LEAST_ONE), help="Requests per length and batch."
    ),
    seed: int | None = typer.Option(
        None, "--seed", help="Seed of the random prompts (default: new each run)."
    ),
    timeout: float = typer.Option(
        120.0, "--timeout", callback=checked(POSITIVE), help="Seconds per request."
    ),
    api_key_env: str | None = typer.Option(
        None, "--api-key-env", help="Environment variable holding the API key."
    ),
) -> None:
    """Fit a catalog GPU entry to an idle replica's measured times.

    Prefill times over prompt lengths and decode steps over batch sizes, fitted to the
    catalog's compute rate, memory rate and overheads; use the entry with --catalog FILE
    and the replica's gpu: ID, so an engine the catalog does not describe (a CPU, a new
    accelerator) is priced in its own shape.
    """
    import asyncio
    import dataclasses
    import json

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from isocost.bench._profile import ProfilePlan, measure_replica
    from isocost.core.catalog import gpus_catalog_yaml
    from isocost.core.profile import fit_profile
    from isocost.files import load_catalog, resolve_model
    from isocost.runtime.scrape import kv_capacity_tokens

    if not gpu_id.strip() or any(c.isspace() for c in gpu_id):
        fail(f"--id {gpu_id!r}: a catalog id has no spaces")
    check_outputs(files={"--out": out})
    priced_as = cost_model or model
    if priced_as is None:
        fail("--cost-model is needed (a catalog id or the model's HF folder), or --model")
    api_key = None
    if api_key_env is not None:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            fail(f"--api-key-env {api_key_env}: that environment variable is not set")
    known = load_catalog(catalog)
    base = known.gpu(like)
    spec = resolve_model(priced_as, known)
    plan = ProfilePlan(
        max_prompt_tokens=max_prompt_tokens, repeats=repeats, timeout_s=timeout, seed=seed
    )
    with Progress(
        TextColumn("{task.description:8s}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as bar:
        task = bar.add_task("probing", total=None)
        measured = asyncio.run(
            measure_replica(
                url,
                spec.vocab_size,
                plan,
                model=model,
                api_key=api_key,
                progress=lambda phase: bar.update(task, advance=1, description=phase),
                on_plan=lambda total: bar.update(task, total=total),
            )
        )
    capacity = None if measured.metrics_text is None else kv_capacity_tokens(measured.metrics_text)
    fitted = fit_profile(
        spec,
        base if usd_per_hour is None else base.with_price(usd_per_hour),
        gpu_id,
        measured.prefill,
        measured.decode,
        kv_capacity_tokens=capacity,
        name=f"{measured.model} at {url}, profiled",
    )
    comments = [
        f"isocost profile of {url} serving {measured.model}, priced as {spec.id},",
        f"figures {base.id} does not measure kept from it. Use: --catalog FILE, gpu: {gpu_id}",
    ]
    yaml = gpus_catalog_yaml([fitted.gpu], comments)
    if out is not None:
        try:
            Path(out).write_text(yaml)
        except OSError as exc:
            fail(f"--out {out}: {exc.strerror or exc}")
    if as_json:
        doc = {
            "model": measured.model,
            "priced_as": spec.id,
            "like": base.id,
            "kv_capacity_tokens": capacity,
            "longest_prompt_tokens": measured.prompt_tokens_cap,
            "rows": [dataclasses.asdict(r) | {"error": r.error} for r in fitted.rows],
            "notes": list(measured.notes + fitted.notes),
            "catalog_yaml": yaml,
        }
        console.print_json(json.dumps(doc))
        return
    console.print(_table(fitted, base.id))
    console.print(_reached(fitted.gpu))
    for note in measured.notes + fitted.notes:
        console.print(f"note: {note}")
    if out is None:
        console.print(yaml, end="", highlight=False, markup=False, soft_wrap=True)
    else:
        console.print(f"wrote {out}: --catalog {out}, gpu: {fitted.gpu.id}")


def _table(fitted: Profile, like: str) -> Table:
    """Each measurement beside the fitted entry's price for it and the base GPU's."""
    table = Table(
        caption=f"ms; *: a prompt found cached, a check the fit did not see; {like}: "
        "the GPU the entry started from",
        caption_justify="left",
    )
    for header in ("phase", "tokens", "context", "measured", "fitted", "error", like):
        table.add_column(header, justify="left" if header == "phase" else "right")
    for row in fitted.rows:
        phase = row.phase if row.fitted else f"{row.phase}*"
        size = f"b={row.size}" if row.phase == "decode" else str(row.size)
        table.add_row(
            phase, size, str(row.context_tokens), f"{row.measured_s * 1e3:.2f}",
            f"{row.modelled_s * 1e3:.2f}", f"{row.error:+.0%}", f"{row.base_s * 1e3:.2f}",
        )  # fmt: skip
    return table


def _reached(gpu: GpuSpec) -> str:
    """The fitted entry's figures as the engine reaches them (peak x utilisation)."""
    return (
        f"{gpu.id}: {gpu.bf16_flops * gpu.mfu_prefill / 1e12:.3g} TFLOP/s and "
        f"{gpu.hbm_bandwidth_bytes_per_s * gpu.mbu_decode / 1e9:.3g} GB/s reached, "
        f"{gpu.step_overhead_s * 1e3:.3g} ms per step, "
        f"{gpu.prefill_overhead_s * 1e3:.3g} ms more per prefill"
    )
