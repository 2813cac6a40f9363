"""torch.compile, one decoder layer at a time (regional compilation, as torchtitan does).

Compiling each layer rather than the whole model keeps start-up short: every layer of a chunk has the
same code and shapes, so Dynamo compiles the first and reuses that graph for the others (their
parameters are inputs to it, not constants), and a pipeline stage compiles only what it holds. The
layer is compiled in place (`nn.Module.compile`): its parameters, names and state-dict keys stay Hugging
Face's, and the data-parallel hooks on its parameters are untouched.

Order (parallelize.py): after tensor parallelism, context parallelism and recompute have given each
layer its final code, before data parallelism, which wraps the whole chunk and whose gradient hooks
run outside the compiled code. What Dynamo cannot trace (the collectives inside tensor parallelism's
and ring attention's autograd Functions) runs eagerly between compiled pieces (a graph break), so every
layout compiles; the matmuls, norms, RoPE and SwiGLU between them are fused by Inductor. An MoE layer's
dispatch (models/moe.py), whose shapes follow the routing, is marked to run eagerly, so a new routing
recompiles nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from tetron.models.spec import spec_of

# Inductor, torch.compile's default; a test that checks what Dynamo traces, not the kernels Inductor makes from it,
# sets "aot_eager" here before its ranks start (compiling C++ for every graph costs seconds each on a CPU).
BACKEND = "inductor"


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """Compile every decoder layer this chunk holds, in place (`train.compile`)."""
    if not enabled:
        return model
    for layer in spec_of(model.config).plan.layers_of(model).values():
        # dynamic=False: every step has the same shapes; a new shape recompiles rather than
        # generalising the graph, which would cost speed for nothing here.
        layer.compile(dynamic=False, backend=BACKEND)
    return model


def reset_compiled() -> None:
    """Forget every compiled graph (between benchmark runs of different models in one process, so that
    Dynamo's cache limit is not reached by graphs that will never run again)."""
    torch.compiler.reset()
