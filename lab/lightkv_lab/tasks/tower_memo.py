"""`TowerMemo`: a frozen vision tower run once per image batch, however many methods score it.

The laboratory's benchmarks score every preset on the same conversations in the same batches.
The compression never touches the vision tower, so its output on a batch is the same for every
method; with the Photos model's 12-layer ViT-S/14 the tower is about 90% of a scoring run's
time. Inside ``with TowerMemo(model):`` the tower's ``forward`` (on this instance only, put
back on exit) returns the stored output for a batch of pixels it has seen with the same
arguments.

What is stored is only what is read: the hidden state the projector selects
(``vision_feature_layer``) and the input of every tower layer a method taps. A method reading
the tower's attention (VisionZip's [CLS] row, VScan's shallow layer; `lightkv.adapters.tower`)
has a forward pre-hook on that layer's attention module; on a hit the memo calls that
attention module on the layer's stored, normed input, so the hook sees exactly the tensor it
would have seen, and the result equals the uncached run's bit for bit (tested). A hook
anywhere else in the tower, or a tapped layer whose input is not stored yet, makes the call
a miss: the real tower runs and the memo stores the new layer too. Never a stale or partial
answer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["TowerMemo", "layers_read_by"]

_PARTS = (("norm1", "attention"), ("layer_norm1", "self_attn"))
"""``(pre-attention norm, attention)`` attribute names of a tower layer: DINOv2, CLIP/SigLIP."""


def _layers(tower: nn.Module) -> list[nn.Module]:
    model = getattr(tower, "vision_model", tower)
    encoder = model.encoder
    layers = getattr(encoder, "layer", None) or getattr(encoder, "layers", None)
    if layers is None:
        raise TypeError(f"{type(tower).__name__} has no encoder.layer(s): TowerMemo cannot read it")
    return list(layers)


def _parts(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    for norm, attention in _PARTS:
        if hasattr(layer, norm) and hasattr(layer, attention):
            return getattr(layer, norm), getattr(layer, attention)
    raise TypeError(
        f"{type(layer).__name__} has neither norm1/attention nor layer_norm1/self_attn: "
        "TowerMemo supports DINOv2, CLIP and SigLIP towers"
    )


_INERT = "transformers.utils.output_capturing"
"""transformers 5 keeps a forward hook on every layer that records outputs only while a caller
asks for them (``output_attentions``); those calls are never memoised, so the hooks are inert
here."""


def _hooks(hooks: dict) -> list:
    return [h for h in hooks.values() if getattr(h, "__module__", None) != _INERT]


def _hooked(module: nn.Module) -> bool:
    return bool(_hooks(module._forward_pre_hooks) or _hooks(module._forward_hooks))


class TowerMemo:
    """Memoise ``model``'s vision tower on pixel batches (a context manager).

    Args:
        model: a LLaVA-style model (``model.model.vision_tower``) whose tower is frozen.
        feature_layer: the hidden state the projector reads (default: the model config's
            ``vision_feature_layer``).
        keep: tower layers (0-based) whose input to store from the first run on, so that
            methods tapping them later hit (`layers_read_by`); others are added on a miss.

    Attributes:
        hits: calls answered from the memo.
        misses: calls that ran the tower.
    """

    def __init__(
        self, model: nn.Module, feature_layer: int | None = None, keep: Iterable[int] = ()
    ) -> None:
        self.tower = model.model.vision_tower
        self.layers = _layers(self.tower)
        depth = len(self.layers)
        f = model.config.vision_feature_layer if feature_layer is None else feature_layer
        if not isinstance(f, int):
            raise TypeError(f"TowerMemo needs one vision_feature_layer (an int), got {f!r}")
        self.feature = f % (depth + 1)  # index into hidden_states (depth + 1 entries)
        self.keep = {int(i) % depth for i in keep}
        self.store: dict[tuple, dict[int, torch.Tensor]] = {}
        self.outputs: dict[tuple, Any] = {}
        self.hits = self.misses = 0
        self._saved: Any = None

    def __enter__(self) -> TowerMemo:
        if "forward" in vars(self.tower):
            raise RuntimeError("the tower's forward is already replaced (a TowerMemo is active)")
        self._real = self.tower.forward
        self.tower.forward = self._forward
        return self

    def __exit__(self, *exc) -> None:
        del self.tower.forward  # the class's forward again
        self.store.clear()
        self.outputs.clear()

    def _key(self, pixel_values: torch.Tensor, kwargs: dict) -> tuple:
        digest = hashlib.sha256(pixel_values.detach().contiguous().cpu().numpy().tobytes())
        args = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        return (digest.hexdigest(), tuple(pixel_values.shape), str(pixel_values.dtype), args)

    def _tapped(self) -> set[int] | None:
        """The layers whose attention has a hook; None where any other tower module has one."""
        taps = set()
        attentions = {}
        for i, layer in enumerate(self.layers):
            attentions[id(_parts(layer)[1])] = i
        for module in self.tower.modules():
            if module is self.tower or not _hooked(module):
                continue
            i = attentions.get(id(module))
            if i is None or _hooks(module._forward_hooks):
                return None
            taps.add(i)
        return taps

    def _forward(self, pixel_values: torch.Tensor, *args, **kwargs):
        taps = self._tapped()
        # positional extras or captured attentions: run the tower, store nothing
        plain = not args and not kwargs.get("output_attentions")
        key = self._key(pixel_values, kwargs) if plain else None
        stored = self.store.get(key) if key is not None else None
        if stored is None or taps is None or not taps <= stored.keys():
            return self._miss(key, taps, pixel_values, args, kwargs)
        self.hits += 1
        for i in sorted(taps):
            norm, attention = _parts(self.layers[i])
            attention(norm(stored[i]))  # the hook reads this input; the output is not used
        hidden = tuple(stored.get(i) for i in range(len(self.layers) + 1))
        out = self.outputs[key]
        return type(out)(**{**out, "hidden_states": hidden})

    def _miss(self, key, taps, pixel_values, args, kwargs):
        self.misses += 1
        kwargs = {**kwargs, "output_hidden_states": True}
        out = self._real(pixel_values, *args, **kwargs)
        if key is None or out.hidden_states is None:
            return out
        keep = {self.feature} | self.keep | (taps or set()) | set(self.store.get(key, {}))
        self.store[key] = {i: out.hidden_states[i] for i in keep}
        # the caller may set fields on what it gets (LLaVA sets pooler_output): keep a copy
        self.outputs[key] = type(out)(
            last_hidden_state=out.last_hidden_state, pooler_output=out.pooler_output
        )
        return out


def layers_read_by(pipelines: Iterable[Any], model: nn.Module) -> set[int]:
    """The tower layers (0-based) whose attention the ``pipelines`` read on ``model``: the
    layer the projector reads for a relevance that ``reads_tower`` (VisionZip, SCOPE, ...),
    and every ``tower_layers`` layer of a policy (VScan's shallow scan), at the model's depth
    (`lightkv_lab.tasks.towers.fit_tower`)."""
    from lightkv_lab.tasks.towers import fit_tower

    config = model.config
    depth = config.vision_config.num_hidden_layers
    f = config.vision_feature_layer
    out: set[int] = set()
    for pipe in pipelines:
        if pipe is None:
            continue
        pipe = fit_tower(pipe, depth)
        if getattr(pipe.relevance, "reads_tower", False) and isinstance(f, int):
            out.add(depth + f if f < 0 else f - 1)
        for part in ("partitioner", "scorer", "pruner", "passer"):
            out.update(getattr(getattr(pipe, part), "tower_layers", ()) or ())
    return out
