"""Planning a layout before spending GPU hours: what each rank will hold and how long a step will take.

    memory.py    the memory model: one rank's peak, term by term, over the moments of a step
    walk.py      ... a rank's micro-batches through the schedule: what each moment of the step holds
    steptime.py  the time model: compute at an efficiency figure, communication per axis, the bubble
    hardware.py  the devices a plan is for (GPUs by name, this CPU measured)
    search.py    every layout validate() accepts, predicted and ranked
    measure.py   one layout run for a few steps here: per-rank peak memory and step time
    fit.py       `tetron train`'s refusal of a layout that will not fit
    report.py    `tetron plan`: the request, the table, --json, --write, --measure
    slurm.py     `tetron slurm`: job.sh and node.sh for an allocation, sbatch

Imports everything below cli (tetron/__init__.py's layers): it runs layouts (measure) and validates them.
"""
