"""RMSNorm, computed in fp32 whatever the activation dtype (bf16 statistics drift over many layers).

With matching activation / weight dtypes (bf16 parameters, or fp32 everywhere) `F.rms_norm` is called directly: on
CUDA it dispatches to the fused kernel, which accumulates in fp32 and rounds the output once, so the fp32 result is
had without the `.float()` copy of x and the separate downcast pass. Mixed dtypes (bf16 activations under autocast
with fp32 weights) upcast x first: the fused kernel needs matching dtypes, and the composite fallback would make the
same copy internally and then run several unfused passes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps).to(x.dtype)  # .to: autocast may upcast
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(x.dtype)
