"""Data-dependent checks on meta tensors, answered as for a plain training batch.

A meta tensor has a shape but no values, so Python control flow that asks one for a truth value raises
("Tensor.item() cannot be called on meta tensors"). Hugging Face's modeling code asks such questions of the
batch before building attention masks: whether the position ids hold one sequence per row
(``masking_utils.find_packed_sequence_indices``: ``(packed[:, -1] == 0).all()``) and whether a padding mask
masks nothing (``_ignore_causal_mask_sdpa``: ``padding_mask.all()``). freqopt traces batches of full, unpadded,
unpacked sequences, for which both answers are yes. ``MetaChecks``, a TorchFunctionMode active while freqopt
traces, therefore answers ``bool(t)`` of a one-element boolean meta tensor with True; every other use of a meta
tensor's value still raises. The small kernels computing the check (diff, cumsum, eq, all) are traced as usual;
the host sync that reading the answer costs on a GPU is not a kernel and is not traced.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["MetaChecks"]


class MetaChecks(TorchFunctionMode):
    """While active, ``bool(t)`` of a one-element ``torch.bool`` tensor on the meta device is True (see the
    module docstring); everything else runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args:
            t = args[0]
            if isinstance(t, torch.Tensor) and t.device.type == "meta" and t.dtype == torch.bool and t.numel() == 1:
                return True
        return func(*args, **kwargs)
