"""attncc: compile attention variants written as FlexAttention-style mods into FlashAttention
kernels (Triton). Public API only; see README.md."""
__version__ = "0.1.0"

from . import ir, reference  # noqa: E402
from .api import CompiledAttention, attention, compile, dropout_mask  # noqa: E402
from .errors import AttnccError, ModTraceError  # noqa: E402
from .variant import Variant  # noqa: E402
from . import nn  # noqa: E402  (attncc.nn.Attention)

__all__ = ["attention", "compile", "dropout_mask", "Variant", "CompiledAttention", "AttnccError", "ModTraceError",
           "ir", "reference", "__version__"]
