"""Every built-in policy keeps the contract that `lightkv.testing.check_policy` checks, and
the check catches policies that break it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from lightkv.policies import (
    FAMILIES,
    EdgeScorer,
    MessagePasser,
    Partitioner,
    Pruner,
    Relevance,
    SmallestDivergence,
)
from lightkv.testing import check_policy

BUILT_IN = [(family, name) for family, base in FAMILIES.items() for name in sorted(base._registry)]
# Policies whose defaults do not fit the contract batch get parameters that do.
PARAMS = {("scheduler", "explicit"): {"layers": (2, 4, 5)}}


# Known breaks, each a bug to fix (strict: the test fails once the policy keeps the contract).
KNOWN_BREAKS: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize(
    "family,name",
    [
        pytest.param(f, n, marks=pytest.mark.xfail(reason=KNOWN_BREAKS[(f, n)], strict=True))
        if (f, n) in KNOWN_BREAKS
        else (f, n)
        for f, n in BUILT_IN
    ],
    ids=[f"{f}:{n}" for f, n in BUILT_IN],
)
def test_built_in_policy_keeps_the_contract(family, name):
    cls = FAMILIES[family]._registry[name]
    check_policy(cls, **PARAMS.get((family, name), {}))


def test_every_family_has_a_contract_check():
    assert {"partitioner", "scorer", "pruner", "passer", "relevance", "scheduler"} == set(FAMILIES)
    assert len(BUILT_IN) >= 20


@dataclass
class LeakyScorer(EdgeScorer):
    """Divergence times noise drawn from the number of windows in the batch: a row's
    partners depend on the other rows."""

    def divergence(self, src, dst):
        d = torch.cdist(src.flatten(2), dst.flatten(2))
        noise = torch.rand(
            d.shape, generator=torch.Generator().manual_seed(d.shape[0]), dtype=d.dtype
        )
        return d * noise


@dataclass
class GreedyPruner(SmallestDivergence):
    """Removes every A token, ignoring the budget."""

    def select(self, inputs, ratio):
        return inputs.graph.src_slots >= 0


@dataclass
class TextPartitioner(Partitioner):
    """Puts every valid token (text too) into one window per row."""

    def partition(self, inputs):
        from lightkv.policies import Partition

        lay = inputs.layout
        window = torch.where(
            lay.valid_mask, torch.arange(lay.batch_size).unsqueeze(1).expand_as(lay.kind), -1
        )
        return Partition(window, lay.valid_mask & (torch.arange(lay.seq_len) % 2 == 0))


@dataclass
class NoisyPasser(MessagePasser):
    """Changes every node, receivers or not."""

    def weight(self, relevance, size):
        return torch.ones_like(relevance)

    def __call__(self, x, relevance, size, src, dst):
        return torch.arange(x.shape[0]), x + 1


class LastRowOnPaper(Relevance):
    """Declares the last query row but reads every row (an adapter projects one)."""

    query_rows = "last"
    key_cols = "all"

    def score(self, queries, keys, layout):
        k = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
        xi = (queries @ k.transpose(-1, -2)).softmax(-1).mean(dim=(1, 2))
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


class KeysOnTheSly(Relevance):
    """Declares no key columns but reads the keys (an adapter passes None)."""

    query_rows = "none"
    key_cols = "none"

    def score(self, queries, keys, layout):
        xi = keys.abs().sum(dim=(1, 3))
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


class VisionColumns(Relevance):
    """Declares the text columns but reads the vision ones too."""

    query_rows = "all"
    key_cols = "text"

    def score(self, queries, keys, layout):
        xi = (queries.mean(1) * keys.mean(1)).sum(-1).abs()
        return torch.where(layout.vision_mask, xi, torch.zeros_like(xi))


@pytest.mark.parametrize(
    "cls,rule",
    [
        (LastRowOnPaper, r"differs when given only what it declares \(query_rows='last'"),
        (KeysOnTheSly, r"fails on what an adapter gives for query_rows='none', key_cols='none'"),
        (VisionColumns, r"reads query rows or key columns an adapter does not project"),
        (LeakyScorer, "not independent|differ in the batch"),
        (GreedyPruner, "removed tokens|budget"),
        (TextPartitioner, "text, padding or structural"),
        (NoisyPasser, "nothing removed some node changed"),
    ],
)
def test_the_contract_catches_broken_policies(cls, rule):
    with pytest.raises(AssertionError, match=rule):
        check_policy(cls)


def test_the_contract_refuses_what_is_not_a_policy():
    with pytest.raises(TypeError, match="not a lightkv policy"):
        check_policy(dict)


def test_pruner_family_is_checked_through_a_stage():
    assert isinstance(check_policy(Pruner.lookup("random")), Pruner)
