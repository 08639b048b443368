"""Render a KernelPlan through the Jinja templates into Triton source: a pure function."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jinja2

    from .plan import KernelPlan

TEMPLATES = {"fwd": "attn_fwd.py.jinja", "bwd": "attn_bwd.py.jinja", "kv": "attn_kv.py.jinja"}
# the Gluon tier's templates (attncc.tiers), by kernel; the inference kernels have none
GLUON_TEMPLATES = {"fwd": "sm90/attn_fwd.py.jinja", "bwd": "sm90/attn_bwd.py.jinja"}


def template_dir() -> Path:
    """templates/ beside the package (source checkout) or inside it (installed wheel)."""
    here = Path(__file__).resolve().parent
    for d in (here / "templates", here.parent / "templates"):
        if (d / "header.py.jinja").is_file():
            return d
    raise FileNotFoundError(f"attncc templates not found next to {here}; reinstall attncc")


@lru_cache(maxsize=4)
def _env(templates: str | None = None) -> jinja2.Environment:
    import jinja2
    return jinja2.Environment(loader=jinja2.FileSystemLoader(templates or str(template_dir())),
                              undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              autoescape=False)


def render(plan: KernelPlan, templates: str | None = None) -> str:
    """The kernel source of ``plan``, from attncc's templates/ or, for the Gluon probes' A/B against
    an earlier commit, another such folder (``templates``)."""
    name = GLUON_TEMPLATES[plan.kernel] if plan.tier == "gluon" else TEMPLATES[plan.kernel]
    return _env(templates).get_template(name).render(plan=plan)
