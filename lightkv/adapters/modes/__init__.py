"""Session modes: where compression happens inside a `lightkv.adapters.CompressionSession`,
one small registered class per place (see `base` for the protocol, and the guide "Add a
compression mode").

Each mode, by name (its module; where it compresses; what chooses it):

- ``sequence`` (`sequence`): every layer: masks, positions and cache holes of the current
  sequence; always on.
- ``pre_llm`` (`pre_llm`): a stage on the embeddings, before decoder layer 0; chosen by
  ``StageSpec.mode``.
- ``layer`` (`layer`): a stage on a decoder layer's output; chosen by ``StageSpec.mode`` (the
  default).
- ``cache`` (`cache`): a stage on a layer's cached keys and values after its prefill; chosen
  by ``StageSpec.mode``.
- ``h2o`` (`h2o`): eviction of cache entries after the prefill and each decoding step; chosen
  by ``Pipeline.mode`` (`H2OMode`, with its settings).
- ``tower`` (`tower`): the vision tower's attention, for relevance that reads it; chosen by a
  relevance policy's ``reads_tower``.
"""

from . import cache, h2o, layer, pre_llm, sequence, tower  # noqa: F401  (each registers its mode)
from .base import LayerCall, Mode, SessionContext, choose_modes
from .cache import CacheEntriesMode
from .h2o import H2OMode, evict

__all__ = [
    "CacheEntriesMode",
    "H2OMode",
    "LayerCall",
    "Mode",
    "SessionContext",
    "choose_modes",
    "evict",
]
