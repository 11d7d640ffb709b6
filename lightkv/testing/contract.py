"""`check_policy`: the contract every policy must keep, as a reusable test.

A plugin author gets the tests lightkv runs on its own policies for free:

```python
from lightkv.testing import check_policy
from my_package import MyDivergence

def test_my_divergence_keeps_the_contract():
    check_policy(MyDivergence)                      # default parameters
    check_policy(MyDivergence, temperature=0.5)     # and others
```

What is checked, on a batch of three rows (two images of different grids, left padding,
a text-only row), in float32 and bfloat16:

* **shapes and dtypes** of what the family's method returns;
* **batch-row independence**: a stage built with the policy gives every row the same
  result in the batch as alone (no information leaks between rows, padding is inert);
* **identity at ratio 0**: nothing leaves, the hidden states come back bit-exact;
* family rules: a partitioner keeps text, padding and structural tokens out of the graph
  and numbers windows ``0 .. K-1``, each inside one row; a pruner never removes padding
  slots or more than its budget; a passer changes only receivers; a scheduler returns
  sorted stages inside the model and says ``ValueError`` when it cannot fit, and its knob
  (`Scheduler.at_kept_fraction`) keeps its target or says ``ValueError``; relevance is
  ``[B, N]``, finite and non-negative, and reads only the query rows and key columns it
  declares (``query_rows``, ``key_cols``, ``packed_text_keys``: ξ from what an adapter
  projects equals ξ from every row and column; `lightkv.testing.contract_relevance`); a
  mode's settings fit a depth or say ``ValueError``,
  and its promised kept fraction is in ``(0, 1]``;
* the parameters round-trip (``cls(**policy.params()) == policy``) and a registered
  policy is found under its name.

Every failure is an ``AssertionError`` that names the policy and the broken rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..graph.bipartite import BipartiteGraph
from ..graph.layout import ImageSegment, TokenKind, VisionLayout
from ..policies import (
    EdgeScorer,
    MessagePasser,
    Mode,
    Partitioner,
    Policy,
    Prompt,
    PruneInputs,
    Pruner,
    Relevance,
    Scheduler,
    StageInputs,
    StageSpec,
    average_kept_fraction,
)
from ..policies.hashing import token_identity
from ..policies.schedulers import REACH_TOLERANCE
from ..stage import Stage
from .contract_relevance import check_relevance

__all__ = ["check_policy", "contract_batch"]

DIM = 16
HEADS, HEAD_DIM = 2, 4


def contract_batch(
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tower_layers: tuple[int, ...] = (),
    prompt: bool = False,
) -> StageInputs:
    """The batch the contract runs on: 3 rows, images of 6x6 and 4x5 tokens (row 0), one
    5x5 image after left padding (row 1), text only (row 2); random hidden states, keys
    and relevance (zero outside vision tokens), tower attention at ``tower_layers``, and
    with ``prompt`` distinct token ids (for policies that read the prompt)."""
    n = 3 + 36 + 2 + 20 + 3
    segments = [
        ImageSegment(row=0, offset=3, grid=(6, 6)),
        ImageSegment(row=0, offset=41, grid=(4, 5)),
        ImageSegment(row=1, offset=20, grid=(5, 5)),
    ]
    padding = torch.zeros(3, n, dtype=torch.bool)
    padding[1, :12] = True
    padding[2, :5] = True
    layout = VisionLayout.from_segments(3, n, segments, padding_mask=padding)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, n, DIM, generator=gen).to(dtype)
    key_states = torch.randn(3, n, HEADS, HEAD_DIM, generator=gen).to(dtype)
    relevance = torch.rand(3, n, generator=gen).masked_fill(~layout.vision_mask, 0.0)
    spec = StageSpec(0, 0.5, windows_per_side=2)
    tower = {i: torch.rand(3, HEADS, n, generator=gen) for i in tower_layers} or None
    ids = Prompt(torch.arange(n).expand(3, n).clone()) if prompt else None
    return StageInputs(
        layout,
        spec,
        hidden=hidden,
        relevance=relevance,
        key_states=key_states,
        tower=tower,
        prompt=ids,
    )


def _row(inputs: StageInputs, b: int) -> StageInputs:
    """Row ``b`` of a batch as a batch of one (its images renumbered)."""
    hidden, relevance, key_states = inputs.hidden, inputs.relevance, inputs.key_states
    assert hidden is not None and relevance is not None and key_states is not None  # all given
    return StageInputs(
        inputs.layout.row(b),
        inputs.spec,
        hidden=hidden[b : b + 1],
        relevance=relevance[b : b + 1],
        key_states=key_states[b : b + 1],
        tower={i: t[b : b + 1] for i, t in inputs.tower.items()} if inputs.tower else None,
        prompt=Prompt(inputs.prompt.token_ids[b : b + 1]) if inputs.prompt is not None else None,
    )


def _family(cls: type) -> type[Policy]:
    for base in (Partitioner, EdgeScorer, Pruner, MessagePasser, Relevance, Scheduler, Mode):
        if issubclass(cls, base):
            return base
    raise TypeError(
        f"{cls!r} is not a lightkv policy: subclass a family (Partitioner, EdgeScorer, ...)"
    )


def _stage(policy: Policy, spec: StageSpec) -> Stage:
    """A stage with lightkv's defaults and ``policy`` in its family's place; a pruner that
    drops gets no scorer-free problem, a scorer-free pruner gets the drop passer."""
    from ..policies import DropMessages

    fields: dict[str, Any] = {}
    if isinstance(policy, Partitioner):
        fields["partitioner"] = policy
    elif isinstance(policy, EdgeScorer):
        fields["scorer"] = policy
    elif isinstance(policy, Pruner):
        fields["pruner"] = policy
        if not policy.needs_partner:
            fields["passer"] = DropMessages()
    elif isinstance(policy, MessagePasser):
        fields["passer"] = policy
    return Stage(spec=spec, **fields)


def _fail(policy: Any, rule: str) -> AssertionError:
    return AssertionError(f"{type(policy).__name__}{_params(policy)}: {rule}")


def _params(policy: Any) -> str:
    p = policy.params() if isinstance(policy, Policy) else {}
    return "(" + ", ".join(f"{k}={v!r}" for k, v in p.items()) + ")"


def _check_params(policy: Policy, cls: type) -> None:
    if dataclasses.is_dataclass(policy):
        again = cls(**policy.params())
        if again != policy:
            raise _fail(policy, f"cls(**params()) gives {again!r}, not an equal policy")
    name = cls.__dict__.get("name", "")  # the class's own registration, not a parent's
    if name:
        family = _family(cls)
        if family._registry.get(name) is not cls:
            raise _fail(policy, f"registered name {name!r} does not look up this class")


def _check_stage(policy: Policy, dtype: torch.dtype) -> None:
    """Batch-row independence and identity at ratio 0 through a whole stage."""
    inputs = contract_batch(
        dtype, tower_layers=policy.tower_layers, prompt=getattr(policy, "reads_prompt", False)
    )
    stage = _stage(policy, inputs.spec)
    batch = stage.run(inputs)
    if batch.hidden.dtype != dtype:
        raise _fail(policy, f"a stage on {dtype} hidden states returned {batch.hidden.dtype}")
    if not torch.isfinite(batch.hidden.float()).all():
        raise _fail(policy, f"a stage on finite {dtype} inputs returned non-finite hidden states")
    if batch.layout.vision_counts().sum() > inputs.layout.vision_counts().sum():
        raise _fail(policy, "a stage added vision tokens")
    if not torch.equal(batch.layout.text_mask.sum(1), inputs.layout.text_mask.sum(1)):
        raise _fail(policy, "a stage changed the number of text tokens")
    # allclose's rtol and atol (its keywords are typed apart: float, float, bool)
    tol: dict[str, Any] = (
        dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    )
    for b in range(inputs.batch_size):
        alone = stage.run(_row(inputs, b))
        width = alone.hidden.shape[1]
        in_batch = batch.hidden[b, batch.hidden.shape[1] - width :]  # rows are right-aligned
        if batch.layout.valid_mask[b].sum() != alone.layout.valid_mask[0].sum():
            raise _fail(
                policy,
                f"row {b} keeps {int(batch.layout.valid_mask[b].sum())} tokens in the batch "
                f"but {int(alone.layout.valid_mask[0].sum())} alone: rows are not independent",
            )
        kept_batch = batch.layout.origin[b][batch.layout.valid_mask[b]]
        kept_alone = alone.layout.origin[0][alone.layout.valid_mask[0]]
        if not torch.equal(kept_batch, kept_alone):
            raise _fail(
                policy,
                f"row {b} keeps other tokens in the batch than alone: rows are not independent",
            )
        valid = alone.layout.valid_mask[0]
        if not torch.allclose(in_batch[valid].float(), alone.hidden[0][valid].float(), **tol):
            raise _fail(policy, f"row {b}'s hidden states differ in the batch and alone")
    still = Stage(
        spec=dataclasses.replace(inputs.spec, removal_ratio=0.0),
        **{k: getattr(stage, k) for k in ("partitioner", "scorer", "pruner", "passer")},
    ).run(inputs)
    assert inputs.hidden is not None  # contract_batch gives it
    if not torch.equal(still.hidden, inputs.hidden) or still.layout != inputs.layout:
        raise _fail(policy, "a stage at ratio 0 is not the identity")


def _check_partitioner(policy: Partitioner) -> None:
    inputs = contract_batch(
        tower_layers=policy.tower_layers, prompt=getattr(policy, "reads_prompt", False)
    )
    part = policy.partition(inputs)
    shape = (inputs.batch_size, inputs.seq_len)
    if tuple(part.window.shape) != shape or part.window.dtype != torch.long:
        raise _fail(
            policy,
            f"partition().window must be int64 {shape}, got {part.window.dtype} "
            f"{tuple(part.window.shape)}",
        )
    if tuple(part.is_src.shape) != shape or part.is_src.dtype != torch.bool:
        raise _fail(policy, f"partition().is_src must be bool {shape}")
    inside = part.window >= 0
    if (inside & (inputs.layout.kind != TokenKind.VISION)).any():
        raise _fail(policy, "text, padding or structural tokens were put into a window")
    ids = part.window[inside]
    if ids.numel() and not torch.equal(torch.unique(ids), torch.arange(int(ids.max()) + 1)):
        raise _fail(policy, "window ids are not compact (0 .. K-1)")
    rows = torch.arange(inputs.batch_size).unsqueeze(1).expand(shape)[inside]
    for w in torch.unique(ids).tolist():
        if torch.unique(rows[ids == w]).numel() != 1:
            raise _fail(policy, f"window {w} spans several batch rows")


def _check_scorer(policy: EdgeScorer) -> None:
    inputs = contract_batch()
    part = Partitioner.lookup("grid")().partition(inputs)
    graph = BipartiteGraph.build(part.window, part.is_src)
    dst, div = policy.match(inputs, graph)
    if tuple(dst.shape) != tuple(graph.src_slots.shape) or tuple(div.shape) != tuple(
        graph.src_slots.shape
    ):
        raise _fail(
            policy, f"match() must return two [K, a_max] = {tuple(graph.src_slots.shape)} tensors"
        )
    if not div.is_floating_point():
        raise _fail(policy, f"divergences must be floating point, got {div.dtype}")
    ok = dst >= 0
    if (ok & (graph.src_slots < 0)).any():
        raise _fail(policy, "a padding slot got a partner")
    if ok.any():
        if graph.node_is_src[dst[ok]].any():
            raise _fail(policy, "a partner is on side A")
        src_window = graph.node_window[graph.src_slots.clamp_min(0)][ok]
        if not torch.equal(graph.node_window[dst[ok]], src_window):
            raise _fail(policy, "a partner is in another window")
        if torch.isnan(div[ok]).any():
            raise _fail(policy, "a divergence of a real edge is NaN")


def _check_pruner(policy: Pruner) -> None:
    inputs = contract_batch()
    part = Partitioner.lookup("grid")().partition(inputs)
    graph = BipartiteGraph.build(part.window, part.is_src)
    dst, div = EdgeScorer.lookup("cosine")().match(inputs, graph)
    pad = graph.src_slots < 0
    assert inputs.relevance is not None  # contract_batch gives it
    xi = graph.token_blocks(inputs.relevance.float(), "src")
    ident = graph.token_blocks(token_identity(inputs.layout), "src").masked_fill(pad, -1)
    prune = PruneInputs(graph, div, xi, ident, inputs)
    for ratio in (0.0, 0.3, 0.5, 0.9):
        removed = policy.select(prune, ratio)
        if tuple(removed.shape) != tuple(graph.src_slots.shape) or removed.dtype != torch.bool:
            raise _fail(
                policy,
                f"select() must return a bool [K, a_max] mask, got {removed.dtype} "
                f"{tuple(removed.shape)}",
            )
        if (removed & pad).any():
            raise _fail(policy, f"select(ratio={ratio}) removed a padding slot")
        if ratio == 0.0 and removed.any():
            raise _fail(policy, "select(ratio=0) removed tokens")
        if (removed.sum(1) > policy.budget(graph, ratio)).any():
            raise _fail(policy, f"select(ratio={ratio}) removed more than budget() allows")


def _check_passer(policy: MessagePasser) -> None:
    gen = torch.Generator().manual_seed(1)
    m = 12
    x = torch.randn(m, DIM, generator=gen, dtype=torch.float64)
    xi, size = torch.rand(m, generator=gen, dtype=torch.float64), torch.ones(m, dtype=torch.long)
    empty = torch.zeros(0, dtype=torch.long)
    receivers, new = policy(x, xi, size, empty, empty)
    if receivers.numel() or new.shape[0]:
        raise _fail(policy, "with nothing removed some node changed")
    src, dst = torch.tensor([0, 1, 2, 5]), torch.tensor([3, 3, 4, 6])
    receivers, new = policy(x, xi, size, src, dst)
    if not policy.merges:
        return
    if tuple(new.shape) != (receivers.shape[0], DIM) or new.dtype != x.dtype:
        raise _fail(
            policy,
            f"features must be [Q, D] in the input dtype, got {new.dtype} {tuple(new.shape)}",
        )
    if not set(receivers.tolist()) <= set(dst.tolist()):
        raise _fail(policy, "a node that received nothing changed")
    if not torch.isfinite(new).all():
        raise _fail(policy, "merged features are not finite")


def _check_relevance(policy: Relevance) -> None:
    check_relevance(policy, contract_batch(), HEADS, HEAD_DIM, _fail)


def _check_scheduler(policy: Scheduler) -> None:
    for depth in (8, 24, 32, 40):
        try:
            stages = policy.plan(depth)
        except ValueError:
            continue  # a schedule may not fit a depth; it must say so with a ValueError
        if not all(isinstance(s, StageSpec) for s in stages):
            raise _fail(policy, f"plan({depth}) must return StageSpec objects")
        layers = [s.layer for s in stages]
        if layers != sorted(set(layers)) or (layers and not 0 <= layers[0] <= layers[-1] < depth):
            raise _fail(
                policy, f"plan({depth}) gave layers {layers}: not increasing inside 0..{depth - 1}"
            )
        if policy.plan(depth) != stages:
            raise _fail(policy, f"plan({depth}) is not deterministic")
    for depth, target in ((8, 0.5), (32, 0.25)):  # the kept-fraction knob keeps its promise
        try:
            kept = average_kept_fraction(policy.at_kept_fraction(target, depth).plan(depth), depth)
        except ValueError:
            continue  # no knob, or out of reach: a one-line ValueError
        if abs(kept - target) > REACH_TOLERANCE + 1e-9:  # beyond what a session warns about
            raise _fail(policy, f"at_kept_fraction({target}, {depth}) keeps {kept:.3f}")
    try:
        policy.plan(0)
    except ValueError:
        pass
    except Exception as exc:  # anything else is a stack trace for the user
        raise _fail(policy, f"plan(0) raised {type(exc).__name__}, not ValueError: {exc}") from exc
    else:
        raise _fail(policy, "plan(0) did not raise ValueError")


def _check_mode(policy: Mode) -> None:
    for depth in (8, 24, 32, 40):
        try:
            policy.check_depth(depth)
        except ValueError:
            continue  # settings may not fit a depth; they must say so with a ValueError
        target = policy.target_kept_fraction(depth)
        if target is not None and not 0.0 < target <= 1.0:
            raise _fail(policy, f"target_kept_fraction({depth}) = {target!r}, not in (0, 1]")


_FAMILY_CHECKS: dict[type[Policy], Callable[[Any], None]] = {
    Partitioner: _check_partitioner,
    EdgeScorer: _check_scorer,
    Pruner: _check_pruner,
    MessagePasser: _check_passer,
    Relevance: _check_relevance,
    Scheduler: _check_scheduler,
    Mode: _check_mode,
}


def check_policy(cls: type, **params: Any) -> Policy:
    """Check that ``cls(**params)`` keeps lightkv's policy contract (see the module docstring).

    Returns:
        the policy instance checked.

    Raises:
        AssertionError: a broken rule, naming the policy and the rule.
        TypeError: ``cls`` is not a policy class.
    """
    family = _family(cls)
    policy = cls(**params)
    _check_params(policy, cls)
    _FAMILY_CHECKS[family](policy)
    if family in (Partitioner, EdgeScorer, Pruner, MessagePasser):
        for dtype in (torch.float32, torch.bfloat16):
            _check_stage(policy, dtype)
    return policy
