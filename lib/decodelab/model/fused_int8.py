"""Int8 weights for the compiled decode step: every linear layer, the lm_head included.

Batch-1 decode on a CPU is bound by memory: every weight byte crosses the memory bus once
per token. An int8 weight is a quarter of a float32 one, but only if the multiply reads the
int8 bytes themselves. `Int8Linear` (decodelab.model.quantization) does when it runs under
`torch.compile`: it writes the product of a row as a plain sum,

    y[..., o] = (sum_i x[..., i] * float(weight_q[o, i])) * weight_scale[o] + bias[o],

which inductor's C++ backend turns into one vectorized loop over the int8 bytes: convert,
multiply, add, with no float copy of the weight anywhere. Eager code (the prefill, which runs
once per request) takes its block-of-rows form. Both give the same numbers up to float
rounding order.

`quantize_for_decode(model)` differs from `quantize_model` (decoder layers only, as the course's
engine does) in that it swaps the lm_head too: the lm_head is a fifth of SmolLM2's bytes, so it
is quantized as well (its tied embedding stays float, as a lookup table it reads one row per
token).
"""
from __future__ import annotations

from torch import nn

from decodelab.model.quantization import Int8Linear


def quantize_for_decode(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in `model` (decoder layers and lm_head) by an `Int8Linear`,
    in place; returns the model. A tied embedding keeps its float weight for the lookup."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, linear in targets:
        setattr(parent, name, Int8Linear.from_linear(linear))
    return model
