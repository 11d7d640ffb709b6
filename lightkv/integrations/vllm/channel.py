"""Proportional attention inside vLLM, exactly, through one extra head channel.

vLLM's attention backends take no per-key bias (vLLM RFC #7366), so the plugin carries
lightkv's ``log(size)`` bias the way its FlashAttention-2 route does
(`lightkv.adapters.bias`): each query gets a channel 1, each key the channel
``log(size) / scale`` and each value a 0, with the softmax scale unchanged, so that
``Q' . K' * scale = Q . K * scale + log(size)`` for every query and key, and the extra
output channel is dropped. The key cache holds the expanded keys, so decoding sees the bias
of every merged token in the prompt, also from vLLM's prefix cache.

The head size the KV cache is allocated with is the smallest one above the model's that the
attention backend takes (`channel_head_size`): 136 for a head of 128 under FlashAttention
(multiples of 8), 160 on vLLM's CPU backend (32, 64, 80, 96, 112, 128, 160, ...). The
padding channels are zeros on every side and change no score.

Each token's ``log(size)`` reaches the attention layers through `LogSizes`, a buffer of one
value per token the model runner schedules (vLLM's own pattern for its inputs: a fixed
buffer, written before each step and read in place, which torch.compile and CUDA graphs
replay): `LightKVQwen2_5_VLForConditionalGeneration.embed_input_ids` writes it from the
column `embed_multimodal` appends to each survivor's embedding, zeros for text and for
every decoded token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.attention.attention import Attention

from ...adapters.bias import expand_queries

__all__ = ["ChannelAttention", "LogSizes", "channel_head_size", "install_channel"]


class LogSizes(nn.Module):
    """``log(size)`` of each token of the step being run, ``[max_num_batched_tokens]``
    (float32; zero for text, decoded tokens and unmerged survivors)."""

    value: torch.Tensor

    def __init__(self, max_tokens: int):
        super().__init__()
        self.register_buffer("value", torch.zeros(max_tokens), persistent=False)

    def write(self, is_multimodal: torch.Tensor | None, logs: torch.Tensor | None) -> None:
        """Zero the buffer, then put ``logs`` (one per multimodal token, in order) where
        ``is_multimodal`` ``[T]`` is set."""
        self.value.zero_()
        if logs is None or is_multimodal is None or logs.numel() == 0:
            return
        t = is_multimodal.shape[0]
        if t > self.value.shape[0]:
            raise RuntimeError(
                f"a step of {t} tokens, but lightkv's log-size buffer holds "
                f"{self.value.shape[0]} (max_num_batched_tokens)"
            )
        view = self.value[:t]
        view[is_multimodal.to(view.device)] = logs.to(view.device, view.dtype)


def channel_head_size(backend: Any, head_dim: int) -> int:
    """The smallest head size above ``head_dim`` that ``backend`` (an attention backend class)
    takes.

    Raises:
        ValueError: none up to twice the head size.
    """
    for size in range(head_dim + 1, 2 * head_dim + 1):
        if backend.supports_head_size(size):
            return size
    raise ValueError(
        f"vLLM's attention backend {backend.get_name()} takes no head size between "
        f"{head_dim + 1} and {2 * head_dim}, so lightkv cannot add its proportional-attention "
        "channel: set `proportional_attention: false` in the pipeline"
    )


class ChannelAttention(Attention):
    """vLLM's `Attention` on heads of `channel_head_size`, taking the model's queries, keys and
    values of ``head_dim`` and returning outputs of ``head_dim``: ``Q' = [Q, 1, 0..]``,
    ``K' = [K, log(size) / scale, 0..]``, ``V' = [V, 0..]``.

    Attributes:
        head_dim: the model's head size.
    """

    def __init__(self, *args: Any, head_dim: int, log_sizes: LogSizes, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.head_dim = head_dim
        # a plain reference (not a submodule): the model owns the buffer once
        object.__setattr__(self, "_log_sizes", log_sizes)

    def forward(self, query, key, value, output_shape=None, output_dtype=None):  # type: ignore[override]
        """``query [T, H * d]``, ``key``, ``value [T, H_kv * d]`` -> ``[T, H * d]``."""
        t, d, pad = query.shape[0], self.head_dim, self.head_size - self.head_dim
        # [Q, 1], [K, log(size) / scale], [V, 0] as on the FlashAttention-2 route, then zeros
        q = nn.functional.pad(expand_queries(query.view(t, self.num_heads, d)), (0, pad - 1))
        col = (self._log_sizes.value[:t] / self.impl.scale).to(key.dtype)
        k = key.view(t, self.num_kv_heads, d)
        k = torch.cat([k, col[:, None, None].expand(t, self.num_kv_heads, 1)], -1)
        k = nn.functional.pad(k, (0, pad - 1))
        v = nn.functional.pad(value.view(t, self.num_kv_heads, d), (0, pad))
        out = super().forward(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))
        return out.view(t, self.num_heads, self.head_size)[..., :d].reshape(t, self.num_heads * d)


def install_channel(language_model: Any, vllm_config: Any) -> LogSizes:
    """Replace the attention of every decoder layer of ``language_model`` (vLLM's Qwen2-style
    ``model.layers[i].self_attn.attn``) by a `ChannelAttention` under the same layer name, and
    return the `LogSizes` buffer they read (the caller registers it on the model)."""
    scheduler = vllm_config.scheduler_config
    sizes = LogSizes(int(scheduler.max_num_batched_tokens))
    forward_context = vllm_config.compilation_config.static_forward_context
    for layer in language_model.model.layers:
        attn = layer.self_attn.attn
        window = getattr(attn.impl, "sliding_window", None)
        if attn.kv_sharing_target_layer_name is not None or window not in (None, -1, (-1, -1)):
            raise ValueError(
                f"{attn.layer_name}: lightkv's proportional-attention channel supports plain "
                "causal decoder attention (no sliding window, no shared KV cache): set "
                "`proportional_attention: false` in the pipeline"
            )
        size = channel_head_size(attn.attn_backend, attn.head_size)
        del forward_context[attn.layer_name]  # the new layer registers the same name
        layer.self_attn.attn = ChannelAttention(
            attn.num_heads,
            size,
            attn.impl.scale,
            num_kv_heads=attn.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            prefix=attn.layer_name,
            head_dim=attn.head_size,
            log_sizes=sizes,
        )
    return sizes
