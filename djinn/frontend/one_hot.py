"""``F.one_hot`` on the remote device, laid out as local eager's.

Note [one-hot layout]: ``one_hot`` is composite, with two bodies: on the CPU it fills
``zeros(..., num_classes)`` by ``scatter_``, contiguous whatever its input's layout; on
any other device (CUDA, this one) it compares ``index.unsqueeze(-1) == arange(...)``,
whose output takes its input's strides. Of a transposed index (``Categorical.sample``
transposes: ``OneHotCategorical(...).sample((2,))``) the remote result was not
contiguous, and ``.view(-1)``, which eager's allows, raised. So the remote device runs the
CPU's body, registered on the autograd key above the composite. The CPU body also reads
the index's minimum and maximum to check them; here an index out of range is refused by
``scatter_``'s own bounds check, when the result is read, with no read of its own unless
``num_classes`` is left to the data (-1), as eager reads it too.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def one_hot(self: Tensor, num_classes: int = -1) -> Tensor:
    if self.dtype != torch.long:
        raise RuntimeError("one_hot is only applicable to index tensor of type LongTensor.")
    shape = list(self.shape)
    if self.numel() == 0:
        if num_classes <= 0:
            raise RuntimeError("Can not infer total number of classes from empty tensor.")
        return torch.empty([*shape, num_classes], dtype=torch.long, device=self.device)
    if num_classes == -1:
        num_classes = int(self.max()) + 1
    elif num_classes < 1:
        raise RuntimeError("num_classes should be positive")
    out = torch.zeros([*shape, num_classes], dtype=torch.long, device=self.device)
    return out.scatter_(-1, self.unsqueeze(-1), 1)


KERNELS = {"one_hot": one_hot}
