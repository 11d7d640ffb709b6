"""Third-party policies: the register decorator and the ``lightkv.policies`` entry points.

A research package adds ``my_divergence`` without touching lightkv, and a YAML pipeline
names it. The package here is real as far as Python packaging goes: a module plus a
``*.dist-info`` directory with ``entry_points.txt``, on ``sys.path``, which is exactly what
``pip install`` leaves behind; `importlib.metadata` finds it like any installed package.
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

from lightkv import ImageSegment, VisionLayout
from lightkv.config import ConfigError, PipelineConfig, config_from_pipeline, json_schema
from lightkv.policies import ENTRY_POINT_GROUP, EdgeScorer, Partitioner, Policy

PACKAGE = "lightkv_test_research_pkg"

MODULE = '''
"""A research package that adds an edge scorer to lightkv."""
from dataclasses import dataclass

import torch

from lightkv.policies import EdgeScorer


@EdgeScorer.register("my_divergence")
@dataclass
class MyDivergence(EdgeScorer):
    """Squared L2 distance scaled by a temperature."""

    temperature: float = 1.0

    def divergence(self, src, dst):
        return torch.cdist(src, dst).pow(2) / self.temperature
'''

YAML = """\
name: research
schedule:
  layers: [1, 2]
  removal_ratios: [0.5]
  windows_per_side: [2, 1]
partitioner: grid
scorer:
  name: my_divergence
  params: {temperature: 2.0}
pruner: divergence
passer: relevance_mean
relevance: uniform
"""


@pytest.fixture
def research_package(tmp_path, monkeypatch):
    """Install the research package into a fresh sys.path entry; remove every trace after."""
    (tmp_path / f"{PACKAGE}.py").write_text(textwrap.dedent(MODULE))
    info = tmp_path / f"{PACKAGE}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nmy_divergence = {PACKAGE}:MyDivergence\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(Policy, "_entry_points", {})  # each entry point is tried once per process
    assert "my_divergence" not in EdgeScorer._registry
    yield tmp_path
    EdgeScorer._registry.pop("my_divergence", None)
    sys.modules.pop(PACKAGE, None)


def run_tiny(pipeline):
    layout = VisionLayout.from_segments(1, 2 + 16, [ImageSegment(row=0, offset=1, grid=(4, 4))])
    hidden = torch.randn(1, 18, 8, generator=torch.Generator().manual_seed(0))
    return pipeline.run(hidden, layout, num_layers=4)


def test_entry_point_policy_is_found_by_name_from_yaml(research_package):
    assert PACKAGE not in sys.modules  # nothing imported the package yet
    cfg = PipelineConfig.from_yaml_text(YAML)  # the unknown name triggers loading entry points
    assert PACKAGE in sys.modules
    pipe = cfg.build()
    assert type(pipe.scorer).__name__ == "MyDivergence" and pipe.scorer.temperature == 2.0
    results = run_tiny(pipe)
    assert [int(r.layout.vision_counts()[0]) for r in results] == [8, 4]
    assert cfg.to_yaml() == YAML
    assert config_from_pipeline(pipe) == cfg
    assert "my_divergence" in EdgeScorer.registered()


def test_entry_point_policy_appears_in_the_json_schema(research_package):
    EdgeScorer.lookup("my_divergence")
    scorer = json_schema()["$defs"]["EdgeScorerSpec"]
    assert "my_divergence" in scorer["anyOf"][0]["enum"]
    variant = next(v for v in scorer["anyOf"][1]["oneOf"] if v["title"] == "my_divergence")
    assert variant["properties"]["params"]["properties"]["temperature"]["type"] == "number"


def test_entry_point_parameters_are_validated(research_package):
    bad = YAML.replace("temperature: 2.0", "temp: 2.0")
    with pytest.raises(ConfigError) as info:
        PipelineConfig.from_yaml_text(bad, source="research.yaml")
    assert str(info.value) == (
        "research.yaml: scorer.params.temp: scorer 'my_divergence' has no parameter 'temp'; "
        "its parameters are: temperature"
    )


def test_without_the_package_the_name_is_unknown(monkeypatch):
    monkeypatch.setattr(Policy, "_entry_points", {})
    with pytest.raises(
        ConfigError, match=r"unknown scorer 'my_divergence'; registered scorers: cosine, l2"
    ):
        PipelineConfig.from_yaml_text(YAML)


def test_decorator_registration_is_enough_for_yaml():
    @Partitioner.register("test_columns")
    @dataclass
    class Columns(Partitioner):
        """One window per image column; even rows are sources."""

        def partition(self, inputs):
            from lightkv.policies import Partition

            layout = inputs.layout
            inside = layout.vision_mask
            col = layout.coords[..., 1]
            window = torch.where(
                inside, layout.image.clamp_min(0) * 10_000 + col, torch.full_like(col, -1)
            )
            _, compact = torch.unique(window[inside], return_inverse=True)
            window = window.clone()
            window[inside] = compact
            return Partition(window, inside & (layout.coords[..., 0] % 2 == 0))

    try:
        cfg = PipelineConfig.from_yaml_text(
            YAML.replace("partitioner: grid", "partitioner: test_columns").replace(
                "scorer:\n  name: my_divergence\n  params: {temperature: 2.0}", "scorer: cosine"
            )
        )
        pipe = cfg.build()
        assert isinstance(pipe.partitioner, Columns)
        results = run_tiny(pipe)
        assert int(results[0].layout.vision_counts()[0]) == 8  # half of each 4-token column
        with pytest.raises(ValueError, match="already registered"):

            @Partitioner.register("test_columns")
            @dataclass
            class Other(Partitioner):
                pass
    finally:
        Partitioner._registry.pop("test_columns", None)
