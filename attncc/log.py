"""attncc's logger (``logging.getLogger('attncc')``), levelled by ATTNCC_LOG.

With ATTNCC_LOG=info|debug attncc logs to stderr by itself; without it the logger is left to the
application (``logging.getLogger("attncc").setLevel(logging.INFO)`` plus any handler). What is
logged:

    INFO   sympy passes of a variant (ms), each generated kernel source (cache miss, ms), the
           first launch of each generated module (Triton compile, s), tile shrinking after an
           out-of-resources failure
    DEBUG  kernel cache hits, modules loaded, tile choices (which table entry, ATTNCC_TILES
           override, data-dependent-mask tiles, shrink level)
"""
import logging

from . import config

logger = logging.getLogger("attncc")
_level = config.log_level()
if _level is not None:
    logger.setLevel(_level)
    if not logger.handlers:
        _h = logging.StreamHandler()
        _h.setFormatter(logging.Formatter("[attncc %(levelname)s] %(message)s"))
        logger.addHandler(_h)
