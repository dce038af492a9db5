"""Rendering of ``isocost plan`` results: Rich tables for people, JSON for scripts."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

from isocost.core.planner import DisaggPlan, PlanResult
from isocost.core.planner import explain as explain_rows

__all__ = ["print_disaggregation", "print_json", "print_tables"]

_GIB = 1024**3


def print_json(result: PlanResult, split: DisaggPlan | None = None) -> None:
    document = result.as_dict()
    if split is not None:
        document["disaggregation"] = {
            "prefill_replicas": split.prefill_replicas,
            "decode_replicas": split.decode_replicas,
            "prefill_s_per_request": split.prefill_s_per_request,
            "decode_s_per_request": split.decode_s_per_request,
            "decode_batch": split.decode_batch,
            "requests_per_s": split.requests_per_s,
        }
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_disaggregation(console: Console, split: DisaggPlan) -> None:
    """The P:D split: each pool's replicas and the work per request that sized it."""
    table = Table(
        title=f"Prefill/decode split: {split.prefill_replicas} P : {split.decode_replicas} D",
        title_justify="left",
        caption="pools sized by the replica-seconds one request takes in each",
        caption_justify="left",
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, text in (
        ("prefill replicas (role: prefill)", f"{split.prefill_replicas}"),
        ("decode replicas (role: decode)", f"{split.decode_replicas}"),
        ("prefill s per request on P", f"{split.prefill_s_per_request:.3f}"),
        ("decode replica-s per request on D", f"{split.decode_s_per_request:.3f}"),
        ("decode batch at the TPOT target", f"{split.decode_batch}"),
        ("prefill share of the work", f"{split.prefill_share:.0%}"),
        ("sustained req/s of the split", f"{split.requests_per_s:,.2f}"),
    ):
        table.add_row(name, text)
    console.print(table)


def print_tables(console: Console, result: PlanResult, *, explain: bool = False) -> None:
    req, rec = result.request, result.recommended
    ledger = rec.cost.ledger
    title = (
        f"{req.model.id} on {req.gpu.id} · {rec.cost.weight_dtype} weights, "
        f"{rec.cost.kv_dtype} KV · context {req.context_tokens:,} "
        f"(output {req.output_tokens:,})"
    )
    led = Table(title=f"VRAM ledger per GPU at TP {rec.tensor_parallel}", title_justify="left")
    led.add_column("item")
    led.add_column("GiB", justify="right")
    led.add_column("share", justify="right")
    for name, value in (
        ("total memory", ledger.total_bytes),
        (f"usable ({req.gpu_memory_utilization:.0%})", ledger.usable_bytes),
        ("weights", ledger.weights_bytes),
        ("activations (peak)", ledger.activations_bytes),
        ("CUDA context + graphs", ledger.cuda_context_bytes),
        ("KV cache pool", ledger.kv_pool_bytes),
        (f"  of which headroom ({req.headroom:.0%})", int(ledger.kv_pool_bytes * req.headroom)),
    ):
        led.add_row(name, f"{value / _GIB:,.2f}", f"{value / ledger.total_bytes:.1%}")
    console.print(f"[bold]{title}[/]")
    console.print(led)

    per = Table(title="Per request and per replica", title_justify="left")
    per.add_column("figure")
    per.add_column("value", justify="right")
    kv_tok = rec.cost.kv_bytes_per_token
    for name, text in (
        ("KV cache per token", f"{kv_tok:,} B ({kv_tok / 1024:,.0f} KiB)"),
        ("KV cache per request", f"{kv_tok * req.context_tokens / _GIB:,.2f} GiB"),
        ("max concurrency per replica", f"{rec.max_concurrency:,}"),
        ("operating concurrency", f"{rec.batch_size:,} (limited by {rec.limited_by})"),
        ("predicted TTFT / TPOT", f"{rec.ttft_s * 1e3:,.0f} ms / {rec.tpot_s * 1e3:,.1f} ms"),
        ("single-stream decode", f"{rec.single_stream_tokens_per_s:,.0f} tok/s"),
        ("decode rate at operating batch", f"{rec.decode_tokens_per_s:,.0f} tok/s"),
        ("sustained output (prefill paid)", f"{rec.output_tokens_per_s:,.0f} tok/s"),
        ("requests per second", f"{rec.requests_per_s:,.2f}"),
        ("$ per million output tokens", f"${rec.usd_per_million_output_tokens:,.3f}"),
    ):
        per.add_row(name, text)
    console.print(per)

    opts = Table(title="Tensor-parallel options", title_justify="left")
    for col in (
        "TP",
        "fits",
        "max conc.",
        "op. conc.",
        "decode tok/s",
        "replicas",
        "GPUs",
        "$/Mtok",
    ):
        opts.add_column(col, justify="right")
    for o in result.options:
        mark = " ◀" if o is rec else ""
        opts.add_row(
            f"{o.tensor_parallel}{mark}",
            "yes" if o.fits else "no",
            f"{o.max_concurrency:,}",
            f"{o.batch_size:,}",
            f"{o.decode_tokens_per_s:,.0f}" if o.fits else "-",
            f"{o.replicas_needed:,}" if o.meets_slos else "-",
            f"{o.gpus_needed:,}" if o.meets_slos else "-",
            f"${o.usd_per_million_output_tokens:,.3f}" if o.fits else "-",
        )
    console.print(opts)
    console.print(
        f"[bold green]minimum TP {result.min_tensor_parallel}, recommended TP "
        f"{rec.tensor_parallel}: {rec.replicas_needed} replica(s), {rec.gpus_needed} GPU(s)[/]"
    )
    for note in result.notes:
        console.print(f"[yellow]note:[/] {note}")
    if explain:
        table = Table(title="How each figure is derived", title_justify="left")
        table.add_column("figure")
        table.add_column("value", justify="right")
        table.add_column("derivation")
        for row in explain_rows(result):
            table.add_row(*row)
        console.print(table)
