"""The exceptions attncc raises for bad input: each names the problem and the fix."""


class AttnccError(ValueError):
    """Invalid input to attncc: a shape, dtype, device, argument or mod attncc cannot use."""


class ModTraceError(AttnccError):
    """A score_mod or mask_mod uses Python that cannot be traced into the attncc IR."""
