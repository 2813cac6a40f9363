"""Parallelism: one file per strategy, each a transformation of the plain model that reads its family's
parallel plan (models/spec.py), never its module names.

    parallelize.py         the recipe: every axis applied in order; the only caller of the apply_* functions
    layout.py              how each parameter is laid out (sharded along which axis and dim, tied copies)
    init.py                layout-independent initialisation: every rank fills its slices of the same tensors
    comm.py                the collectives as autograd functions (f and g)
    tensor_parallel.py     column/row-parallel linears, vocab-parallel embedding and loss, sequence parallel
    pipeline_parallel.py   stages, P2P, the schedule runner; pipeline_schedules.py: the schedules as data;
                           p2p_order.py: a deadlock-free message order; weight_grad.py: the B/W split
    context_parallel.py    ring attention (block_attention.py: the blocks' fused kernels); ulysses.py
    expert_parallel.py     MoE experts split over ep ranks, tokens to them and back by all-to-all;
                           moe_balance.py: the expert load and balancing figures over the ranks
    data_parallel.py       naive and bucketed gradient averaging; zero.py: ZeRO-1/2/3 and the sharded AdamW;
                           zero3.py: ZeRO-3's gathered and freed parameters
    recompute.py, compile.py, grads.py   activation recomputation, regional compile, gradient clipping
    timers.py              how long each axis's collectives wait (time_*_s)

Imports the ground floor, models, config and data (tetron/__init__.py's layers).
"""
