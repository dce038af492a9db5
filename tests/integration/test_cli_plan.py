"""`isocost plan` as a user runs it: a real subprocess, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ISOCOST = Path(sys.executable).with_name("isocost")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    return subprocess.run(
        [str(ISOCOST), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_json_for_llama_2_7b_on_a100() -> None:
    done = run("plan", "--model", "llama-2-7b", "--gpu", "A100-80G", "--dtype", "fp16",
               "--context", "4000", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["kv_cache_bytes_per_token"] == 524_288
    assert 20 <= doc["max_concurrency_per_replica"] <= 45


def test_tables_and_explain() -> None:
    done = run("plan", "-m", "llama-3.1-70b", "-g", "h100-80g", "--qps", "10",
               "--ttft-slo-ms", "800", "--tpot-slo-ms", "60", "--explain")  # fmt: skip
    assert done.returncode == 0, done.stderr
    for text in ("VRAM ledger", "KV cache pool", "Tensor-parallel options", "recommended TP",
                 "How each figure is derived"):  # fmt: skip
        assert text in done.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("-m", "llama-3-8b", "-g", "a100-80g"), "unknown model 'llama-3-8b'; did you mean"),
        (("-m", "llama-2-7b", "-g", "a100"), "unknown GPU 'a100'; did you mean"),
        (("-m", "llama-3.1-405b", "-g", "a100-80g"), "pipeline parallelism"),
        (("-m", "llama-2-7b", "-g", "a100-80g", "--dtype", "fp4"), "unknown dtype 'fp4'"),
        (("-m", "llama-2-7b", "-g", "a100-80g", "--output-tokens", "9000"), "must be below"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], expected: str) -> None:
    done = run("plan", *args)
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_local_hf_config_and_errors_name_the_file(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
        "num_hidden_layers": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 1000,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
    }))  # fmt: skip
    done = run("plan", "-m", str(model_dir), "-g", "rtx4090-24g", "--context", "1024", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kv_cache_bytes_per_token"] == 2 * 2 * 1 * 64 * 2

    (model_dir / "config.json").write_text('{"hidden_size": 128, "num_attention_heads": "two"}')
    done = run("plan", "-m", str(model_dir), "-g", "rtx4090-24g")
    assert done.returncode == 2
    assert "config.json: num_attention_heads" in done.stderr


def test_user_catalog_file(tmp_path: Path) -> None:
    good = tmp_path / "cat.yaml"
    good.write_text("gpus:\n  - id: my-gpu\n    memory_gib: 96\n    hbm_bandwidth_gb_s: 4000\n"
                    "    bf16_tflops: 900\n    usd_per_hour: 2\n")  # fmt: skip
    done = run("plan", "-m", "llama-3.1-8b", "-g", "my-gpu", "--catalog", str(good), "--json")
    assert done.returncode == 0, done.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - id: my-gpu\n    memory: 96\n")
    done = run("plan", "-m", "llama-3.1-8b", "-g", "my-gpu", "--catalog", str(bad))
    assert done.returncode == 2
    assert "bad.yaml" in done.stderr and "memory" in done.stderr
    done = run("plan", "-m", "llama-3.1-8b", "-g", "a100-80g", "--catalog", "/nonexistent.yaml")
    assert done.returncode == 2 and "/nonexistent.yaml: no such file" in done.stderr


def test_disaggregate_prints_prefill_and_decode_replicas() -> None:
    args = ("plan", "--model", "llama-3.1-8b", "--gpu", "a100-80g", "--context", "12000",
            "--output-tokens", "300", "--tpot-slo-ms", "50", "--disaggregate", "16")  # fmt: skip
    done = run(*args, "--json")
    assert done.returncode == 0, done.stderr
    split = json.loads(done.stdout)["disaggregation"]
    assert split["prefill_replicas"] + split["decode_replicas"] == 16
    assert split["prefill_replicas"] > split["decode_replicas"]  # long prompts: P-heavy
    tables = run(*args)
    assert f"{split['prefill_replicas']} P : {split['decode_replicas']} D" in tables.stdout
    bad = run("plan", "--model", "llama-3.1-8b", "--gpu", "a100-80g", "--disaggregate", "1")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
