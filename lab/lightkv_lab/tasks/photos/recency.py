"""A pretrained LLM's recency bias, given to the Photos decoder's first layers.

Why: in LLaVA-1.5-7B the first layers' text-to-image attention follows position more than
content. The attention a late text token pays to image tokens grows towards the image's last
rows, the ones nearest the text: the "attention shift" that makes FastV keep the bottom of
the image. And the question tokens gather the image's content later, in the middle layers.
A 6-layer decoder trained from scratch on short prompts learns neither. Its first layer reads
the asked object straight away, so FastV and PyramidDrop lost nothing at 11% kept on the
first Photos model (99.2 / 100.3 retained; the field's re-run: 71.9 / 70.5).

How: a text LLM gets this bias from a component that all its queries and keys share. Under
RoPE the score of two such components is ``sum_j |b_j|^2 cos((m - n) theta_j)``, a function
of distance alone: RoPE's long-term decay (Su et al., RoFormer, section 3.4.3). This module
sets the query and key biases of layers ``< layers`` (the config's stock ``attention_bias``;
the model class is unchanged) to one vector ``b`` per head. ``b`` is non-zero only on the
rotary pairs whose frequency makes ``cos`` fall monotonically across one image's distance
(`BAND`). The biases stay fixed while the decoder is fine-tuned around them (`prior_params`
names them, so the trainer leaves them out).

``strength`` is the logit the bias adds at distance 0 over the logit at `SPAN` tokens, so
it reads as "how many nats nearer tokens are favoured". It is chosen on a development split
(`lightkv_lab.bench.agreement`, its ``TUNED_ON`` methods), never on the benchmark's episodes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BAND", "SPAN", "install_recency_prior", "prior_params", "recency_logits"]

SPAN = 270
"""Distances the bias is shaped over: 256 image tokens and a question."""

BAND = (8, 9)
"""Rotary pairs carrying ``b`` (head_dim 32, base 10,000: frequencies 0.0100 and 0.0056 per
token, so ``cos`` falls monotonically from distance 0 to `SPAN`)."""


def _frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def recency_logits(distance: torch.Tensor, head_dim: int, theta: float, strength: float):
    """The logit the prior adds at each query-key ``distance`` (float64), up to a constant.
    It is ``strength`` higher at distance 0 than at `SPAN`."""
    freq = _frequencies(head_dim, theta)[list(BAND)]
    shape = torch.cos(distance.to(torch.float64)[..., None] * freq).sum(-1)
    drop = len(BAND) - float(torch.cos(SPAN * freq).sum())
    return strength * shape / drop


def _bias_vector(head_dim: int, theta: float, strength: float) -> torch.Tensor:
    """``b [head_dim]``: with ``q = k = b`` the scaled score falls by ``strength`` from distance
    0 to `SPAN` (``|b_pair|^2 / sqrt(d)`` per pair times ``sum (1 - cos)``)."""
    freq = _frequencies(head_dim, theta)[list(BAND)]
    drop = float((1 - torch.cos(SPAN * freq)).sum())
    per_pair = strength * math.sqrt(head_dim) / drop  # |b_pair|^2
    b = torch.zeros(head_dim, dtype=torch.float64)
    # transformers' Llama rotates the halves: pair j is (j, j + head_dim/2)
    for j in BAND:
        b[j] = b[j + head_dim // 2] = math.sqrt(per_pair / 2)
    return b


def install_recency_prior(model, layers: int, strength: float) -> None:
    """Set the query and key biases of decoder layers ``< layers`` to the prior's vector.
    Every other attention bias is zeroed, so it adds nothing.

    Raises:
        ValueError: the decoder was built without ``attention_bias``, or ``layers`` is not
            in ``[0, num_hidden_layers]``.
    """
    text = model.config.text_config
    decoder = model.model.language_model.layers
    if not getattr(text, "attention_bias", False):
        raise ValueError("the recency prior needs attention biases: build with attention_bias")
    if not 0 <= layers <= len(decoder):
        raise ValueError(f"layers must be in [0, {len(decoder)}], got {layers}")
    theta = float(text.rope_parameters["rope_theta"])
    b = _bias_vector(text.head_dim, theta, strength)
    with torch.no_grad():
        for i, layer in enumerate(decoder):
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.bias.zero_()
            if i < layers:
                heads_q = attn.q_proj.bias.numel() // text.head_dim
                heads_k = attn.k_proj.bias.numel() // text.head_dim
                attn.q_proj.bias.copy_(b.repeat(heads_q))
                attn.k_proj.bias.copy_(b.repeat(heads_k))


def prior_params(model) -> set[int]:
    """``id`` of every attention bias. They stay fixed in training: the prior's, and the
    zero ones it leaves."""
    ids = set()
    for layer in model.model.language_model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            if proj.bias is not None:
                ids.add(id(proj.bias))
    return ids
