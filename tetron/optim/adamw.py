"""AdamW (Loshchilov and Hutter), torch's kernel: decoupled weight decay on every weight of two or more dims
(matrices, the embedding, the head), none on vectors (norms, biases). Its settings are train.lr,
train.weight_decay, train.beta1, train.beta2 and train.eps."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tetron.config import OptimConfig, TrainConfig
from tetron.optim.base import Param, StateSpec, TorchOptimizer


class AdamW(TorchOptimizer):
    name = "adamw"
    state = (StateSpec("exp_avg"), StateSpec("exp_avg_sq"))  # the moments; checkpoints' names since the start
    tensor_bytes = 4  # its fp32 step counter per tensor

    def __init__(self, params: list[Param], train: TrainConfig, optim: OptimConfig | None = None) -> None:
        decay = [p.tensor for p in params if p.role != "vector"]
        keep = [p.tensor for p in params if p.role == "vector"]
        # The fused kernel (CPU and CUDA) is the fastest form (on this CPU 4x the for-loop, 7x foreach),
        # and it can skip a step on the device's word (found_inf), without the host waiting for it.
        self.fused = bool(params) and params[0].tensor.device.type in ("cpu", "cuda")
        inner = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                   {"params": keep, "weight_decay": 0.0}],
                                  lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps,
                                  **({"fused": True} if self.fused else {"foreach": True}))
        super().__init__(params, train, inner, skips_on_device=self.fused)

    def load_state(self, tensor: nn.Parameter, values: dict[str, Tensor], *, step: float) -> None:
        # the fused kernel keeps its step counter on the parameters' device, the others on the CPU
        self.inner.state[tensor] = {
            "step": torch.tensor(float(step), dtype=torch.float32, device=tensor.device if self.fused else "cpu"),
            **{name: values[name].clone().view_as(tensor) for name in self.state_names()},
        }
