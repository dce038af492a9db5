"""``isocost engine``: simulated vLLM-like replicas served over HTTP."""

from __future__ import annotations

import sys

import typer

from isocost.cli._app import app, console
from isocost.cli._listening import Listening
from isocost.cli._options import CatalogOption


@app.command()
def engine(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", "--base-port", help="First port (0: OS picks)."),
    model: str = typer.Option("llama-3.1-8b", "--model", "-m", help="Model id or HF folder."),
    gpu: str = typer.Option("h100-80g", "--gpu", "-g", help="GPU catalog id."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel GPUs per replica."),
    replicas: int = typer.Option(1, "--replicas", help="Identical replicas, one port each."),
    replica_spec: list[str] | None = typer.Option(
        None, "--replica-spec", help="key=value,... per replica (gpu, model, tp, slowdown...)."
    ),
    replicas_file: str | None = typer.Option(None, "--replicas-file", help="YAML replica list."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Name clients ask for (default: --model)."
    ),
    time_scale: float = typer.Option(1.0, "--time-scale", help="0.05: a GPU 20x faster."),
    stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens per SSE chunk."),
    max_num_batched_tokens: int = typer.Option(
        8192, "--max-num-batched-tokens", help="Token budget per step (chunked prefill)."
    ),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most running requests."),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="VRAM share for weights, activations and KV."
    ),
    num_gpu_blocks: int | None = typer.Option(
        None, "--num-gpu-blocks-override", help="KV blocks instead of the VRAM ledger's."
    ),
    output_dist: str = typer.Option("exponential", "--output-dist", help="exponential|uniform|max"),
    output_mean_tokens: float = typer.Option(
        128.0, "--output-mean-tokens", help="Mean output length (exponential)."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of output lengths and error draws."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="tokenizer.json: exact."),
    catalog: CatalogOption = None,
    slowdown: float = typer.Option(1.0, "--slowdown", help="Fault: step time factor."),
    error_rate: float = typer.Option(0.0, "--error-rate", help="Fault: share of 500s."),
    hang: bool = typer.Option(False, "--hang", help="Fault: accept, never answer."),
    max_waiting: int | None = typer.Option(None, "--max-waiting", help="Fault: 503 above."),
    write_timeout: float = typer.Option(
        30.0, "--write-timeout", help="Seconds a stream may wait on its client."
    ),
    role: str = typer.Option("both", "--role", help="Disaggregation: prefill|decode|both."),
    link: str = typer.Option("tcp", "--link", help="KV pull link: nvlink|infiniband|roce|tcp."),
    kv_hold_timeout: float = typer.Option(
        480.0, "--kv-hold-timeout", help="Seconds a prefill's KV waits to be pulled."
    ),
    read_timeout: float = typer.Option(
        60.0, "--read-timeout", help="Seconds a request's head, then its body, may take."
    ),
    kv_events_port: int | None = typer.Option(
        None, "--kv-events-port", help="Publish vLLM's KV-cache events (ZMQ): replica i on +i."
    ),
    prompt_details: bool = typer.Option(
        False,
        "--enable-prompt-tokens-details",
        help="Usage says the prompt's cached tokens, as vLLM's flag does.",
    ),
    crash_after_handoff: bool = typer.Option(
        False, "--crash-after-handoff", help="Fault: exit after a prefill hand-off answer."
    ),
) -> None:
    """Serve simulated vLLM-like replicas timed by the cost model.

    Each speaks the OpenAI API and exports vLLM's metrics.
    """
    from isocost.core.costmodel import EngineLimits
    from isocost.engine.config import EngineReplicaConfig, Faults
    from isocost.engine.launch import launch
    from isocost.engine.replica import ServedReplica, ServeOptions
    from isocost.runtime.logs import configure_logging

    configure_logging("warning")  # one JSON object per line, secrets redacted, as serve

    faults = Faults(
        slowdown=slowdown,
        error_rate=error_rate,
        hang=hang,
        max_waiting=max_waiting,
        crash_after_handoff=crash_after_handoff,
    )
    default = EngineReplicaConfig(
        gpu, model, tp, served_model_name or model, num_gpu_blocks, faults, role, link
    )
    limits = EngineLimits(gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
    options = ServeOptions(
        host,
        time_scale,
        stream_interval,
        output_dist,
        output_mean_tokens,
        seed,
        tokenizer,
        write_timeout,
        kv_hold_timeout,
        kv_events_port,
        prompt_details,
        read_timeout,
    )

    listening = Listening(host, port)

    def ready(urls: list[tuple[ServedReplica, str]]) -> None:
        listening.ready = True
        for replica, url in urls:
            line = f"isocost engine: {replica.describe()} ready at {url}"
            console.print(line, highlight=False, soft_wrap=True)
        sys.stdout.flush()

    with listening:
        launch(
            default=default,
            replicas=replicas,
            spec_strings=replica_spec or [],
            replicas_file=replicas_file,
            port=port,
            catalog_paths=catalog or [],
            limits=limits,
            options=options,
            on_ready=ready,
        )
