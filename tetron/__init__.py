"""tetron: train decoder language models across many processes on plain torch.distributed.

The layers, bottom to top. A module imports only from its own layer and the layers below it, and no two
packages import each other (tests/test_structure.py reads this list and checks every import against it):

    1. errors, fs, folder_lock, device, mesh, stop, torch_private: the ground floor (one-line errors; safe files
       and the run folder; one writer per folder; the one place that touches CUDA; the process mesh; stop signals;
       every private torch API, each with its public fallback)
    2. models: model families (a plain single-device model each, its config, its ModelSpec), attention, loss
    3. config, overrides, schedule: the run's config, its command-line overrides, learning-rate schedules
    4. data: sources, tokenizers, token stores, mixtures, the batches of a step
    5. optim: optimizers (AdamW), the parameter groups and state they declare, their step on local tensors
    6. parallel: one file per strategy, reading each family's parallel plan; parallelize() applies them (ZeRO
       shards whatever state the optimizer declares)
    7. checkpoint: save (model folders transformers loads), load by slices, checks, conversion
    8. observe: metrics and sinks, validation, timers' reports, memory, profiles, samples, the launcher's watch
    9. train, validate, launch: the loop, the checks before start, starting ranks
   10. plan: the memory and step-time model, layout search, the fit check, Slurm job scripts
   11. cli: the `tetron` command
"""
