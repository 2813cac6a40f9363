"""Every private PyTorch API tetron calls, in one place, each behind a plain function with a public fallback.

PyTorch's fastest paths are often private: the grouped matmul of MoE experts, the fused attention kernels
that return the log-sum-exp ring attention merges blocks with, the autograd engine's own entry point (a
backward from a released output, or from the middle of a graph), swapping two storages' memory, the
batched `_foreach` kernels. Their names and signatures may change in any release. So nothing else in tetron
names them: each capability here is one function that checks once whether this torch has the API (its
version and the API's presence), calls it when it does, and otherwise runs the same computation with public
PyTorch (a loop of matmuls, plain-math attention with its log-sum-exp, `torch.autograd.backward` over
gradient edges, one kernel per tensor). Each function with a public path takes `fallback=True` to run it even
where the private one exists (tests/test_torch_private.py checks the two agree); swap_storages' public path is
its caller's (StoragePool(reuse=False) resizes), and queue_after_backward has none (it says so when absent).

    grouped.py     torch._grouped_mm                                   -> a matmul per group
    attention.py   aten._scaled_dot_product_flash_attention_for_cpu,   -> plain-math attention with lse
                   CUDA's _scaled_dot_product_flash/efficient_attention (and each one's backward)
    autograd.py    Variable._execution_engine.run_backward,             -> torch.autograd.backward / grad
                   .queue_callback, torch._C._current_graph_task_id,      over gradient edges
                   torch._C._will_engine_execute_node,
                   UntypedStorage._swap_data_ptr_, torch._foreach_*,     (see each function for the rest)
                   torch._subclasses' is_fake, torch.utils._pytree's tree_leaves,
                   OpOverload._opname, Tensor._base and _version, torch.utils._python_dispatch
    fake.py        FakeTensorMode, the `fake` process group's FakeStore,   -> none: `tetron plan --dry-run` says
                   MemTracker, FlopCounterMode's module tracker              which is missing, in one line

This package sits on the ground floor: models, parallel, observe and plan may all import it.
"""

from tetron.torch_private.attention import (
    LSE_ALIGN,
    cpu_flash_attention,
    cpu_flash_attention_backward,
    cuda_efficient_attention,
    cuda_efficient_attention_backward,
    cuda_flash_attention,
    cuda_flash_attention_backward,
    math_attention,
    math_attention_backward,
)
from tetron.torch_private.autograd import (
    TorchDispatchMode,
    engine_runs,
    foreach_norm,
    foreach_scale_,
    in_backward,
    is_fake,
    is_view,
    op_name,
    queue_after_backward,
    run_backward,
    storage_swap_available,
    swap_storages,
    tree_leaves,
    version,
    view_base,
    wrapped_tensors,
)
from tetron.torch_private.grouped import grouped_mm, grouped_mm_available
from tetron.torch_private.version import TORCH_VERSION, torch_at_least

__all__ = [
    "LSE_ALIGN", "TORCH_VERSION", "cpu_flash_attention", "cpu_flash_attention_backward", "cuda_efficient_attention",
    "cuda_efficient_attention_backward", "cuda_flash_attention", "cuda_flash_attention_backward", "engine_runs",
    "foreach_norm", "foreach_scale_", "grouped_mm", "grouped_mm_available", "in_backward", "is_fake", "is_view",
    "math_attention", "math_attention_backward", "op_name", "queue_after_backward", "run_backward",
    "storage_swap_available", "swap_storages", "torch_at_least", "tree_leaves", "TorchDispatchMode", "version",
    "view_base", "wrapped_tensors",
]
