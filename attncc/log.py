"""attncc's logger (``logging.getLogger('attncc')``), levelled by ATTNCC_LOG."""
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
