"""Where proportional attention's ``log(size)`` bias goes, per attention kernel: the routes.

Internals of `lightkv.adapters.proportional`. Three exact routes carry the bias of a layer
whose keys stand for several tokens each (`ROUTES`; ``"auto"`` picks one by the model's
``attn_implementation``, `choose_route`):

* ``mask``: added to the additive float 4-D mask (``eager``, ``sdpa``; the kernel takes a
  mask argument).
* ``channel``: one extra head channel, for kernels without a mask argument
  (FlashAttention-2, any sdpa / flash kernel): ``Q' = [Q, 1]``, ``K' = [K, log(s) / scale]``,
  ``V' = [V, 0]``, softmax scale kept at the layer's own (``1/sqrt(d)``), so the extra logit
  is ``1 * log(s) / scale * scale = log(s)``; the extra output column (always 0) is
  dropped. Grouped-query attention: one bias column per KV head (the same ``log(s)`` in
  each). The layer's cache holds ``K'`` and ``V'`` (`MaskedCacheLayer.channel`), so
  decoding sees the same bias (a decoded token's channel is ``log 1 = 0``) and the decode
  query gets its ``1`` here. FlashAttention-2 pads the head dim to a multiple of 8
  (``d = 128`` becomes 136 inside the kernel).
* ``flex``: PyTorch's FlexAttention with ``score_mod = score + log_size[b, kv_idx]`` and
  the layer's mask as a ``BlockMask``; compiled on CUDA, the unfused reference on a CPU.
  Under ``flex_attention`` every compressed layer takes it (biased or not), with a
  ``BlockMask`` of lightkv's mask: transformers' own call reads a 4-D additive mask
  element by element in its ``score_mod`` (no block sparsity), and on this project's CPU
  its compiled kernel crashed on the compressed layers' masks (torch 2.13, a segmentation
  fault).

How the kernel is reached (``channel`` and ``flex``): nothing global changes except one
added key, `DISPATCH_KEY`, in transformers' attention registry (``AttentionInterface``,
its public extension point), which no model names. `BiasDispatch` arms a layer for one
call; a forward pre-hook on that layer's attention module then gives the module, on this
instance only, a `BiasView` of its config naming `DISPATCH_KEY` (the modeling code picks
its attention function by ``self.config._attn_implementation``), and
`proportional_attention_forward` puts the real config back at once and calls the model's
own kernel (or FlexAttention) on the expanded tensors. A forward hook that runs even when
the call raises restores the config. Layers with no merged key are never armed: their
calls, and every call while no token stands for more than one, are the unhooked ones,
bit for bit.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "DISPATCH_KEY",
    "FLEX",
    "ROUTES",
    "BiasDispatch",
    "BiasView",
    "choose_route",
    "expand_keys",
    "expand_queries",
    "expand_values",
    "log_sizes",
    "proportional_attention_forward",
]

ROUTES = ("auto", "mask", "channel", "flex")
"""How the bias reaches the logits (`choose_route` resolves ``auto``)."""

DISPATCH_KEY = "lightkv_proportional"
"""The attention-registry key `BiasView` names for one armed call."""

FLASH = "flash_attention_2"
FLEX = "flex_attention"


def choose_route(requested: str, impl: str) -> str:
    """The route for the decoder's attention implementation ``impl``.

    ``auto``: ``mask`` under ``eager`` and ``sdpa``, ``channel`` under FlashAttention-2,
    ``flex`` under ``flex_attention``.

    Raises:
        ValueError: an unknown route, or ``mask`` under FlashAttention-2 (no mask argument).
    """
    if requested not in ROUTES:
        raise ValueError(
            f"unknown proportional_route {requested!r}; choose one of {ROUTES} ('auto' picks the "
            "route by the model's attn_implementation)"
        )
    if requested == "auto":
        return {FLASH: "channel", FLEX: "flex"}.get(impl, "mask")
    if impl == FLEX and requested != "flex":
        raise ValueError(
            f"proportional_route={requested!r} under flex_attention: lightkv runs every compressed "
            "layer through FlexAttention with a BlockMask of its own mask there, and the bias "
            "through its score_mod; use 'flex' (or 'auto')"
        )
    if requested == "mask" and impl == FLASH:
        raise ValueError(
            "proportional_route='mask' adds log(size) to a 4-D mask, which FlashAttention-2 "
            "does not take: use proportional_route='channel' (or 'auto')"
        )
    if requested == "flex":
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as err:
            raise ValueError(
                f"proportional_route='flex' needs torch.nn.attention.flex_attention, which this "
                f"torch {torch.__version__} lacks ({err}): use 'channel' or 'auto'"
            ) from None
    return requested


def log_sizes(sizes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``log(size)`` per key ``[B, L]`` in ``dtype``; holes (size 0) count as 1. The log is
    taken in float32 first (a bf16 size would round before the log), the same on every
    route, so the routes agree to the kernels' rounding."""
    return sizes.clamp_min(1).to(torch.float32).log().to(dtype)


def expand_keys(keys: torch.Tensor, logs: torch.Tensor, channel: float) -> torch.Tensor:
    """``K' = [K, log(s) * channel]``: keys ``[B, H_kv, L, d]`` and ``logs`` ``[B, L]``
    (`log_sizes`, or zeros) -> ``[B, H_kv, L, d + 1]``, one bias column per KV head;
    ``channel`` is ``1 / scale`` (``sqrt(d)`` for the usual scale)."""
    col = (logs.to(keys.device, keys.dtype) * channel)[:, None, :, None]
    return torch.cat([keys, col.expand(*keys.shape[:-1], 1)], dim=-1)


def expand_values(values: torch.Tensor) -> torch.Tensor:
    """``V' = [V, 0]``: ``[B, H_kv, L, d]`` -> ``[B, H_kv, L, d + 1]`` (q, k and v share a
    head dim: what FlashAttention and sdpa's fused kernels need)."""
    return torch.nn.functional.pad(values, (0, 1))


def expand_queries(queries: torch.Tensor) -> torch.Tensor:
    """``Q' = [Q, 1]``: ``[B, H, Q, d]`` -> ``[B, H, Q, d + 1]``."""
    return torch.nn.functional.pad(queries, (0, 1), value=1.0)


class BiasView:
    """A read-only view of an attention module's config for one armed call: it names
    `DISPATCH_KEY`; every other attribute is the wrapped config's.

    Attributes:
        route: ``channel`` or ``flex``.
        implementation: the model's own attention implementation (the kernel the channel
            route calls).
        logs: ``[B, L]`` ``log(size)`` of the call's keys (the channel route without a
            cache, the flex route), or None (the cache already holds ``K'``).
        lightkv_kernel: the kernel that really runs (what `AttentionWatch` records).
    """

    __slots__ = ("_base", "route", "implementation", "logs")
    _attn_implementation = DISPATCH_KEY

    def __init__(self, base: Any, route: str, logs: torch.Tensor | None) -> None:
        impl = getattr(base, "_attn_implementation", None) or "eager"
        for name, value in (("_base", base), ("route", route), ("implementation", impl)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "logs", logs)

    @property
    def lightkv_kernel(self) -> str:
        return FLEX if self.route == "flex" else self.implementation

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"lightkv's proportional-attention view of the model config is read-only ({name!r})"
        )


def _model_kernel(module: nn.Module, impl: str):
    """The attention function ``module``'s modeling code would call under ``impl``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if impl == "eager" and eager is None:
        raise TypeError(
            f"{type(module).__name__}'s module has no eager_attention_forward for the channel "
            "route under eager attention; load the model with attn_implementation='sdpa'"
        )
    # the eager fallback is None only when impl is not "eager" (refused above otherwise),
    # and get_interface then finds impl in the registry
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)  # type: ignore[arg-type]


def proportional_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function under `DISPATCH_KEY` (transformers' contract: ``query``
    ``[B, H, Q, d]``, ``key`` / ``value`` ``[B, H_kv, L, d]`` or, from a channel cache,
    ``d + 1``; returns ``([B, Q, H, d], weights or None)``).

    Raises:
        RuntimeError: called for a module that no `BiasDispatch` armed.
    """
    view: Any = module.config
    if not isinstance(view, BiasView):
        raise RuntimeError(
            f"{DISPATCH_KEY!r} is lightkv's per-call attention route and runs only inside a "
            "compression session; do not set it as a model's attn_implementation"
        )
    module.config = object.__getattribute__(view, "_base")  # the kernel reads the real config
    d = query.shape[-1]
    scale = d**-0.5 if scaling is None else scaling
    if view.route == "flex":
        return _flex(module, query, key, value, attention_mask, scale, view.logs, **kwargs)
    if key.shape[-1] == d:  # no cache: the keys of this call are expanded here
        if view.logs is None:
            raise RuntimeError(
                "a channel-route call without the keys' sizes (a lightkv bug: report it)"
            )
        key, value = expand_keys(key, view.logs, 1.0 / scale), expand_values(value)
    elif key.shape[-1] != d + 1:
        raise RuntimeError(f"keys of head dim {key.shape[-1]} for queries of {d} (a lightkv bug)")
    out, weights = _model_kernel(module, view.implementation)(
        module, expand_queries(query), key, value, attention_mask, scaling=scale, **kwargs
    )
    return out[..., :d], weights


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(module, query, key, value, mask, scale, logs, **kwargs):
    """FlexAttention with ``score + log_size[b, kv_idx]`` and the call's mask as a
    ``BlockMask`` (None: causal, aligned bottom-right like the other kernels)."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    for name in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(name) not in (None, -1):
            raise NotImplementedError(
                f"proportional_route='flex' does not implement {name}; use 'mask' or 'channel'"
            )
    b, h, q_len, _ = query.shape
    kv_len = key.shape[-2]
    if logs is not None and tuple(logs.shape) != (b, kv_len):
        raise RuntimeError(f"flex route: sizes for {kv_len} keys expected (a lightkv bug)")
    bias = None if logs is None else logs.to(query.device, query.dtype)
    block = mask if isinstance(mask, BlockMask) else None
    if block is None:
        allowed = _allowed(mask, b, q_len, kv_len)
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if allowed is not None:

            def mask_mod(bi, hi, qi, ki):
                return allowed[bi, qi, ki]

        elif causal and q_len > 1:
            offset = kv_len - q_len

            def mask_mod(bi, hi, qi, ki):
                return ki <= qi + offset

        else:
            mask_mod = None
        if mask_mod is not None:
            block = create_block_mask(
                mask_mod, b, None, q_len, kv_len, device=query.device, _compile=query.is_cuda
            )

    def score_mod(score, bi, hi, qi, ki):
        return score + bias[bi, ki]

    kernel = _compiled_flex() if query.is_cuda else flex_attention
    out = kernel(
        query,
        key,
        value,
        score_mod=None if bias is None else score_mod,
        block_mask=block,
        scale=scale,
        enable_gqa=key.shape[1] != h,
    )
    return out.transpose(1, 2).contiguous(), None


def _allowed(mask: Any, b: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """``[B, Q, L]`` bool from a 4-D bool or additive float mask (0 allowed, the dtype's
    minimum hidden), or None for no mask."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise TypeError(
            "proportional_route='flex' takes a 4-D mask (bool or additive float) or none; got "
            f"{type(mask).__name__}"
        )
    mask = mask[:, 0, -q_len:, :kv_len]
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return allowed.expand(b, q_len, kv_len)


class BiasDispatch:
    """Routes an armed layer's next attention call through `proportional_attention_forward`.

    Args:
        attention: each decoder layer's self-attention module.
    """

    def __init__(self, attention: Sequence[nn.Module | None]):
        self.attention = list(attention)
        self._armed: dict[int, tuple[str, torch.Tensor | None]] = {}
        self._swapped: dict[int, Any] = {}

    def install(self) -> list[Any]:
        """Register `DISPATCH_KEY` (once per process) and the hooks on every attention
        module; the session removes the hooks with its own."""
        from transformers import AttentionInterface

        if AttentionInterface._global_mapping.get(DISPATCH_KEY) is not (
            proportional_attention_forward
        ):
            AttentionInterface.register(DISPATCH_KEY, proportional_attention_forward)
        handles = []
        for i, attn in enumerate(self.attention):
            if attn is None or getattr(attn, "config", None) is None:
                raise NotImplementedError(
                    f"decoder layer {i} has no self_attn with a config, through which lightkv "
                    "routes proportional attention's bias channel; use attn_implementation='sdpa' "
                    "or 'eager' (the mask route)"
                )
            handles.append(attn.register_forward_pre_hook(functools.partial(self._swap, i)))
            handles.append(
                attn.register_forward_hook(functools.partial(self._restore, i), always_call=True)
            )
        return handles

    def channel(self, layer: int) -> float:
        """``1 / scale`` of ``layer``'s attention (what the bias column is multiplied by)."""
        attn = self.attention[layer]
        assert attn is not None, f"layer {layer} has no attention module to carry the bias"
        scaling = getattr(attn, "scaling", None)
        if scaling is None:
            scaling = int(getattr(attn, "head_dim")) ** -0.5  # noqa: B009  (a module attribute)
        return 1.0 / float(scaling)

    def arm(self, layer: int, route: str, logs: torch.Tensor | None = None) -> None:
        """``layer``'s next attention call takes ``route`` (``logs``: ``[B, L]`` of its keys)."""
        self._armed[layer] = (route, logs)

    def disarm(self) -> None:
        """The forward ended (also after an error): nothing stays armed or swapped."""
        self._armed.clear()
        for i in list(self._swapped):
            attn = self.attention[i]
            assert attn is not None  # only layers with an attention module are swapped
            self._restore(i, attn)

    def _swap(self, layer: int, module: nn.Module, *args: Any) -> None:
        spec = self._armed.pop(layer, None)
        if spec is None:
            return
        self._swapped[layer] = module.config
        module.config = BiasView(module.config, *spec)  # type: ignore[assignment]  # a view

    def _restore(self, layer: int, module: nn.Module, *args: Any) -> None:
        if layer in self._swapped:
            module.config = self._swapped.pop(layer)
