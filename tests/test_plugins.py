"""Plugin loading is robust: each entry point on its own, failures named, names checked.

Each test installs small fake distributions (a module plus a ``*.dist-info`` with
``entry_points.txt``, what ``pip install`` leaves) on a fresh ``sys.path`` entry.
"""

from __future__ import annotations

import sys
import textwrap
import warnings

import pytest

from lightkv.config import ConfigError, PipelineConfig
from lightkv.policies import ENTRY_POINT_GROUP, EdgeScorer, PluginError, Policy

GOOD = """
from dataclasses import dataclass
import torch
from lightkv.policies import EdgeScorer

@EdgeScorer.register("plugin_good")
@dataclass
class Good(EdgeScorer):
    def divergence(self, src, dst):
        return torch.cdist(src.flatten(2), dst.flatten(2))
"""
BROKEN = """
import a_module_that_does_not_exist_anywhere
"""
UNDECORATED = """
from dataclasses import dataclass
import torch
from lightkv.policies import EdgeScorer

@dataclass
class Plain(EdgeScorer):
    def divergence(self, src, dst):
        return torch.cdist(src.flatten(2), dst.flatten(2))
"""
RENAMED = """
from dataclasses import dataclass
import torch
from lightkv.policies import EdgeScorer

@EdgeScorer.register("plugin_real_name")
@dataclass
class Renamed(EdgeScorer):
    def divergence(self, src, dst):
        return torch.cdist(src.flatten(2), dst.flatten(2))
"""
NOT_A_POLICY = """
class Helper:
    pass
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """``install(name, {entry point: source})`` makes a distribution with those entry points."""
    created: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(Policy, "_entry_points", {})

    def make(dist: str, entry_points: dict[str, tuple[str, str]]) -> None:
        lines = [f"[{ENTRY_POINT_GROUP}]"]
        for ep, (module, source) in entry_points.items():
            (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
            attr = {
                "plugin_broken": "Anything",
                "plugin_plain": "Plain",
                "plugin_alias": "Renamed",
                "plugin_helper": "Helper",
            }.get(ep, "Good")
            lines.append(f"{ep} = {module}:{attr}")
            created.append(module)
        info = tmp_path / f"{dist}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")

    yield make
    for name in ("plugin_good", "plugin_plain", "plugin_real_name"):
        EdgeScorer._registry.pop(name, None)
    for module in created:
        sys.modules.pop(module, None)


def test_a_broken_plugin_does_not_hide_a_healthy_one(install):
    install("broken_dist", {"plugin_broken": ("lkv_broken_mod", BROKEN)})
    install("good_dist", {"plugin_good": ("lkv_good_mod", GOOD)})
    with pytest.warns(
        UserWarning,
        match="plugin_broken = lkv_broken_mod:Anything failed to load: ModuleNotFoundError",
    ):
        assert EdgeScorer.registered()["plugin_good"].__name__ == "Good"
    assert EdgeScorer.lookup("plugin_good").__name__ == "Good"


def test_asking_for_a_broken_plugin_names_it_and_its_exception(install):
    install("broken_dist", {"plugin_broken": ("lkv_broken_mod", BROKEN)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            PluginError,
            match=r"scorer 'plugin_broken' comes from a plugin that failed to load: "
            r"plugin_broken = lkv_broken_mod:Anything \(ModuleNotFoundError: No module named "
            r"'a_module_that_does_not_exist_anywhere'\)",
        ):
            EdgeScorer.lookup("plugin_broken")


def test_an_unknown_name_lists_the_plugins_that_failed(install):
    install("broken_dist", {"plugin_broken": ("lkv_broken_mod", BROKEN)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            ValueError,
            match=r"unknown scorer 'nope'; registered scorers: .*cosine.*; "
            r"plugins that failed to load: plugin_broken = lkv_broken_mod:Anything",
        ):
            EdgeScorer.lookup("nope")
        with pytest.raises(ConfigError, match="plugins that failed to load: plugin_broken"):
            PipelineConfig.from_yaml_text("scorer: nope\n")


def test_only_the_asked_entry_point_is_loaded_when_it_has_the_name(install):
    install("dist_a", {"plugin_good": ("lkv_good_mod", GOOD)})
    install("dist_b", {"plugin_broken": ("lkv_broken_mod", BROKEN)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken plugin must not even be tried
        assert EdgeScorer.lookup("plugin_good").__name__ == "Good"
    assert "lkv_broken_mod" not in sys.modules


def test_an_undecorated_class_is_registered_under_its_entry_point_name_with_a_warning(install):
    install("plain_dist", {"plugin_plain": ("lkv_plain_mod", UNDECORATED)})
    with pytest.warns(
        UserWarning,
        match=r"Plain is not decorated with @EdgeScorer.register\(\.\.\.\); registered it as "
        r"scorer 'plugin_plain'",
    ):
        cls = EdgeScorer.lookup("plugin_plain")
    assert cls.__name__ == "Plain" and cls.name == "plugin_plain"


def test_an_entry_point_named_unlike_its_policy_warns(install):
    install("alias_dist", {"plugin_alias": ("lkv_alias_mod", RENAMED)})
    with pytest.warns(
        UserWarning, match="registers Renamed as scorer 'plugin_real_name', not 'plugin_alias'"
    ):
        with pytest.raises(ValueError, match="unknown scorer 'plugin_alias'"):
            EdgeScorer.lookup("plugin_alias")
    assert EdgeScorer.lookup("plugin_real_name").__name__ == "Renamed"


def test_an_entry_point_that_is_not_a_policy_is_reported(install):
    install("helper_dist", {"plugin_helper": ("lkv_helper_mod", NOT_A_POLICY)})
    with pytest.warns(UserWarning, match="Helper is not a lightkv policy"):
        with pytest.raises(PluginError, match="plugin_helper"):
            EdgeScorer.lookup("plugin_helper")


def test_each_entry_point_is_tried_once(install):
    install("broken_dist", {"plugin_broken": ("lkv_broken_mod", BROKEN)})
    with pytest.warns(UserWarning):
        EdgeScorer.registered()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        EdgeScorer.registered()


def test_the_cli_prints_a_broken_plugin_as_one_line_once(install, capsys):
    """Regression (issue 27, item 12): broken plugins printed raw two-line UserWarnings (file,
    line, source) on every command."""
    from lightkv.cli import main

    install("broken_dist", {"plugin_broken": ("broken_mod", BROKEN)})
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # `config schema` lists every registered policy, so it loads the entry points whatever
        # an earlier test in this process cached; the second command must not repeat the line
        code = main(["config", "schema"])
        code2 = main(["config", "validate", "lightkv", "--num-layers", "32"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "plugin_broken" in line]
    assert code == 0 and code2 == 0
    assert len(lines) == 1 and lines[0].startswith(
        "lightkv: warning: lightkv plugin plugin_broken = broken_mod"
    )
    assert "UserWarning" not in err


def test_loading_the_presets_imports_no_plugin(install, tmp_path):
    """``import lightkv.presets`` (and loading a preset) looks lightkv's own names up without
    loading the entry-point group: an installed plugin is imported when its name is asked
    for, not before (issue 48 item 5). In a fresh interpreter, as a user's would be."""
    import os
    import subprocess
    from pathlib import Path

    install("good_dist", {"plugin_good": ("lkv_good_mod", GOOD)})
    code = textwrap.dedent(
        """
        import sys
        import lightkv.presets, lightkv
        lightkv.load("lightkv"), lightkv.load("fastv"), lightkv.load("h2o")
        before = "lkv_good_mod" in sys.modules
        from lightkv.config import PipelineConfig
        PipelineConfig.from_yaml_text("scorer: plugin_good")
        print(before, "lkv_good_mod" in sys.modules)
        """
    )
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(tmp_path), str(root), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
