"""`tetron tokenize` against the same tokenizer driven by `datasets.map(num_proc=N)`: tokens/s at 1 and 2
processes, the same tokens bit for bit, and peak memory as the input doubles.

The input is the standard library's modules as .jsonl documents, repeated to --mb MB. Each run is a
fresh subprocess (its time includes starting, reading the .jsonl and writing the tokens; its peak
memory is the largest ru_maxrss among it and its worker processes). tetron writes a token store;
the peer loads the .jsonl with `load_dataset("json")`, maps the tokenizer over batches with num_proc
processes and writes the ids to one flat file, which must equal the store's shards concatenated.
Each configuration runs --rounds times, interleaved; medians are reported (the machine is shared:
timings vary run to run).

    python bench/tokenizing.py [--mb 8] [--rounds 3] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TETRON = """
import resource, sys, time
from pathlib import Path
from tetron.data.store_build import build_store
from tetron.data.tokenizer import load_tokenizer
src, tok_dir, out, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = load_tokenizer(tok_dir, data_spec=None, cache_dir=Path(tok_dir))
start = time.perf_counter()
index = build_store(src, tok, Path(out), workers=workers, shard_mb=float(sys.argv[5]))
secs = time.perf_counter() - start
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(f"{index['num_tokens']} {secs} {rss}")
"""

DATASETS = """
import resource, sys, time
import numpy as np
src, tok_dir, out, workers, cache = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
start = time.perf_counter()
import datasets
datasets.disable_caching()  # every run maps for real (a fresh cache folder too: no reused .arrow)
from tokenizers import Tokenizer
tok = Tokenizer.from_file(tok_dir + "/tokenizer.json")
eos = 0

def encode(batch):
    return {"ids": [e.ids + [eos] for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)
ds = ds.map(encode, batched=True, batch_size=256, num_proc=workers if workers > 1 else None,
            remove_columns=ds.column_names)
n = 0
with open(out, "wb") as f:
    for batch in ds.with_format("numpy").iter(batch_size=1024):
        arr = np.concatenate(batch["ids"]).astype(np.uint16)
        arr.tofile(f)
        n += arr.size
secs = time.perf_counter() - start
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(f"{n} {secs} {rss}")
"""


def make_input(path: Path, mb: float) -> int:
    """The stdlib's modules as .jsonl lines, repeated until `mb` MB; returns the bytes written."""
    from tetron.data.sources import iter_texts

    lines = [json.dumps({"text": t}) + "\n" for t in iter_texts("stdlib")]
    want, size = int(mb * 2**20), 0
    with open(path, "w") as f:
        while size < want:
            for line in lines:
                f.write(line)
                size += len(line.encode())
                if size >= want:
                    break
    return size


def run(code: str, *args: str) -> tuple[int, float, int]:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"benchmark run failed:\n{out.stderr[-3000:]}")
    n, secs, rss = out.stdout.split()[-3:]
    return int(n), float(secs), int(rss)


def store_digest(folder: Path) -> str:
    index = json.loads((folder / "index.json").read_text())
    h = hashlib.sha256()
    for s in index["shards"]:
        h.update((folder / f"{s['name']}.bin").read_bytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="input size in MB (the memory check also uses 2x)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    from tetron.data.tokenizer import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tok = load_tokenizer("bpe:4096", data_spec="stdlib", cache_dir=tmp / "cache", max_bytes=4_000_000)
        tok.save(tmp / "tok")
        assert tok.eos_id == 0
        inputs = {1: tmp / "in1.jsonl", 2: tmp / "in2.jsonl"}
        size = make_input(inputs[1], args.mb)
        make_input(inputs[2], 2 * args.mb)
        shard_mb = max(args.mb / 8, 1.0)  # units enough for 2 workers; few shards (each is synced)
        print(f"input: {size / 2**20:.1f} MB of .jsonl (stdlib repeated); tokenizer: byte-level BPE of 4096; "
              f"{args.rounds} rounds, medians (shared machine: timings are noisy)")
        times: dict[tuple[str, int], list[float]] = {}
        rss: dict[tuple[str, int, int], int] = {}
        tokens = 0
        for r in range(args.rounds):
            for w in args.workers:
                out = tmp / f"store-{r}-{w}"
                tokens, secs, peak = run(TETRON, str(inputs[1]), str(tmp / "tok"), str(out), str(w), str(shard_mb))
                times.setdefault(("tetron", w), []).append(secs)
                rss[("tetron", w, 1)] = max(rss.get(("tetron", w, 1), 0), peak)
                flat = tmp / f"flat-{r}-{w}.bin"
                n, secs, peak = run(DATASETS, str(inputs[1]), str(tmp / "tok"), str(flat), str(w),
                                    str(tmp / f"hf-{r}-{w}"))
                times.setdefault(("datasets", w), []).append(secs)
                rss[("datasets", w, 1)] = max(rss.get(("datasets", w, 1), 0), peak)
                digest = hashlib.sha256(flat.read_bytes()).hexdigest()
                assert n == tokens and digest == store_digest(out), "datasets.map and tetron gave other tokens"
                flat.unlink()
        for w in args.workers:  # the same at twice the input: peak memory should not grow
            _, _, rss[("tetron", w, 2)] = run(TETRON, str(inputs[2]), str(tmp / "tok"), str(tmp / f"big-{w}"),
                                              str(w), str(shard_mb))
        print(f"tokens: {tokens:,} (identical bytes from both)")
        print(f"{'processes':>9} {'tetron tok/s':>13} {'datasets tok/s':>15} {'ratio':>6} "
              f"{'tetron peak MB (1x, 2x input)':>30} {'datasets peak MB':>17}")
        for w in args.workers:
            ours = tokens / statistics.median(times[("tetron", w)])
            theirs = tokens / statistics.median(times[("datasets", w)])
            print(f"{w:>9} {ours:>13,.0f} {theirs:>15,.0f} {ours / theirs:>6.2f} "
                  f"{rss[('tetron', w, 1)] / 1024:>14.0f}, {rss[('tetron', w, 2)] / 1024:<14.0f} "
                  f"{rss[('datasets', w, 1)] / 1024:>17.0f}")


if __name__ == "__main__":
    main()
