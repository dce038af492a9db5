"""``isocost plan``: size a deployment with the cost model (tables from ``planview``)."""

from __future__ import annotations

import typer

from isocost.cli._app import app, console, fail
from isocost.cli._options import CatalogOption, checked
from isocost.core.bounds import FRACTION, NON_NEGATIVE, POSITIVE, Bounds


@app.command()
def plan(
    model: str | None = typer.Option(
        None, "--model", "-m", help="Catalog id or local HF model folder."
    ),
    gpu: str | None = typer.Option(None, "--gpu", "-g", help="GPU catalog id, e.g. a100-80g."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weights: fp16|bf16|fp8|int8|int4."),
    kv_dtype: str | None = typer.Option(None, "--kv-dtype", help="KV cache dtype."),
    context: int = typer.Option(2048, "--context", help="Mean tokens per request (in + out)."),
    output_tokens: int = typer.Option(256, "--output-tokens", help="Mean output tokens."),
    concurrency: int | None = typer.Option(None, "--concurrency", help="Concurrent requests."),
    qps: float | None = typer.Option(
        None, "--qps", callback=checked(POSITIVE), help="Target requests per second."
    ),
    ttft_slo_ms: float | None = typer.Option(
        None, "--ttft-slo-ms", callback=checked(POSITIVE), help="TTFT SLO."
    ),
    tpot_slo_ms: float | None = typer.Option(
        None, "--tpot-slo-ms", callback=checked(POSITIVE), help="TPOT SLO."
    ),
    gpu_mem_util: float = typer.Option(
        0.9, "--gpu-mem-util", callback=checked(FRACTION), help="vLLM memory fraction."
    ),
    headroom: float = typer.Option(
        0.15,
        "--headroom",
        callback=checked(Bounds(0.0, 1.0, high_open=True)),
        help="KV pool share kept free.",
    ),
    price: float | None = typer.Option(
        None, "--price", callback=checked(NON_NEGATIVE), help="Override $/GPU-hour."
    ),
    catalog: CatalogOption = None,
    explain: bool = typer.Option(False, "--explain", help="Show each figure's derivation."),
    disaggregate: int | None = typer.Option(
        None, "--disaggregate", help="Split N replicas into prefill and decode (P:D)."
    ),
    cached_tokens: int = typer.Option(
        0, "--cached-tokens", help="With --disaggregate: mean prompt tokens found cached."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    from_record: str | None = typer.Option(
        None, "--from-record", help="A recording: the cheapest fleet for its traffic, simulated."
    ),
    growth: float = typer.Option(
        1.0, "--growth", callback=checked(POSITIVE), help="With --from-record: traffic x this."
    ),
    policy: str | None = typer.Option(
        None, "--policy", help="With --from-record: policy (default: the recorded one)."
    ),
    gpus: str | None = typer.Option(
        None, "--gpus", help="With --from-record: GPU ids to try (default: the catalog's)."
    ),
    max_replicas: int = typer.Option(64, "--max-replicas", help="With --from-record."),
    target: float = typer.Option(
        0.9, "--target", callback=checked(FRACTION), help="With --from-record: share within SLO."
    ),
    pool: str | None = typer.Option(None, "--pool", help="With --from-record: recorded pool."),
) -> None:
    """Size a deployment: VRAM, TP, replicas, throughput, $ per token.

    The VRAM ledger per GPU, then each tensor-parallel option; with --disaggregate N,
    the prefill and decode replicas N replicas of the recommended TP split into.
    """
    from isocost.cli import planview
    from isocost.core.planner import PlanRequest, plan_disaggregation
    from isocost.core.planner import plan as run_plan
    from isocost.files import load_catalog, resolve_model

    cat = load_catalog(catalog)
    if from_record is not None:
        from isocost.cli._planrecord import plan_from_record

        plan_from_record(from_record, cat, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
                         target=target, growth=growth, policy=policy, gpus=gpus,
                         max_replicas=max_replicas, pool=pool, as_json=as_json)  # fmt: skip
        return
    if model is None or gpu is None:
        fail("give --model and --gpu (or --from-record DIR)")
    gpu_spec = cat.gpu(gpu)
    if price is not None:
        gpu_spec = gpu_spec.with_price(price)
    try:
        request = PlanRequest(
            model=resolve_model(model, cat),
            gpu=gpu_spec,
            weight_dtype=dtype,
            kv_dtype=kv_dtype,
            context_tokens=context,
            output_tokens=output_tokens,
            concurrency=concurrency,
            qps=qps,
            ttft_slo_s=None if ttft_slo_ms is None else ttft_slo_ms / 1000,
            tpot_slo_s=None if tpot_slo_ms is None else tpot_slo_ms / 1000,
            gpu_memory_utilization=gpu_mem_util,
            headroom=headroom,
        )
    except ValueError as exc:
        fail(str(exc))
    result = run_plan(request)
    split = None
    if disaggregate is not None:
        try:
            split = plan_disaggregation(
                result.recommended.cost,
                disaggregate,
                prompt_tokens=request.prompt_tokens,
                output_tokens=output_tokens,
                cached_tokens=cached_tokens,
                tpot_slo_s=request.tpot_slo_s,
                headroom=headroom,
            )
        except ValueError as exc:
            fail(f"--disaggregate: {exc}")
    if as_json:
        planview.print_json(result, split)
    else:
        planview.print_tables(console, result, explain=explain)
        if split is not None:
            planview.print_disaggregation(console, split)
