"""attncc: compile attention variants written as FlexAttention-style mods into FlashAttention
kernels (Triton). Public API only; see README.md."""
__version__ = "0.1.0"

from . import ir, reference  # noqa: E402
from .api import (CompiledAttention, attention, attention_varlen, attention_with_kvcache,  # noqa: E402
                  compile, dropout_mask)
from .inference import merge_states  # noqa: E402
from .kvcache import KVCache, PagedKVCache  # noqa: E402
from .errors import AttnccError, ModTraceError  # noqa: E402
from .flex import flex_attention  # noqa: E402
from .variant import Variant  # noqa: E402
from . import nn  # noqa: E402,F401  (attncc.nn.Attention)
from . import distributed  # noqa: E402,F401  (attncc.distributed: context parallelism)

__all__ = ["attention", "compile", "dropout_mask", "Variant", "CompiledAttention", "AttnccError", "ModTraceError",
           "ir", "reference", "__version__", "attention_with_kvcache", "attention_varlen",
           "KVCache", "PagedKVCache", "merge_states", "nn", "flex_attention", "distributed"]
