"""`python -m tetron.torchrun [torchrun's arguments]`: torchrun, except that a stop signal after which the ranks
saved ends it with exit status 0, as `tetron train`'s own launcher does (torchrun itself exits 1, with a
traceback, whenever it was signalled: a scheduler would count a clean preemption as a failure).

torch's agent turns SIGTERM, SIGINT or SIGHUP into a SignalException: it passes the signal on to the ranks,
which finish their step and save together (stop.py), waits for them, then raises it. The first rank of each
node notes the save in the file that STOPPED_FILE_ENV names (launch.py); a SignalException after that note
is a clean stop. `tetron slurm` starts each node's ranks through this module.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

STOPPED_FILE_ENV = "TETRON_STOPPED_FILE"  # set here for the ranks; the first rank of the node writes it


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    with tempfile.TemporaryDirectory(prefix="tetron-torchrun-") as folder:
        note = Path(folder) / "stopped"
        os.environ[STOPPED_FILE_ENV] = str(note)  # this process is the node's launcher: its ranks inherit it
        try:
            torchrun(sys.argv[1:] if argv is None else argv)
        except SignalException:
            if not note.is_file():  # the ranks did not save: a failure, as torchrun says
                raise
    return 0  # the ranks' own last line (stop.stopped_line) said where they saved


if __name__ == "__main__":
    sys.exit(main())
