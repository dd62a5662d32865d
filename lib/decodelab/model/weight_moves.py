"""A count of the events that can put a module's weights into other tensor objects: `moves()`.

A C step that reads weights through a table of their addresses (`q4_stack.Q4Backbone`) may keep the
table, and the tensors it came from, while this count stands still. It goes up on:

- any module, parameter or buffer registered or assigned anywhere in the process (torch's global
  registration hooks, which `setattr`, `register_buffer`, `load_state_dict(assign=True)` and a
  replaced submodule go through);
- `moved()`, which the `_apply` of the block layers and the Q4 decoder layer call: `.to()`,
  `.half()`, `.float()` and `share_memory()` put new tensors in `_buffers` without registering them.

What it does not see is a tensor whose storage changes in place (`tensor.data = other`,
`tensor.set_()`): the object stays the same, so whoever keeps a table compares the addresses too.
"""

from __future__ import annotations

from torch.nn.modules import module as _module

_count = 0


def moved(*_event) -> None:
    """Count one event (a registration hook's arguments are ignored; it returns None, so the value
    registered stays as it was)."""
    global _count
    _count += 1


def moves() -> int:
    """How many events so far: a table built at one count is current while the count stays."""
    return _count


_HANDLES = (
    _module.register_module_module_registration_hook(moved),
    _module.register_module_parameter_registration_hook(moved),
    _module.register_module_buffer_registration_hook(moved),
)

__all__ = ["moved", "moves"]
