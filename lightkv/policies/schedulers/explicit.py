"""`ExplicitSchedule` (``explicit``): fixed layers, ratios and windows."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from ..base import removed_names
from .core import ScheduleError, Scheduler, StageSpec, check_windows, per_stage
from .knob import REFERENCE_DEPTH, check_target, fit_common_ratio, scale_layers

__all__ = ["ExplicitSchedule"]


def _as_list(value: Any) -> Any:
    """A YAML scalar as a list of one (lists and anything else as given)."""
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _one_or_list(item: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [item, {"type": "array", "items": item, "minItems": 1}]}


@Scheduler.register("explicit")
@removed_names(ratios="removal_ratios")
@dataclass
class ExplicitSchedule(Scheduler):
    """Fixed layers, windows and ratios (the reference code's schedules).

    Attributes:
        layers: 0-based layers Λ, increasing.
        removal_ratios: removal ratio per stage (one value is broadcast).
        windows_per_side: windows per side per stage (one value is broadcast); the default
            ``(4, 2, 1)`` fits the three default layers only (other layers must give their
            own), or
        window_size: one ``(rows, cols)`` per stage (one value is broadcast); replaces the
            default ``windows_per_side``.

    Raises:
        ScheduleError: at construction, for lengths that do not match ``layers`` or bad
            values (a `ValueError` that names the field and entry at fault).
    """

    layers: tuple[int, ...] = (12, 18, 24)
    removal_ratios: tuple[float, ...] = (0.5,)
    windows_per_side: tuple[int, ...] | None = (4, 2, 1)
    window_size: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        # The default (4, 2, 1) belongs to the three default layers: say so at construction,
        # not as a length mismatch at apply(); an explicit window_size replaces it.
        n = len(tuple(self.layers))
        if tuple(self.windows_per_side or ()) == (4, 2, 1):
            if self.window_size is not None:
                self.windows_per_side = None
            elif n != 3:
                raise ScheduleError(
                    f"ExplicitSchedule(layers={tuple(self.layers)}): windows_per_side defaults to "
                    "(4, 2, 1), one entry per default layer; give windows_per_side with 1 or "
                    f"{n} entries (e.g. windows_per_side=(1,)) or window_size",
                    "windows_per_side",
                )
        self.stages()  # any other length or value problem, at construction too

    shorthand: ClassVar[str] = "layers"
    shorthand_keys: ClassVar[tuple[str, ...]] = (
        "removal_ratios",
        "windows_per_side",
        "window_size",
    )

    @classmethod
    def from_shorthand(cls, data: dict[str, Any]) -> dict[str, Any]:
        """``layers: [...]`` with ``removal_ratios`` (required) and ``windows_per_side`` or
        ``window_size`` (neither: one window per image side); scalars are lists of one."""
        layers = _as_list(data["layers"])
        if isinstance(layers, list) and not layers:
            raise ScheduleError(
                "give at least one layer (an empty schedule compresses nothing)", "layers"
            )
        if "removal_ratios" not in data:
            n = len(layers) if isinstance(layers, list) else 1
            count = "one value" if n == 1 else f"1 or {n} values"
            raise ScheduleError(
                f"an explicit schedule needs removal_ratios ({count}), e.g. removal_ratios: [0.5]",
                "removal_ratios",
            )
        if "windows_per_side" in data and "window_size" in data:
            raise ScheduleError("give windows_per_side or window_size, not both", "window_size")
        params = {"layers": layers, "removal_ratios": _as_list(data["removal_ratios"])}
        if "window_size" in data:
            size = data["window_size"]
            pair = (
                isinstance(size, (list, tuple))
                and len(size) == 2
                and all(isinstance(v, int) for v in size)
            )
            params["window_size"] = [size] if pair else size
        params["windows_per_side"] = (
            _as_list(data["windows_per_side"]) if "windows_per_side" in data else None
        )
        return params

    def to_shorthand(self) -> dict[str, Any] | None:
        if not tuple(self.layers):  # the shorthand refuses an empty schedule: write {name, params}
            return None
        out: dict[str, Any] = {
            "layers": list(self.layers),
            "removal_ratios": [float(r) for r in self.removal_ratios],
        }
        if self.window_size is not None:
            out["window_size"] = [list(w) for w in self.window_size]
        elif self.windows_per_side is not None:
            out["windows_per_side"] = list(self.windows_per_side)
        return out

    @classmethod
    def shorthand_schema(cls) -> dict[str, Any]:
        integer, number = {"type": "integer"}, {"type": "number"}
        pair = {"type": "array", "items": integer, "minItems": 2, "maxItems": 2}
        return {
            "type": "object",
            "title": "explicit stages (shorthand of name: explicit)",
            "properties": {
                "layers": _one_or_list(integer),
                "removal_ratios": _one_or_list(number),
                "windows_per_side": _nullable(_one_or_list(integer)),
                "window_size": _nullable(
                    {"anyOf": [pair, {"type": "array", "items": pair, "minItems": 1}]}
                ),
            },
            "required": ["layers", "removal_ratios"],
            "additionalProperties": False,
        }

    def max_stages(self) -> int:
        return len(self.layers)

    def _check_values(self) -> None:
        layers = list(self.layers)
        for i, layer in enumerate(layers):
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ScheduleError(
                    f"layer indices are 0-based and must be >= 0, got {layer!r}", "layers", i
                )
            if i and layer <= layers[i - 1]:
                raise ScheduleError(
                    f"layers must be strictly increasing, got {layers}", "layers", i
                )
        for i, r in enumerate(self.removal_ratios):
            if not (0.0 <= float(r) < 1.0):
                raise ScheduleError(
                    f"removal ratio must be in [0, 1) (0 keeps every token), got {r!r}",
                    "removal_ratios",
                    i,
                )
        check_windows(self.windows_per_side, self.window_size)

    def stages(self) -> list[StageSpec]:
        """The stages, independent of depth (not yet checked against a model).

        Raises:
            ScheduleError: a bad value or a field whose length does not match ``layers``.
        """
        self._check_values()
        n = len(self.layers)
        ratios = per_stage(self.removal_ratios, n, "removal_ratios")
        if self.windows_per_side is not None and self.window_size is not None:
            raise ScheduleError("give windows_per_side or window_size, not both", "window_size")
        if self.window_size is not None:
            sizes = per_stage([tuple(s) for s in self.window_size], n, "window_size")
            return [
                StageSpec(int(at), float(r), window_size=s)
                for at, r, s in zip(self.layers, ratios, sizes)
            ]
        wps = per_stage(self.windows_per_side or (1,), n, "windows_per_side")
        return [
            StageSpec(int(at), float(r), windows_per_side=int(w))
            for at, r, w in zip(self.layers, ratios, wps)
        ]

    def plan(self, num_layers):
        return self._validate(self.stages(), num_layers)

    def layers_on(self, num_layers: int) -> tuple[int, ...]:
        """The layers the knob keeps on a ``num_layers`` decoder: as written where they fit;
        else moved with `scale_layers` from the depth they are written for
        (`REFERENCE_DEPTH`, or deeper when a layer is beyond it).

        Raises:
            ValueError: the stages do not fit ``num_layers`` layers even scaled.
        """
        layers = tuple(int(at) for at in self.layers)
        if not layers or layers[-1] < num_layers:
            return layers
        return scale_layers(layers, max(REFERENCE_DEPTH, layers[-1] + 2), num_layers)

    def at_kept_fraction(self, kept_fraction, num_layers, max_removal_ratio=1.0):
        """The same stages (`layers_on`: as written where they fit) with one common removal
        ratio fitted to ``kept_fraction`` (`fit_common_ratio`); windows kept per stage."""
        t = check_target(kept_fraction)
        self._check_depth(num_layers)
        base = replace(self, layers=self.layers_on(num_layers))
        stages = base.stages()

        def make(p: float) -> list[StageSpec]:
            return [replace(s, removal_ratio=p) for s in stages]

        where = ", ".join(str(at) for at in base.layers)
        many = "s after layers" if len(base.layers) > 1 else " after layer"
        how = f"its stage{many} {where}" if where else "no stage"
        ratio = fit_common_ratio(make, num_layers, t, max_removal_ratio, how)
        return replace(base, removal_ratios=(ratio,))

    def knob(self) -> str:
        layers = ", ".join(str(at) for at in self.layers)
        return (
            f"one common removal ratio of its stages after layers {layers} (the layers as "
            f"written where they fit the model, else scaled from {REFERENCE_DEPTH} layers)"
        )
