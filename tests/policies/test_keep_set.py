"""The subset pruners' shared rules: the exact budget, ratio 0, the contract, row independence,
the exact kept count per image."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightkv.policies import Pruner, StageInputs, exact_removals
from lightkv.testing import check_policy
from tests.policies.keep_set_cases import assert_rows_independent, kept_positions, prune_inputs
from tests.strategies import batches

NAMES = ["divprune", "cdpruner", "dart", "scope", "mmtok", "holov"]


def test_ratio_one_minus_k_over_n_keeps_exactly_k_for_every_k_and_n_up_to_600():
    n = torch.arange(1, 601, dtype=torch.float64).unsqueeze(1).expand(600, 601)
    k = torch.arange(0, 601, dtype=torch.float64).unsqueeze(0).expand(600, 601)
    ok = k <= n
    ratio = 1.0 - k / n  # IEEE double, the same expression as Python's 1 - k / n

    class Sizes:  # exact_removals reads the window sizes and the A counts only
        window_size = n[ok].long()
        src_count = n[ok].long()

    r = exact_removals(Sizes, ratio[ok])
    assert torch.equal(n[ok].long() - r, k[ok].long())
    # ... and with the Python float of a preset (keep 128 or 64 of 576).
    for keep in (64, 128, 192):
        Sizes.window_size = Sizes.src_count = torch.tensor([576])
        assert int(exact_removals(Sizes, 1 - keep / 576)) == 576 - keep
    # the plain floor would keep one more for some of them:
    bad = torch.floor(n[ok] * ratio[ok]).long() != n[ok].long() - k[ok].long()
    assert bad.any()


@pytest.mark.parametrize("name", NAMES)
def test_keeps_the_contract(name):
    check_policy(Pruner.lookup(name))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, deadline=None)
@given(case=batches(max_side=6), ratio=st.sampled_from([0.0, 0.3, 0.7777777777777778, 0.99]))
def test_each_image_keeps_exactly_its_budget_and_rows_are_independent(name, case, ratio):
    keys = case.hidden.view(*case.hidden.shape[:2], 2, 3)
    inputs = StageInputs.of(
        case.layout, case.hidden, windows_per_side=1, removal_ratio=ratio, key_states=keys
    )
    pruner = Pruner.lookup(name)()
    prune = prune_inputs(inputs)
    removed = pruner.select(prune, ratio)
    graph = prune.graph
    assert not (removed & (graph.src_slots < 0)).any()
    n = graph.window_size
    expected_kept = n - torch.floor(n.double() * ratio + 1e-9).long()
    assert torch.equal((~removed & (graph.src_slots >= 0)).sum(1), expected_kept)
    if ratio == 0.0:
        assert not removed.any()
    assert_rows_independent(pruner, inputs, ratio)


@pytest.mark.parametrize("name", NAMES)
def test_selection_needs_the_stage(name):
    case_inputs = StageInputs.of(*_tiny(), windows_per_side=1)
    prune = prune_inputs(case_inputs)
    from dataclasses import replace

    with pytest.raises(ValueError, match="PruneInputs.stage"):
        Pruner.lookup(name)().select(replace(prune, stage=None), 0.5)
    assert kept_positions(prune, torch.zeros_like(prune.graph.src_slots, dtype=torch.bool)) == [
        [1, 2, 3, 4]
    ]


def _tiny():
    from lightkv import ImageSegment, VisionLayout

    layout = VisionLayout.from_segments(1, 7, [ImageSegment(row=0, offset=1, grid=(2, 2))])
    return layout, torch.randn(1, 7, 4, generator=torch.Generator().manual_seed(0))
