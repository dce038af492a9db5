"""The profile fit: times an engine is measured to take give back the catalog entry that
prices it, and measurements that cannot be fitted are refused with a reason."""

from __future__ import annotations

import dataclasses

import pytest

from isocost.core.catalog import Catalog, gpus_catalog_yaml
from isocost.core.costmodel import CostModel
from isocost.core.hardware import GpuSpec
from isocost.core.profile import DecodeSample, PrefillSample, ProfileError, fit_profile

CATALOG = Catalog.builtin()
MODEL = CATALOG.model("llama-3.1-8b")
LENGTHS = (16, 64, 256, 512, 1024, 2048)
BATCHES = ((1, 168), (4, 672), (16, 2688))  # (batch, context tokens between them)
HTTP_S = 0.0008  # what a request's round trip adds to every prefill it times


def measured(gpu: GpuSpec) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """What an engine that runs exactly ``gpu``'s cost model would be measured to take."""
    engine = CostModel(MODEL, gpu)
    prefill = [PrefillSample(n, 0, engine.prefill_time_s(n) + HTTP_S) for n in LENGTHS]
    prefill += [PrefillSample(16, n, engine.prefill_time_s(16, n) + HTTP_S) for n in (256, 1024)]
    decode = [DecodeSample(b, k, engine.decode_step_time_s(b, k)) for b, k in BATCHES]
    return prefill, decode


def test_an_engine_on_another_gpu_is_priced_as_that_gpu() -> None:
    truth = CATALOG.gpu("l20-48g")
    prefill, decode = measured(truth)
    engine = CostModel(MODEL, truth)
    profile = fit_profile(
        MODEL, CATALOG.gpu("a100-80g"), "l20-measured", prefill, decode,
        kv_capacity_tokens=engine.kv_capacity_tokens,
    )  # fmt: skip
    gpu = profile.gpu
    reached = gpu.bf16_flops * gpu.mfu_prefill
    assert reached == pytest.approx(truth.bf16_flops * truth.mfu_prefill, rel=0.02)
    assert gpu.id == "l20-measured" and gpu.usd_per_hour == CATALOG.gpu("a100-80g").usd_per_hour
    for row in profile.rows:  # fitted and checks alike: the shape is the engine's
        assert abs(row.error) < 0.03, row
    assert [r.fitted for r in profile.rows if r.phase == "cached"] == [False, False]
    # memory sized so that the ledger holds the KV the engine reported
    assert CostModel(MODEL, gpu).kv_capacity_tokens == pytest.approx(
        engine.kv_capacity_tokens, rel=1e-3
    )


def test_a_cpu_shaped_engine_prices_a_cached_prefix_as_it_costs() -> None:
    """An engine slow per token with a fixed cost per request, like CPU vLLM: priced as
    the A100 it is not, a cached prefix would save it 1% of a prefill; fitted, 80%."""
    cpu = dataclasses.replace(
        CATALOG.gpu("a100-80g"), id="cpu", bf16_flops=0.4e12, hbm_bandwidth_bytes_per_s=20e9,
        step_overhead_s=0.004, prefill_overhead_s=0.018,
    )  # fmt: skip
    prefill, decode = measured(cpu)
    profile = fit_profile(MODEL, CATALOG.gpu("a100-80g"), "cpu-measured", prefill, decode)
    fitted = CostModel(MODEL, profile.gpu)
    saved = 1 - fitted.prefill_time_s(16, 1024) / fitted.prefill_time_s(1040)
    truth = CostModel(MODEL, cpu)
    assert saved == pytest.approx(
        1 - truth.prefill_time_s(16, 1024) / truth.prefill_time_s(1040), abs=0.02
    )
    assert any("KV capacity" in note for note in profile.notes)  # memory kept, and said


def test_times_off_any_roofline_are_fitted_and_reported_as_noise() -> None:
    """Every other prompt slowed by half (a busy machine): the entry is still written,
    and the report says the fit is not to be trusted; an exact engine gets no such note."""
    prefill, decode = measured(CATALOG.gpu("l20-48g"))
    clean = fit_profile(MODEL, CATALOG.gpu("a100-80g"), "x", prefill, decode)
    assert not any("busy" in note for note in clean.notes)
    noisy = [
        dataclasses.replace(s, seconds=s.seconds * (1.5 if i % 2 else 1.0))
        for i, s in enumerate(prefill)
    ]
    decode = [
        dataclasses.replace(s, seconds=s.seconds * (1.0, 1.6, 1.0)[i]) for i, s in enumerate(decode)
    ]
    profile = fit_profile(MODEL, CATALOG.gpu("a100-80g"), "x", noisy, decode)
    assert any("busy" in note for note in profile.notes), profile.notes


@pytest.mark.parametrize(
    ("prefill_lengths", "batches", "reason"),
    [
        ((512,), (1, 4), "two lengths"),
        ((16, 512), (4,), "two batch sizes"),
    ],
)
def test_too_few_measurements_are_refused(
    prefill_lengths: tuple[int, ...], batches: tuple[int, ...], reason: str
) -> None:
    prefill = [PrefillSample(n, 0, 0.01 * n) for n in prefill_lengths]
    decode = [DecodeSample(b, 128 * b, 0.02) for b in batches]
    with pytest.raises(ProfileError, match=reason):
        fit_profile(MODEL, CATALOG.gpu("a100-80g"), "x", prefill, decode)


def test_times_that_do_not_grow_with_the_prompt_are_refused() -> None:
    prefill = [PrefillSample(n, 0, 0.05) for n in LENGTHS]
    decode = [DecodeSample(b, k, 0.02 + 0.001 * b) for b, k in BATCHES]
    with pytest.raises(ProfileError, match="prefill time does not grow"):
        fit_profile(MODEL, CATALOG.gpu("a100-80g"), "x", prefill, decode)


def test_the_fitted_entry_reads_back_from_its_catalog_yaml() -> None:
    prefill, decode = measured(CATALOG.gpu("l40s-48g"))
    gpu = fit_profile(MODEL, CATALOG.gpu("h100-80g"), "L40S-Here", prefill, decode).gpu
    text = gpus_catalog_yaml([gpu], ["measured here", ""])
    assert text.startswith("# measured here\n#\ngpus:\n")
    read = Catalog.builtin().merged(text, "profile.yaml").gpu("l40s-here")
    for field in dataclasses.fields(GpuSpec):
        value, expected = getattr(read, field.name), getattr(gpu, field.name)
        if isinstance(expected, float):
            assert value == pytest.approx(expected, rel=1e-6, abs=1e-9), field.name
        else:
            assert value == expected, field.name
