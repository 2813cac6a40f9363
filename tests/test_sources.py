"""The data-source seam (tetron/data/sources.py): a kind of source defined only here, registered here, trains
through the normal path (validate, tokenize into the cache, the loader) exactly as the same documents do from
a .jsonl file, and its bad spec is one line naming the field; the built-in kinds each claim their specs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from tetron.config import from_dict
from tetron.data import sources
from tetron.data.sources import Source, register_source, source_of
from tetron.errors import ConfigError, DataError
from tetron.validate import validate

from conftest import STEPS, cli_in_process, run_training, tiny_config


def _verses(n: int) -> list[str]:
    return [f"verse {i}: " + " ".join(f"w{(i * 7 + j) % 13}" for j in range(i % 9 + 3)) for i in range(n)]


class Verses(Source):
    """`verses:N`: N generated documents, as a new kind of source would bring them (nothing on disk)."""

    @classmethod
    def claims(cls, spec: str) -> bool:
        return spec.startswith("verses:")

    def count(self) -> int:
        n = self.spec.removeprefix("verses:")
        if not n.isdigit() or int(n) < 1:
            raise DataError(f"data: {self.spec}: give verses:N with N >= 1")
        return int(n)

    def check(self) -> None:
        self.count()

    def documents(self, *, text_field: str, skip: Any, max_bytes: int | None) -> Iterator[str]:
        return iter(_verses(self.count()))

    def identify(self, h: Any, *, text_field: str, hash_contents: bool, by_text: bool) -> bool:
        h.update(f"verses:{self.count()}".encode())
        return True


@pytest.fixture
def verses(monkeypatch: pytest.MonkeyPatch) -> type[Source]:
    """Verses registered for this test only (forked ranks inherit the registry)."""
    monkeypatch.setattr(sources, "KINDS", list(sources.KINDS))
    return register_source(Verses)


def test_a_source_defined_in_a_test_trains_like_the_same_documents_from_a_file(verses, cache_dir: Path,
                                                                                  tmp_path: Path) -> None:
    jsonl = tmp_path / "verses.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in _verses(300)))
    mine = run_training(tiny_config(Path("verses:300"), cache_dir, tmp_path / "run"))
    reference = run_training(tiny_config(jsonl, cache_dir, tmp_path / "ref"))
    assert len(mine) == len(reference) == STEPS
    assert mine == reference  # the same tokens in the same order: the same batches, bit for bit
    assert isinstance(source_of("verses:300"), Verses)


def test_a_bad_spec_of_a_registered_kind_is_one_line_naming_the_field(verses, corpus: Path, cache_dir: Path,
                                                                       tmp_path: Path) -> None:
    raw = tiny_config(corpus, cache_dir, tmp_path / "run", data={"path": "verses:none"})
    with pytest.raises(ConfigError, match=r"^data\.path=verses:none: data: verses:none: give verses:N with N >= 1$"):
        validate(from_dict(raw))
    bad_val = tiny_config(corpus, cache_dir, tmp_path / "run", data={"val_path": "verses:0"},
                          train={"eval_every": 2})
    with pytest.raises(ConfigError, match=r"^data\.val_path=verses:0: "):
        validate(from_dict(bad_val))
    done = cli_in_process(["train", "--data.path=verses:x", "--model", "demo", f"--out={tmp_path / 'cli'}",
                           "--data.tokenizer=bytes"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["tetron: error: data.path=verses:x: data: verses:x: give verses:N "
                                                "with N >= 1"], done.stderr


def test_each_built_in_kind_claims_its_specs(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    (store / "index.json").write_text("{}")
    kinds = {spec: type(source_of(spec)).__name__ for spec in
             ["stdlib", "hf:org/name", "hf:org/name:cfg:train", str(store), str(tmp_path / "a.txt"), "x/*.jsonl"]}
    assert kinds == {"stdlib": "Stdlib", "hf:org/name": "HFDataset", "hf:org/name:cfg:train": "HFDataset",
                     str(store): "TokenStoreSource", str(tmp_path / "a.txt"): "TextFiles", "x/*.jsonl": "TextFiles"}
    assert source_of(str(store)).tokenized and not source_of("stdlib").tokenized
    with pytest.raises(DataError, match="holds tokens, not text"):
        list(sources.iter_texts(str(store)))
    with pytest.raises(DataError, match="cannot parse hf:"):
        source_of("hf:").check()
