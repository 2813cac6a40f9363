"""Observing a run without changing it: what each step reports and where it goes.

    metrics.py       the progress bar, metrics.jsonl, MFU
    sinks.py         TensorBoard and Weights & Biases
    step_report.py   a step's figures read back from the device, the non-finite check, the Reporter
    watchers.py      around each step: the per-axis timers, the profiler
    evaluate.py      validation loss in any layout
    memory.py        measured memory: state bytes by kind, live activations
    profiling.py     torch.profiler traces of chosen steps
    report.py        `tetron report`: plots and a summary of runs
    generate.py      sampling a trained model (KV cache), `tetron generate`
    rank_logs.py     each rank's output in OUT/logs
    watch.py         the launcher's view of its ranks, and the one line a run ends with

Imports everything below train (tetron/__init__.py's layers).
"""
