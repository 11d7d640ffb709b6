"""The TTFT-by-component benchmark (`lightkv_lab.bench.efficiency.components`) on its tiny
model: what it times adds up, the FLOPs ratios follow the kept tokens, and its analytic count
of the vision tower equals torch's own FLOP counter on the tower's forward."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.bench.efficiency.components import (
    COLUMNS,
    PRESETS,
    ComponentConfig,
    build_llava_next_7b,
    components_markdown,
    run_components,
    tower_flops,
)
from torch.utils.flop_counter import FlopCounterMode


@pytest.fixture(scope="module")
def result():
    cfg = ComponentConfig(tiny=True, layers=3, rounds=1, kept=(0.5, 0.25), threads=1)
    return run_components(cfg, progress=lambda _m: None)


def test_every_variant_is_timed_and_its_parts_fit_in_its_ttft(result):
    rows = result["rows"]
    assert [r["variant"] for r in rows] == ["uncompressed"] + list(PRESETS) * 2
    for r in rows:
        parts = r["components_ms"]
        assert parts["tower"] > 0 and parts["layers"] > 0
        assert 0 <= parts["attention"] <= parts["layers"]
        inside = sum(parts[k] for k in ("tower", "projector", "layers", "selection"))
        assert inside <= r["ttft_ms"] + 1e-6
        compressed = r["variant"] != "uncompressed"
        assert (parts["selection"] > 0) == compressed
        assert ("bias_ms" in r) == (r["variant"] in ("lightkv-cover", "lightkv-cover-channel"))
    md = components_markdown(result)
    assert md.count("\n| ") == len(rows) + 1 and all(f"{c} ms" in md for c in COLUMNS)


def test_flops_ratios_follow_the_kept_tokens(result):
    rows = result["rows"]
    base = rows[0]
    assert base["llm_flops_ratio"] == 1.0 and base["ttft_ratio"] == 1.0
    by = {(r["variant"], r["kept"]): r for r in rows[1:]}
    for preset in PRESETS:
        half, quarter = by[preset, 0.5], by[preset, 0.25]
        assert 0 < quarter["llm_flops_ratio"] < half["llm_flops_ratio"] < 1
        assert quarter["kept_vision_fraction"] < half["kept_vision_fraction"]
        # the tower is the same work at every budget: the whole model's ratio is closer to 1
        assert half["llm_flops_ratio"] < half["model_flops_ratio"] < 1
    # the three lightkv-cover variants keep the same tokens: the same FLOPs
    for kept in (0.5, 0.25):
        ratios = {by[p, kept]["llm_flops_ratio"] for p in PRESETS if p.startswith("lightkv")}
        assert len(ratios) == 1


def test_the_tower_count_equals_torch_flop_counter():
    model, inputs = build_llava_next_7b(ComponentConfig(tiny=True, layers=2))
    tiles = int(inputs["pixel_values"].shape[1])
    pixels = inputs["pixel_values"][0]
    # eager attention: its two matmuls are counted (sdpa's CPU kernel is not, by torch)
    model.model.vision_tower.set_attn_implementation("eager")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.model.vision_tower(pixels.to(model.dtype))
    assert tower_flops(model, tiles) == counter.get_total_flops()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rounds"):
        ComponentConfig(rounds=0)
    with pytest.raises(ValueError, match="unknown variant"):
        ComponentConfig(presets=("fastv",))
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        ComponentConfig(kept=(1.5,))
