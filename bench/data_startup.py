"""Start-up to the first step: the demo (stdlib, ~31 MB, cached) against a cached token store of --gb GB.

The store is made once with `tetron tokenize` (bytes tokenizer: text files of the stdlib repeated).
Then `tetron train configs/demo.yaml` runs --rounds times on each, interleaved, and the time from the
command's start to the first line of OUT/metrics.jsonl (step 1 done) is recorded; the run is then
stopped. Medians are printed (the machine is shared: timings are noisy).

    python bench/data_startup.py [--gb 1.1] [--rounds 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TETRON = [sys.executable, "-m", "tetron.cli"]


def make_text(folder: Path, gb: float) -> None:
    """Text files of 64 MB each, the stdlib's modules repeated, until `gb` GB."""
    from tetron.data.sources import iter_texts

    folder.mkdir(parents=True, exist_ok=True)
    text = "\n".join(iter_texts("stdlib")).encode()
    block = (text * (64 * 2**20 // len(text) + 1))[: 64 * 2**20]
    for i in range(int(gb * 2**30) // len(block) + 1):
        (folder / f"part-{i:03d}.txt").write_bytes(block)


def first_step_s(args: list[str], out: Path) -> float:
    """Seconds from starting `tetron train ARGS` to its first metrics line; the run is then stopped."""
    start = time.perf_counter()
    proc = subprocess.Popen([*TETRON, "train", *args, "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True, text=True)
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.stat().st_size > 0):
        if proc.poll() is not None:
            raise SystemExit(f"tetron train failed: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    secs = time.perf_counter() - start
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return secs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.1, help="text to tokenize into the store (the store: 2x, uint16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", default=None, help="a folder for the text and the store, kept between runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        root = Path(args.keep or tmp_name)
        store = root / "store"
        if not (store / "index.json").exists():
            make_text(root / "text", args.gb)
            start = time.perf_counter()
            subprocess.run([*TETRON, "tokenize", str(root / "text"), "--tokenizer", "bytes", "--out", str(store)],
                           cwd=REPO, check=True)
            print(f"tokenized {args.gb} GB with bytes in {time.perf_counter() - start:.0f} s")
        size = sum(p.stat().st_size for p in store.glob("*.bin"))
        demo = ["configs/demo.yaml", "--steps", "1000", "--logging.progress=false"]
        cases = {"demo (stdlib, cached)": demo,
                 f"store of {size / 2**30:.2f} GiB": [*demo, "--data.path", str(store), "--data.tokenizer", "null"]}
        first_step_s(demo, root / "warm")  # the demo's tokenizer and tokens, cached
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name, case in cases.items():
                times[name].append(first_step_s(case, root / f"run-{r}-{len(times[name])}-{hash(name) % 997}"))
        for name, t in times.items():
            print(f"{name:>28}: start to first step {statistics.median(t):5.1f} s (median of {len(t)}: "
                  f"{', '.join(f'{x:.1f}' for x in t)})")


if __name__ == "__main__":
    main()
