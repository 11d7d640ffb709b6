"""The scheduler family, its stage record and the kept-fraction arithmetic every scheduler
shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ...graph.windows import check_window_spec
from ..base import Policy, removed_names

__all__ = [
    "KeptFractionOutOfReach",
    "ScheduleError",
    "Scheduler",
    "StageSpec",
    "average_kept_fraction",
    "per_stage",
    "ratio_for_target",
]


class ScheduleError(ValueError):
    """A scheduler parameter with a bad value.

    Attributes:
        param: the dataclass field at fault (None: the scheduler as a whole).
        index: the entry of that field at fault, for a sequence (None: the whole field).

    Configs use both to point at the offending YAML entry (e.g. ``schedule.removal_ratios.1``).
    """

    def __init__(self, message: str, param: str | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.index = index


class KeptFractionOutOfReach(ScheduleError):
    """A kept-fraction target a schedule cannot reach on a model (`Scheduler.at_kept_fraction`).

    Attributes:
        target: the kept fraction asked for.
        nearest: the nearest kept fraction the schedule can reach there (the message names
            it, to three decimals).
    """

    def __init__(self, message: str, target: float, nearest: float) -> None:
        super().__init__(message, "kept_fraction")
        self.target = target
        self.nearest = nearest


MAX_LAYER = 10_000
"""Bound on a stage's layer index: the deepest real decoder has 80 layers, and an index such
as 10**23 is a typo, not a plan."""


@removed_names(ratio="removal_ratio", before="mode='pre_llm'", cache="mode='cache'")
@dataclass(frozen=True)
class StageSpec:
    """One scheduled stage.

    Attributes:
        layer: 0-based decoder layer after which the stage runs.
        removal_ratio: the removal ratio ``P`` in ``[0, 1)``: the share of the vision tokens
            entering the stage that it removes.
        windows_per_side: windows per image side, or
        window_size: window ``(rows, cols)`` in tokens.
        mode: the registered session mode that runs the stage (`lightkv.adapters.modes`):
            ``layer`` (on the layer's output hidden states, the default), ``pre_llm`` (on
            the layer's *input*, only for layer 0: compressing the embeddings before any
            decoder layer, so every layer's cache is shorter; a stage before layer
            ``l > 0`` is the stage after layer ``l - 1``), ``cache`` (on the layer's
            *cached keys and values* after prefill, `lightkv.cache_stage`: only this
            layer's cache gets shorter) or a plugin's. The booleans ``before`` and
            ``cache`` that once spelled ``pre_llm`` and ``cache`` are refused, naming
            ``mode``.
    """

    layer: int
    removal_ratio: float
    windows_per_side: int | None = None
    window_size: tuple[int, int] | None = None
    mode: str = "layer"

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or not self.mode:
            raise ValueError(f"stage mode must be a registered mode name, got {self.mode!r}")
        if (
            isinstance(self.layer, bool)
            or not isinstance(self.layer, int)
            or not 0 <= self.layer < MAX_LAYER
        ):
            raise ValueError(
                f"stage layer must be an integer in [0, {MAX_LAYER}), got {self.layer!r}"
            )
        if self.mode == "pre_llm" and self.layer != 0:
            raise ValueError(
                f"a stage before layer {self.layer} is the stage after layer {self.layer - 1}; "
                "use mode='pre_llm' only at layer 0"
            )
        if not (0.0 <= float(self.removal_ratio) < 1.0):
            raise ValueError(f"stage removal ratio must be in [0, 1), got {self.removal_ratio!r}")
        check_window_spec(self.windows_per_side, self.window_size)


class Scheduler(Policy):
    """Family: turns a model depth into a list of `StageSpec`. Override `plan`."""

    family: ClassVar[str] = "scheduler"

    shorthand: ClassVar[str | None] = None
    """The YAML key that marks this scheduler's shorthand (``schedule: {KEY: value, ...}``
    instead of ``{name: ..., params: {...}}``), or None. The config layer finds shorthands
    in the registry, so a plugin scheduler declares its own by setting it (only the class
    that sets it has it, not its subclasses)."""
    shorthand_keys: ClassVar[tuple[str, ...]] = ()
    """The keys a shorthand mapping may hold besides `shorthand` itself."""

    @classmethod
    def from_shorthand(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The parameters (plain data, checked by the config layer afterwards) of a
        shorthand mapping ``data`` (holding `shorthand` and some of `shorthand_keys`).

        Default: the mapping itself, each key a parameter of the same name.

        Raises:
            ScheduleError: what the shorthand itself forbids (``param`` names the key).
        """
        return dict(data)

    def to_shorthand(self) -> dict[str, Any] | None:
        """This scheduler as a shorthand mapping (plain data) that `from_shorthand` reads
        back to the same scheduler, or None to be written as ``{name, params}``.

        Default: the non-default parameters plus `shorthand` (always written)."""
        if self.shorthand is None or not dataclasses.is_dataclass(self):
            return None
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            if f.name == self.shorthand or value != default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return {self.shorthand: out.pop(self.shorthand), **out}

    @classmethod
    def shorthand_schema(cls) -> dict[str, Any]:
        """JSON Schema of the shorthand mapping (for `lightkv config schema`)."""
        keys = (cls.shorthand, *cls.shorthand_keys)
        return {
            "type": "object",
            "title": f"shorthand of name: {cls.name}",
            "required": [cls.shorthand],
            "properties": {k: {} for k in keys},
            "additionalProperties": False,
        }

    def plan(self, num_layers: int) -> list[StageSpec]:
        """Stages for a decoder of ``num_layers`` layers, sorted by layer.

        Raises:
            ValueError: the schedule does not fit the model (a layer ``>= num_layers``).
        """
        raise NotImplementedError

    def max_stages(self) -> int | None:
        """How many stages `plan` gives at most, whatever the depth (None: it depends on the
        depth). Configs use it to refuse stage overrides beyond the schedule."""
        return None

    def target_kept_fraction(self, num_layers: int) -> float | None:
        """The vision-KV fraction, averaged over ``num_layers`` layers, this schedule promises
        (reports compare what a session achieved with it). Default: what the planned ratios
        would keep (`average_kept_fraction`); None without stages or for a depth the
        schedule does not fit. Target-driven schedules return their target."""
        try:
            stages = self.plan(num_layers)
            return average_kept_fraction(stages, num_layers) if stages else None
        except ValueError:
            return None

    def at_kept_fraction(
        self, kept_fraction: float, num_layers: int, max_removal_ratio: Any = 1.0
    ) -> Scheduler:
        """This schedule at a target vision-KV fraction on a ``num_layers`` decoder, with its
        stages where its method puts them (the kept-fraction knob, `lightkv.Pipeline`'s
        ``kept_fraction``). Each family overrides it; this default refuses.

        Args:
            kept_fraction: the target, averaged over layers, in ``(0, 1]``.
            num_layers: the decoder's depth.
            max_removal_ratio: the most a stage can really remove: a number for every stage,
                or a function of the stage's index and `StageSpec`
                (`lightkv.policies.schedulers.knob.StageCap`; a pipeline passes its
                policies' limits).

        Returns:
            A scheduler whose ``plan(num_layers)`` keeps ``kept_fraction``, or the nearest
            fraction it can reach when that is at most
            `lightkv.policies.schedulers.knob.REACH_TOLERANCE` above.

        Raises:
            KeptFractionOutOfReach: a target the schedule cannot reach on this depth (the
                message names the nearest reachable fraction).
            ScheduleError: a bad target, or a scheduler without a knob (this default).
        """
        raise ScheduleError(
            f"the {self.name or type(self).__name__!r} scheduler has no kept-fraction knob "
            "(it does not override Scheduler.at_kept_fraction): set its own parameters instead",
            "kept_fraction",
        )

    def knob(self) -> str:
        """What `at_kept_fraction` moves, in a phrase (``lightkv presets -v``, the docs)."""
        return "nothing: this scheduler has no kept-fraction knob"

    @staticmethod
    def _check_depth(num_layers: int) -> None:
        """A clear error for a depth no schedule fits (before any arithmetic on it)."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")

    @staticmethod
    def _validate(stages: list[StageSpec], num_layers: int) -> list[StageSpec]:
        Scheduler._check_depth(num_layers)
        layers = [s.layer for s in stages]
        where = [
            s.layer - 0.5 if s.mode == "pre_llm" else s.layer for s in stages
        ]  # before layer 0 comes first
        if where != sorted(set(where)):
            raise ValueError(f"stage layers must be strictly increasing, got {layers}")
        if layers and layers[-1] >= num_layers:
            raise ValueError(
                f"the schedule compresses after layer {layers[-1]}, but the model has only "
                f"{num_layers} layers (0..{num_layers - 1}); use layers below {num_layers} or a "
                "kept_fraction schedule"
            )
        return stages


def per_stage(values: Sequence, n: int, name: str, what: str = "layers") -> tuple:
    """``values`` for ``n`` stages: one value is broadcast, otherwise exactly ``n``.

    Raises:
        ScheduleError: another count (``param`` is ``name``).
    """
    values = tuple(values)
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ScheduleError(f"{name} has {len(values)} entries for {n} {what}; give 1 or {n}", name)
    return values


TARGET_TOLERANCE = 0.05
"""How far (absolute kept fraction) what a pipeline achieves may fall from what it targets
before a session's report warns (`lightkv.adapters.report.SessionReport.missed_target`) and
``lightkv config validate`` flags its dry run."""


def average_kept_fraction(stages: list[StageSpec], num_layers: int) -> float:
    """Kept vision fraction averaged over layers, ignoring rounding.

    A layer at or before the first stage keeps everything (compression happens after the
    layer has cached its keys/values); later layers keep ``prod(1 - P)`` of the stages
    before them. A stage ``before`` layer 0 compresses every layer's cache. A ``cache``
    stage keeps ``1 - P`` of its own layer's cache only.
    """
    if stages and all(s.mode == "cache" for s in stages):
        at = {s.layer: 1.0 - s.removal_ratio for s in stages}
        return sum(at.get(layer, 1.0) for layer in range(num_layers)) / num_layers
    if any(s.mode == "cache" for s in stages):
        raise ValueError("cache stages and hidden-state stages cannot be mixed in one schedule")
    total, kept, start = 0.0, 1.0, 0
    for s in stages:
        end = s.layer if s.mode == "pre_llm" else s.layer + 1
        total += (end - start) * kept
        kept *= 1.0 - s.removal_ratio
        start = end
    total += (num_layers - start) * kept
    return total / num_layers


def ratio_for_target(kept: Callable[[float], float], target: float, max_ratio: float) -> float:
    """The smallest common ratio ``p <= max_ratio`` with ``kept(p) <= target``, by bisection.

    ``kept`` maps a ratio to the kept fraction it gives (non-increasing, e.g.
    `average_kept_fraction` of fixed stages); returns ``max_ratio`` when even that keeps more.
    """
    lo, hi = 0.0, max_ratio
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kept(mid) > target else (lo, mid)
    return hi


def check_windows(windows_per_side, window_size) -> None:
    """Per-entry checks of a scheduler's window fields (either may be None).

    Raises:
        ScheduleError: a window count below 1 or a window side below 1, with its index.
    """
    for i, w in enumerate(windows_per_side or ()):
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ScheduleError(
                f"windows per side must be a positive integer, got {w!r}", "windows_per_side", i
            )
    for i, size in enumerate(window_size or ()):
        pair = tuple(size) if isinstance(size, (list, tuple)) else (size,)
        if len(pair) != 2 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in pair
        ):
            raise ScheduleError(
                f"window (rows, cols) must be two positive integers, got {list(pair)}",
                "window_size",
                i,
            )


def check_fraction(value, name: str, low_open: bool, high_open: bool, what: str) -> None:
    """``value`` within ``(0|[0, 1)|1]``, else a `ScheduleError` for ``name``."""
    v = float(value)
    ok = (v > 0.0 if low_open else v >= 0.0) and (v < 1.0 if high_open else v <= 1.0)
    if not ok:
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ScheduleError(f"{what} must be in {interval}, got {value!r}", name)
