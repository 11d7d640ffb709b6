"""Session modes (`lightkv.adapters.modes`): chosen from the schedule, driven through one
protocol, with no mode branches in the session's hooks and no session state in adapters."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch
from lightkv_lab.tiny import TINY_MODELS

import lightkv
from lightkv.adapters import apply
from lightkv.adapters import session as session_module
from lightkv.adapters.modes import Mode
from lightkv.policies import StageSpec
from lightkv.policies.schedulers import ExplicitSchedule


@pytest.fixture(scope="module")
def llava():
    fam = TINY_MODELS["llava"]
    model = fam.build()
    return model, fam.collate(fam.examples(model)[:2])


@pytest.mark.parametrize(
    "preset, modes",
    [
        ("lightkv-budget", ["sequence", "layer"]),
        ("lightkv-pre-llm", ["pre_llm", "sequence"]),
        ("elasticcache", ["sequence", "cache"]),
        ("h2o", ["sequence", "h2o"]),
        ("visionzip", ["pre_llm", "sequence", "tower"]),
    ],
)
def test_the_schedule_chooses_the_modes(llava, preset, modes):
    model, _ = llava
    with apply(lightkv.load(preset), model) as session:
        assert [m.name for m in session.modes] == modes


def test_stage_spec_mode_is_its_one_spelling():
    w = dict(windows_per_side=2)
    assert (
        StageSpec(3, 0.5, **w).mode == "layer"
        and StageSpec(3, 0.5, mode="custom", **w).mode == "custom"
    )
    with pytest.raises(TypeError, match="'before' was renamed"):
        StageSpec(0, 0.5, before=True, mode="cache", **w)
    with pytest.raises(ValueError, match="only at layer 0"):
        StageSpec(2, 0.5, mode="pre_llm", **w)


def test_a_mode_no_class_registers_fails_when_the_session_starts(llava):
    class Nowhere(ExplicitSchedule):
        def plan(self, num_layers):
            return [StageSpec(1, 0.5, windows_per_side=2, mode="nowhere")]

    model, _ = llava
    pipe = lightkv.load("lightkv-budget").with_scheduler(
        Nowhere(layers=(1,), removal_ratios=(0.5,), windows_per_side=(2,))
    )
    with pytest.raises(ValueError, match="unknown mode 'nowhere'; registered modes: "):
        apply(pipe, model)


def test_a_registered_mode_sees_every_layer_it_covers_in_order(llava):
    seen = []

    class Watch(Mode):
        layers = frozenset({1, 2})

        def prefill_pre(self, call):
            seen.append(("pre", call.layer, call.hidden.shape[1]))

        def prefill_post(self, call):
            seen.append(("post", call.layer, call.output_hidden.shape[1]))

        def decode_pre(self, call):
            seen.append(("decode", call.layer, call.hidden.shape[1]))

    saved = dict(Mode._registry)
    try:
        Mode.register("watch")(Watch)
        model, batch = llava
        pipe = lightkv.Pipeline(scheduler=None, mode=Watch())
        with apply(pipe, model) as session, torch.no_grad():
            model.generate(**batch, max_new_tokens=2, do_sample=False)
        n = batch["input_ids"].shape[1]
        assert [m.name for m in session.modes] == ["sequence", "watch"]
        assert seen == [
            ("pre", 1, n),
            ("post", 1, n),
            ("pre", 2, n),
            ("post", 2, n),
            ("decode", 1, 1),
            ("decode", 2, 1),
        ]
    finally:
        Mode._registry.clear()
        Mode._registry.update(saved)


@pytest.mark.parametrize("hook", ["_on_layer_pre", "_on_layer_post"])
def test_the_session_layer_hooks_hold_no_mode_branches(hook):
    """The hooks hand each call to the modes; the only test is whether this session owns the
    forward."""
    tree = ast.parse(
        textwrap.dedent(inspect.getsource(getattr(session_module.CompressionSession, hook)))
    )
    branches = [n for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp, ast.Match))]
    assert len(branches) == 1 and ast.unparse(branches[0].test) == "st is None"


def test_adapters_hold_no_session_state():
    fam = TINY_MODELS["llava_next"]
    model = fam.build()
    batch = fam.collate(fam.examples(model)[:1])
    pipe = dataclasses.replace(
        lightkv.load("lightkv-budget"), layout="reference"
    )  # once written into the adapter
    session = apply(pipe, model)
    before = dict(vars(session.adapter))
    with session, torch.no_grad():
        model(**batch)
    assert vars(session.adapter) == before and not hasattr(session.adapter, "layout_mode")
    assert session.last_prefill.layout.num_images == 1  # the reference layout reached the session


def test_a_mode_scores_with_any_registered_relevance_through_its_context():
    """`SessionContext.relevance` (issue 48 item 5): a mode reuses a registered relevance
    policy, no `Stage` built. FastV's ``last_token`` at layer 1 equals the last token's eager
    attention weights averaged over heads (the model's own softmax, an independent oracle),
    and the same from the layer's own projections (``raw``, a tap) and from its input."""
    from lightkv.adapters.tap import ProjectionTap
    from lightkv.policies import Relevance

    fam = TINY_MODELS["llava"]
    model = fam.build(attn_implementation="eager")
    batch = fam.collate(fam.examples(model)[:2])
    policy = Relevance.create("last_token")
    got = {}

    class Score(Mode):
        layers = frozenset({1})

        def install(self):
            self.tap = ProjectionTap(self.ctx.probes[1], 1)
            return self.tap.install()

        def prefill_pre(self, call):
            got["input"] = self.ctx.relevance(policy, call)
            self.tap.arm_with(
                lambda raw: self.ctx.relevance(policy, call, raw), call.hidden.shape[1]
            )

        def prefill_post(self, call):
            got["raw"] = self.tap.take()

    saved = dict(Mode._registry)
    try:
        Mode.register("score_probe")(Score)
        with apply(lightkv.Pipeline(scheduler=None, mode=Score()), model), torch.no_grad():
            attn = model(**batch, output_attentions=True).attentions[1]  # [B, H, N, N]
    finally:
        Mode._registry.clear()
        Mode._registry.update(saved)
    want = attn[:, :, -1, :].mean(1)  # every row ends with its last token (left padding)
    valid = batch["input_ids"] == model.config.image_token_id  # ξ is zero off the images
    (xi, flops), (xi_raw, flops_raw) = got["input"], got["raw"]
    assert xi.shape == want.shape and 0 < flops_raw < flops  # the tap projects nothing again
    torch.testing.assert_close(xi[valid], want[valid], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(xi_raw[valid], want[valid], rtol=1e-4, atol=1e-6)
    assert not xi[~valid].any()
    # a session that records no tower attention refuses a relevance that reads it
    from lightkv.adapters.modes.base import SessionContext

    no_tower = type("Context", (), {"modes": {}})()
    with pytest.raises(ValueError, match="reads the vision tower's attention, which this"):
        SessionContext.relevance(no_tower, Relevance.create("tower_attention"), None)
