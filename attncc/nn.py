"""attncc.nn.Attention: an attention variant as a torch.nn.Module.

The tensors a variant's mods read (its captures) become the module's state, as the very tensor
objects the mods close over, so the kernels, the optimizer, ``.to()`` and ``state_dict`` all see
one tensor:

    parameter  a capture that is an nn.Parameter, or a float leaf tensor created with
               requires_grad=True (attncc marks that tensor itself as a parameter)
    buffer     every other capture (ALiBi slopes without grad, document ids, ...), not saved
               in state_dict: it is part of how the variant was built

``.to(device)``, ``.half()`` etc. move the buffers in place (``t.data = ...``, as torch does for
parameters), so the mods keep reading the module's tensors.
"""
from __future__ import annotations

import torch

from . import autograd
from .api import CompiledAttention
from .errors import AttnccError
from .variant import Variant

LAYOUTS = ("bhld", "blhd")


class Attention(torch.nn.Module):
    """Attention of an attncc variant as a module.

    ``Attention(variant, layout="bhld")``; ``forward(query, key, value)`` takes query
    (B, Hq, Lq, D), key (B, Hkv, Lkv, D) and value (B, Hkv, Lkv, Dv) -- or (B, L, H, D) each with
    ``layout="blhd"`` -- and returns the output in the same layout. Hq may be a multiple of Hkv
    (GQA/MQA). The variant's dropout applies in training mode only (``module.eval()`` turns it
    off); its mask comes from torch's default generator, so torch.manual_seed reproduces it.

    Under ``torch.compile(fullgraph=True)`` a forward is one ``attncc::attention`` op: no graph
    break, and lengths can be dynamic.
    """

    def __init__(self, variant, *, layout: str = "bhld"):
        super().__init__()
        if isinstance(variant, CompiledAttention):
            compiled = variant
        elif isinstance(variant, Variant):
            compiled = CompiledAttention(variant)
        else:
            raise AttnccError(f"attncc.nn.Attention takes an attncc.Variant (or attncc.compile(variant)), "
                              f"got {type(variant).__name__}")
        if layout not in LAYOUTS:
            raise AttnccError(f"layout must be 'bhld' (batch, heads, length, dim) or 'blhd' (batch, length, "
                              f"heads, dim), got {layout!r}")
        self.compiled = compiled
        self.layout = layout
        self._capture_names = []  # attribute name of capture i
        self._buffer_names = []
        for i, c in enumerate(compiled.variant.captures):
            name = self._name_for(c.name, i)
            t = c.tensor
            if t.is_floating_point() and t.requires_grad and not isinstance(t, torch.nn.Parameter):
                if not t.is_leaf:
                    raise AttnccError(
                        f"captured tensor {c!r} is computed from tensors that require grad, so it cannot be a "
                        "parameter of the module: capture a leaf (create it with requires_grad=True, or as an "
                        "nn.Parameter), or .detach() it")
                t._is_param = True  # isinstance(t, nn.Parameter) is now True: the same object is the parameter
                if not isinstance(t, torch.nn.Parameter):  # a torch without this protocol
                    raise AttnccError(f"captured tensor {c!r} requires grad: create it as torch.nn.Parameter(...) "
                                      "so that it can be the module's parameter")
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t, persistent=False)
                self._buffer_names.append(name)
            self._capture_names.append(name)

    def _name_for(self, name, i: int) -> str:
        if name and name.isidentifier() and not name.startswith("_") and not hasattr(self, name):
            return name
        return f"cap{i}"

    @property
    def variant(self) -> Variant:
        return self.compiled.variant

    def forward(self, query, key, value):
        blhd = self.layout == "blhd"
        if blhd:
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        captures = [getattr(self, name) for name in self._capture_names]
        out, _ = autograd.attend(self.compiled, query, key, value, captures, enable_gqa=True,
                                 training=self.training)
        return out.transpose(1, 2) if blhd else out

    def _apply(self, fn, *args, **kwargs):
        before = {name: self._buffers[name] for name in self._buffer_names}
        result = super()._apply(fn, *args, **kwargs)
        for name, tensor in before.items():
            moved = self._buffers[name]
            if moved is not tensor:  # keep the object the mods read; give it the moved contents
                tensor.data = moved
                self._buffers[name] = tensor
        return result

    def __setstate__(self, state):
        super().__setstate__(state)
        autograd.register(self.compiled)  # a copy (copy.deepcopy, pickle) is findable by the op too

    def extra_repr(self) -> str:
        v = self.variant
        return f"variant={v.name!r}, layout={self.layout!r}, scale={v.scale}, dropout_p={v.dropout_p}"
