"""The vLLM plugin's vLLM-free half (`lightkv.integrations.vllm.plan`, `.install`), and that
the main suite never needs vLLM. The plugin inside a real vLLM engine: tests/vllm
(`make test-vllm`)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

import lightkv
from lightkv import ImageSegment, VisionLayout
from lightkv.integrations.vllm import ARCHITECTURES, SUPPORTED_VLLM, TESTED_VLLM, check_version
from lightkv.integrations.vllm.install import TORCH_FAMILY, requirements
from lightkv.integrations.vllm.plan import (
    PROMPT_AGNOSTIC_PRESETS,
    PROMPT_AWARE_PRESETS,
    PreLLMPlan,
    UnsupportedPipeline,
)
from lightkv.integrations.vllm.question import question_ids, question_list, question_tag
from lightkv.policies import SmallestDivergence
from lightkv.policies.counts import kept_count

ROOT = Path(__file__).resolve().parents[1]
WINDOWED = {
    "schedule": {"name": "pre_llm", "params": {"removal_ratio": 0.5, "windows_per_side": 2}},
    "relevance": "uniform",
}


@pytest.mark.parametrize("name", PROMPT_AGNOSTIC_PRESETS + PROMPT_AWARE_PRESETS)
def test_the_served_presets_load(name):
    plan = PreLLMPlan.load(name, num_layers=28)
    assert plan.stage.spec.mode == "pre_llm" and plan.stage.spec.layer == 0


@pytest.mark.parametrize(
    "name, why",
    [
        ("lightkv", "one KV length for all layers"),
        ("tome", "compresses inside the decoder"),
        ("fastv", "after layer(s) 1"),
        ("elasticcache", "on the cache of layer(s)"),
        ("h2o", "no prefill stage"),
        ("lightkv-pre-llm", "relevance 'query_softmax' is prompt-aware"),
        ("lightkv-low-budget", "prompt-aware"),
        ("visionzip", "vision tower's attention"),
        ("vispruner", "vision tower's attention"),
        ("mmtok", "pruner 'mmtok' reads the prompt"),
        ("scope", "vision tower's attention"),
        ("holov", "vision tower's attention"),
        ("vscan", "after layer(s) 13"),
        ("dart", "need key_states of layer 0"),
    ],
)
def test_every_other_preset_is_refused_with_its_reason(name, why):
    with pytest.raises(UnsupportedPipeline, match="cannot run inside vLLM|no prefill stage") as err:
        PreLLMPlan.load(name, num_layers=28)
    assert why in str(err.value)
    assert "divprune" in str(err.value)  # ... and what to use instead


def test_a_stage_reading_a_tower_layer_is_refused():
    from dataclasses import replace

    import lightkv

    pipe = lightkv.load("divprune")
    scan = lightkv.load("vscan").partitioner  # its local scan reads tower layer 5
    with pytest.raises(UnsupportedPipeline, match=r"tower's attention at layer\(s\) \[5\]"):
        PreLLMPlan.load(replace(pipe, partitioner=scan), num_layers=28)


def test_every_shipped_preset_is_either_served_or_refused():
    for name in lightkv.PRESETS:
        try:
            PreLLMPlan.load(name, num_layers=28)
        except UnsupportedPipeline:
            continue
        assert name in PROMPT_AGNOSTIC_PRESETS + PROMPT_AWARE_PRESETS, (
            f"{name} runs in vLLM: list it in PROMPT_AGNOSTIC_PRESETS or PROMPT_AWARE_PRESETS "
            "and the guide"
        )


@pytest.mark.parametrize("grid", [(6, 10), (12, 10), (3, 3), (16, 16)])
def test_proportional_attention_is_served_with_each_survivors_size(grid):
    """lightkv-cover merges every token it does not keep: its survivors' sizes (what the
    plugin's head channel adds as log(size)) are >= 1 and sum to the image's tokens; a
    pruning pipeline with the bias on has every size 1 (the channel adds 0)."""
    cover = PreLLMPlan.load("lightkv-cover", num_layers=4)
    assert cover.proportional and not PreLLMPlan.load("divprune", num_layers=4).proportional
    g = torch.Generator().manual_seed(grid[0] * 100 + grid[1])
    n = grid[0] * grid[1]
    embeds, question = torch.randn(n, 16, generator=g), torch.randn(4, 16, generator=g)
    sel = cover.select([embeds], [grid], questions=[question])[0]
    assert sel.sizes.shape == sel.index.shape
    assert bool((sel.sizes >= 1).all()) and float(sel.sizes.sum()) == n
    if sel.index.numel() < n:
        assert float(sel.sizes.max()) > 1
    pruned = PreLLMPlan.load(
        replace(lightkv.load("divprune"), proportional_attention=True), num_layers=4
    )
    assert pruned.proportional
    kept = pruned.select([embeds], [grid])[0]
    assert kept.sizes.tolist() == [1.0] * kept.index.numel()


def test_an_inline_mapping_and_a_bad_spec():
    assert PreLLMPlan.load(WINDOWED, num_layers=2).kept_count(8, 8) == 32
    with pytest.raises(UnsupportedPipeline, match="preset name, a pipeline YAML path or an inline"):
        PreLLMPlan.load(3, num_layers=2)
    with pytest.raises(ValueError, match="unknown preset"):
        PreLLMPlan.load("no-such-preset", num_layers=2)


@pytest.mark.parametrize("grid", [(24, 24), (16, 16), (4, 6), (7, 12), (1, 1)])
def test_divprune_count_from_the_grid_is_the_exact_budget(grid):
    plan = PreLLMPlan.load("divprune", num_layers=2)
    n = grid[0] * grid[1]
    assert plan.kept_count(*grid) == int(kept_count(torch.tensor(n), 1 - 128 / 576))


def test_select_is_lightkvs_stage_per_image_in_one_padded_batch():
    plan = PreLLMPlan.load(WINDOWED, num_layers=2)
    stage = lightkv.PipelineConfig.from_dict(WINDOWED).build().stages(2)[0]
    g = torch.Generator().manual_seed(0)
    grids = [(6, 8), (4, 4), (10, 6)]
    embeds = [torch.randn(r * c, 32, generator=g) for r, c in grids]
    selections = plan.select(embeds, grids)
    for e, (r, c), sel in zip(embeds, grids, selections):
        layout = VisionLayout.from_segments(1, r * c, [ImageSegment(row=0, offset=0, grid=(r, c))])
        alone = stage(e[None], layout)
        assert sel.index.tolist() == alone.kept_index[0].tolist()
        torch.testing.assert_close(sel.embeds, alone.hidden[0])
        assert sel.index.numel() == plan.kept_count(r, c) < r * c
        assert torch.all(sel.index[1:] > sel.index[:-1])


def _cover():
    return replace(lightkv.load("lightkv-cover"), proportional_attention=False)


@pytest.mark.parametrize("spec", ["cdpruner", "cover"])
def test_prompt_aware_select_is_the_stage_on_the_image_then_its_question(spec):
    """Each image in its own row, followed by its question; the same as lightkv's Stage on a
    whole prompt (text, the image, the question) with the Prompt and question relevance."""
    from lightkv.policies import Prompt

    pipe = _cover() if spec == "cover" else lightkv.load(spec)
    plan, stage = PreLLMPlan.load(pipe, num_layers=2), pipe.stages(2)[0]
    assert plan.reads_prompt and plan.per_image == (spec == "cdpruner")
    g = torch.Generator().manual_seed(1)
    grids, lens = [(6, 8), (4, 4), (10, 6)], [3, 0, 5]
    embeds = [torch.randn(r * c, 32, generator=g) for r, c in grids]
    questions = [torch.randn(t, 32, generator=g) for t in lens]
    ids = [torch.arange(t) + 7 for t in lens]
    selections = plan.select(embeds, grids, questions=questions, question_ids=ids)
    kept = []
    for e, (r, c), q, sel in zip(embeds, grids, questions, selections):
        pre = torch.randn(4, 32, generator=g)  # text before the image: not read
        hidden = torch.cat([pre, e, q])[None]
        layout = VisionLayout.from_segments(
            1, hidden.shape[1], [ImageSegment(row=0, offset=4, grid=(r, c))]
        )
        prompt = Prompt(torch.zeros(1, hidden.shape[1], dtype=torch.long))
        xi = stage.relevance_scores(None, None, layout, prompt=prompt, hidden=hidden).float()
        alone = stage(hidden, layout, xi, None, None, prompt)
        row = alone.kept_index[0]
        vision = (row >= 4) & (row < 4 + r * c)
        assert sel.index.tolist() == (row[vision] - 4).tolist()
        torch.testing.assert_close(sel.embeds, alone.hidden[0][vision])
        assert sel.index.numel() == plan.kept_count(r, c) < r * c
        kept.append(sel.index.tolist())
    other = plan.select(embeds[:1], grids[:1], questions=[-questions[0]])[0]
    assert other.index.numel() == len(kept[0])  # another question: the same count


def test_a_pipeline_that_relates_the_images_of_a_prompt_is_found():
    """`per_image` probes whether an image's survivors depend on the prompt's other images:
    lightkv-cover's `question_similarity` scales relevance over all images of a prompt (the
    model then refuses more than one image per prompt); CDPruner scales it per image."""
    assert not PreLLMPlan.load(_cover(), num_layers=2).per_image
    assert PreLLMPlan.load("cdpruner", num_layers=2).per_image
    assert PreLLMPlan.load("divprune", num_layers=2).per_image


def test_the_question_is_the_text_after_the_last_image():
    pad = 9
    assert question_ids([1, 2, pad, pad, 3, pad, 4, 5], pad) == [4, 5]
    assert question_ids([pad, pad], pad) == [] and question_ids([1, 2], pad) == [1, 2]
    assert question_tag([4, 5]) == question_tag((4, 5)) != question_tag([5, 4])
    assert [t.tolist() for t in question_list(torch.tensor([[1, 2], [3, 4]]), 2)] == [
        [1, 2],
        [3, 4],
    ]
    with pytest.raises(RuntimeError, match="without its question"):
        question_list(None, 1)


def test_select_checks_shapes():
    plan = PreLLMPlan.load("divprune", num_layers=2)
    assert plan.select([], []) == []
    with pytest.raises(ValueError, match="do not match its"):
        plan.select([torch.randn(10, 8)], [(3, 3)])


@dataclass
class _CountFollowsCalls(SmallestDivergence):
    """Removes fewer tokens on every other call: stands for a count that follows content
    (the probe's two seeded images then keep different numbers)."""

    calls: int = 0

    def budget(self, graph, ratio):
        self.calls += 1
        return super().budget(graph, ratio if self.calls % 2 else ratio / 2)


def test_a_count_that_depends_on_content_is_refused():
    pipe = replace(lightkv.PipelineConfig.from_dict(WINDOWED).build(), pruner=_CountFollowsCalls())
    with pytest.raises(UnsupportedPipeline, match="depends on the image's content"):
        PreLLMPlan.load(pipe, num_layers=2)


def test_select_refuses_a_count_other_than_announced():
    plan = PreLLMPlan.load(WINDOWED, num_layers=2)
    plan._counts[4, 4] = 3
    with pytest.raises(RuntimeError, match="vLLM was told 3"):
        plan.select([torch.randn(16, 8)], [(4, 4)])


def test_the_entry_point_and_the_extra_are_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["entry-points"]["vllm.general_plugins"] == {
        "lightkv": "lightkv.integrations.vllm:register"
    }
    low, high = SUPPORTED_VLLM[0], SUPPORTED_VLLM[-1].split(".")
    assert meta["optional-dependencies"]["vllm"] == [f"vllm>={low},<{high[0]}.{int(high[1]) + 1}"]
    assert all(v.rsplit(".", 1)[0] in SUPPORTED_VLLM for v in TESTED_VLLM)
    for target in ARCHITECTURES.values():
        module, _, cls = target.partition(":")
        assert (ROOT / (module.replace(".", "/") + ".py")).exists() and cls


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0", "unknown"])
def test_check_version_refuses_a_release_outside_the_range_in_one_line(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    with pytest.raises(
        RuntimeError,
        match=r"supports vLLM 0.32.x and 0.33.x only \(tested: 0.32.0\), not " + version,
    ) as e:
        check_version()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.33.0", "0.33.2+cu130"])
def test_check_version_accepts_the_declared_range(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    assert check_version() == version


def test_importing_the_plugin_package_needs_no_vllm():
    import subprocess

    code = (
        "import sys, lightkv.integrations.vllm, lightkv.integrations.vllm.plan; "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_install_lists_requirements_without_the_torch_family():
    reqs = requirements("lightkv")
    names = {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in reqs}
    assert "pydantic" in names and not names & TORCH_FAMILY
    assert all(";" not in r for r in reqs)  # markers evaluated, extras' requirements dropped


def test_the_gpu_checks_vllm_section_dry_runs_without_a_gpu(tmp_path):
    import os
    import subprocess

    env = {
        **os.environ,
        "DRY_RUN": "1",
        "GPU_CHECK_VLLM": "1",
        "PY": sys.executable,
        "OUT": str(tmp_path),
    }
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vllm==0.33.0" in proc.stdout  # the current CUDA release of the declared range
    assert "divprune: 128 of 576 image tokens" in proc.stdout
    for variant, kept in (
        ("stock", 576),
        ("divprune-22", 127),
        ("divprune-11", 64),
        ("cover-22", 127),
        ("cover-pa-11", 64),  # lightkv-cover with its bias, through the head channel
    ):
        assert (
            f"vllm_concurrency (dry run): {variant}: {kept} of 576 image tokens, concurrency [1, "
            "8, 32]" in proc.stdout
        )
    assert "lightkv-pre-llm-uniform: 288 of 576 image tokens" in proc.stdout
    assert (
        "3c. where flash_attn imports: stock vs lightkv under --attn-implementation "
        "flash_attention_2" in proc.stdout
    )
    assert f"{tmp_path}/budgets-fa2" in proc.stdout and "padded batch of 8" in proc.stdout
    assert "3c. benchmarks/flash_batch.py --dry-run passed" in proc.stdout
    batch = json.loads((tmp_path / "flash-batch-dry-run" / "flash-batch.json").read_text())
    assert batch["rows"] == 2 and len(batch["variants"]) == 4  # uncompressed + 3 presets at 22%
    assert "3d." in proc.stdout and "-k graph" in proc.stdout


def test_the_plan_grid_is_bounded_before_any_tensor():
    """Issue 40 item 3: ``kept_count(100_000, 100_000)`` tried to allocate 640 GB."""
    import time

    from lightkv.integrations.vllm.plan import MAX_IMAGE_TOKENS

    plan = PreLLMPlan.load("divprune", num_layers=28)
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"at most 16,384 tokens .* got 100,000 x 100,000 = 10,000,000,000"
    ):
        plan.kept_count(100_000, 100_000)
    with pytest.raises(ValueError, match="at most 16,384 tokens"):
        plan.select([torch.zeros(1, 4)], [(1, MAX_IMAGE_TOKENS + 1)])
    assert time.perf_counter() - start < 1.0
    assert (
        PreLLMPlan.load("downsample", num_layers=28).kept_count(128, 128) > 0
    )  # the limit itself is served


def test_a_pipelines_fingerprint_is_what_it_does_not_what_it_is_called():
    from lightkv.api import fingerprint
    from lightkv.config import PipelineConfig

    divprune = lightkv.load("divprune")
    assert (
        fingerprint(divprune)
        == fingerprint(lightkv.load("divprune"))
        == PreLLMPlan.load("divprune", 2).fingerprint
    )
    assert len(fingerprint(divprune)) == 16
    assert fingerprint(replace(divprune, name="mine", summary="", description="")) == fingerprint(
        divprune
    )
    assert fingerprint(divprune) != fingerprint(lightkv.load("downsample"))
    half = PreLLMPlan.load(WINDOWED, num_layers=2).pipeline
    quarter = PipelineConfig.from_dict(
        {**WINDOWED, "schedule": {"name": "pre_llm", "params": {"removal_ratio": 0.25}}}
    ).build()
    assert fingerprint(half) != fingerprint(quarter)
