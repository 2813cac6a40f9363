"""Tokenizers: plain bytes, a byte-level BPE trained on the data (and cached), or any Hugging Face
tokenizer; all behind one small `Tokenizer` that encodes documents whole and saves to a folder that
both tetron and transformers load."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

from tetron.data.hub import hub_problem
from tetron.data.sources import BadRecords, data_fingerprint, iter_texts
from tetron.errors import DataError
from tetron.fs import read_bounded, replace_folder, temp_name, write_json

EOS_TOKEN = "<|endoftext|>"
MAX_TOKENIZER_BYTES = 1 << 30  # the largest tokenizer.json read (the largest real ones are tens of MB)
# The bytes tokenizer's padding id, for transformers' collators: byte 0xFF, which UTF-8 text never holds, so no
# text's ids change; its token is named in tokenizer.json (as no byte's character, no text's piece can be it).
BYTES_PAD_ID, BYTES_PAD_TOKEN = 255, "<|pad|>"
# Model types for which transformers 5's AutoTokenizer ignores a folder's tokenizer_class and builds its own class,
# which keeps tokenizer.json's vocabulary and merges but not its normalizer and split (qwen2: Qwen2Tokenizer, NFC
# and Qwen's regex), so that other tokenizers' ids change; its loader takes tokenizer.json as written when the
# folder's tokenizer_config.json says trust_remote_code (no code is named, nothing runs: there is no auto_map).
REBUILT_BY_TRANSFORMERS = frozenset({"qwen2"})


class Tokenizer:
    """Plain bytes (backend None) or a Hugging Face `tokenizers.Tokenizer`, with its EOS id."""

    def __init__(self, backend: Any | None = None, eos_id: int | None = None, *, vocab_size: int | None = None) -> None:
        self.backend = backend  # tokenizers.Tokenizer, or None for bytes
        if backend is not None:  # documents are encoded whole, never cut or padded
            backend.no_truncation()
            backend.no_padding()
        self._fingerprint: str | None = None
        self.eos_id = eos_id
        if vocab_size is None:
            vocab_size = 256 if backend is None else backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        kind = "bytes" if self.backend is None else "hf"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def encode(self, text: str) -> list[int]:
        """Token ids of a text, without BOS/EOS (documents are separated by EOS when packed)."""
        if self.backend is None:
            return list(text.encode("utf-8"))
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once; the HF encoder runs them in parallel threads."""
        if self.backend is None:
            return [list(t.encode("utf-8")) for t in texts]
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids; invalid byte sequences become U+FFFD."""
        if self.backend is None:
            return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
        return self.backend.decode([int(i) for i in ids])

    def fingerprint(self) -> str:
        """A stable hash of the vocabulary and rules, used in cache keys for token files."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"eos={self.eos_id};vocab={self.vocab_size};".encode())
            if self.backend is None:
                h.update(b"bytes")
            else:
                # Only what changes ids without special tokens counts: transformers adds a
                # no-op post-processor on load, which must not invalidate the token cache.
                spec = json.loads(self.backend.to_str())
                for key in ("post_processor", "truncation", "padding"):
                    spec.pop(key, None)
                h.update(json.dumps(spec, sort_keys=True).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    @property
    def pad_id(self) -> int | None:
        """The id that pads a batch in transformers' collators and generation: EOS, or the bytes' BYTES_PAD_ID."""
        return BYTES_PAD_ID if self.backend is None else self.eos_id

    def save(self, folder: Path, *, model_type: str | None = None, model_max_length: int | None = None) -> None:
        """Write the tokenizer to a folder that load_tokenizer reads, and transformers' AutoTokenizer (4.x and
        5.x) reads to the same ids (the bytes tokenizer as its `tokenizers` equivalent): tokenizer.json, and
        tokenizer_config.json naming the EOS and padding tokens. `model_type`: the model's, where the folder is a
        model's; `model_max_length`: the longest input the model takes."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {"type": "bytes" if self.backend is None else "hf",
                                "vocab_size": self.vocab_size, "eos_id": self.eos_id}
        backend = bytes_backend() if self.backend is None else self.backend
        backend.save(str(folder / "tokenizer.json"))
        eos = None if self.eos_id is None else backend.id_to_token(self.eos_id)
        # the tokens tetron knows are named, the others null: a class's own defaults (Qwen2Tokenizer's
        # <|endoftext|> as unk, eos, pad) would add a token the vocabulary lacks
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "model_max_length": model_max_length or 1 << 30, "bos_token": None,
                                  "eos_token": eos, "unk_token": None,
                                  "pad_token": None if self.pad_id is None else backend.id_to_token(self.pad_id),
                                  "clean_up_tokenization_spaces": False}
        if self.backend is None:  # tetron's bytes never match a special token's text: nor do transformers'
            config["split_special_tokens"] = True
        if model_type in REBUILT_BY_TRANSFORMERS:
            config["trust_remote_code"] = True
        write_json(folder / "tokenizer_config.json", config, indent=2)
        write_json(folder / "tetron_tokenizer.json", meta, indent=2)


def byte_characters() -> list[str]:
    """The printable character byte-level tokenizers (GPT-2's) give each byte: itself where printable, else
    one from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, unprintable = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + unprintable))
        unprintable += b not in printable
    return chars


def bytes_backend() -> Any:
    """tetron's bytes tokenizer as a `tokenizers.Tokenizer`, for transformers: id b for byte b of the UTF-8
    text. The normalizer turns each byte into its byte-level character, a BPE without merges makes one token
    of each; id BYTES_PAD_ID, a byte no UTF-8 text has, is named BYTES_PAD_TOKEN."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {char: b for b, char in enumerate(byte_characters()) if b != BYTES_PAD_ID}
    backend = HFTokenizer(models.BPE(vocab={**vocab, BYTES_PAD_TOKEN: BYTES_PAD_ID}, merges=[]))
    backend.normalizer = normalizers.ByteLevel()
    backend.decoder = decoders.ByteLevel()
    return backend


MAX_BPE_VOCAB = 1 << 20  # 1,048,576 tokens: four times the largest vocabularies in use (Gemma's 262,144); the
# trainer allocates by the size asked for (bpe:1000000000000 aborted the process in the Rust library)


def _bpe_vocab_size(spec: str) -> int:
    try:
        n = int(spec[len("bpe:"):])
    except ValueError:
        n = 0
    if not 257 <= n <= MAX_BPE_VOCAB:
        raise DataError(f"data: tokenizer {spec[:40]!r} needs an integer vocabulary size from 257 (256 bytes + EOS) "
                        f"to {MAX_BPE_VOCAB:,}, e.g. bpe:4096")
    return n


def _train_bpe(vocab_size: int, texts: Iterator[str], *, data_spec: str = "the data") -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    chars = 0

    def counted() -> Iterator[str]:
        nonlocal chars
        for text in texts:
            chars += len(text)
            yield text

    backend.train_from_iterator(counted(), trainer=trainer)
    if chars == 0:  # a BPE of no text is the byte alphabet alone, and the store would hold no tokens
        raise DataError(f"data: {data_spec}: every document is empty: no text to train a BPE on (or to train on); "
                        f"check the source (and data.text_field)")
    return Tokenizer(backend, backend.token_to_id(EOS_TOKEN))


def _load_saved(folder: Path) -> Tokenizer:
    """A folder written by Tokenizer.save; a damaged one is a DataError naming the file."""
    path = folder / "tetron_tokenizer.json"
    try:
        meta = json.loads(read_bounded(path, 1 << 20))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad UTF-8 or JSON
        raise DataError(f"{path}: not a readable tokenizer description ({type(err).__name__})") from None
    kind = meta.get("type") if isinstance(meta, dict) else None
    if kind == "bytes" and meta.get("vocab_size") == 256 and meta.get("eos_id") is None:
        expected = bytes_backend()
        _check_bytes_file(folder, expected)
        _check_config_file(folder, expected, eos_id=None)
        return Tokenizer(None, None)
    vocab, eos = meta.get("vocab_size") if kind == "hf" else None, meta.get("eos_id")
    good_eos = eos is None or (type(eos) is int and type(vocab) is int and 0 <= eos < vocab)
    if kind != "hf" or type(vocab) is not int or vocab < 1 or not good_eos:
        raise DataError(f"{path}: expected type bytes (vocab_size 256, no eos_id), or type hf with an integer "
                        f"vocab_size and eos_id below it")
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(read_bounded(folder / "tokenizer.json", MAX_TOKENIZER_BYTES).decode("utf-8"))
    except Exception as err:  # OSError, bad UTF-8, and tokenizers' own exception types for a bad file
        raise DataError(f"{folder / 'tokenizer.json'}: not a readable tokenizer ({type(err).__name__})") from None
    if backend.get_vocab_size(with_added_tokens=True) > vocab:
        raise DataError(f"{path}: vocab_size={vocab}, but tokenizer.json has "
                        f"{backend.get_vocab_size(with_added_tokens=True)} tokens")
    _check_config_file(folder, backend, eos_id=eos)
    return Tokenizer(backend, eos, vocab_size=vocab)


def _read_json_file(path: Path) -> Any:
    try:
        return json.loads(read_bounded(path, MAX_TOKENIZER_BYTES))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad UTF-8 or JSON
        raise DataError(f"{path}: not readable JSON ({type(err).__name__})") from None


def _check_bytes_file(folder: Path, expected: Any) -> None:
    """A bytes folder's tokenizer.json (what transformers reads), where there is one, is the bytes tokenizer:
    any other would give transformers other ids than tetron's. Fields a newer tokenizers library adds to the
    BPE model may be missing from an older file."""
    path = folder / "tokenizer.json"
    if not path.exists():  # written before tetron wrote one
        return
    got, want = _read_json_file(path), json.loads(expected.to_str())
    model = got.get("model") if isinstance(got, dict) else None
    if not (isinstance(model, dict) and {k: v for k, v in got.items() if k != "model"} == {
            k: v for k, v in want.items() if k != "model"} and model.get("vocab") == want["model"]["vocab"]
            and all(k in want["model"] and v == want["model"][k] for k, v in model.items())):
        raise DataError(f"{path}: not the bytes tokenizer tetron_tokenizer.json names (transformers would read "
                        f"other ids than tetron's)")


def _check_config_file(folder: Path, backend: Any, *, eos_id: int | None) -> None:
    """tokenizer_config.json (what transformers reads beside tokenizer.json), where there is one: the class
    and flags tetron writes, a positive model_max_length, only tokens of the vocabulary named (transformers
    would add any other, with an id the model lacks), and the EOS tetron_tokenizer.json gives (`eos_id`: a
    downstream tool would stop generating at another token than the one the run trained with)."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return
    config = _read_json_file(path)
    if not isinstance(config, dict) or config.get("tokenizer_class", "PreTrainedTokenizerFast") != \
            "PreTrainedTokenizerFast":
        raise DataError(f"{path}: expected a mapping with tokenizer_class PreTrainedTokenizerFast")
    length = config.get("model_max_length", 1)
    if type(length) is not int or length < 1:
        raise DataError(f"{path}: model_max_length={length!r}: expected a positive integer")
    for key in ("clean_up_tokenization_spaces", "split_special_tokens", "trust_remote_code"):
        if type(config.get(key, False)) is not bool:
            raise DataError(f"{path}: {key}={config[key]!r}: expected true or false")
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token  # transformers' AddedToken form
        if token is not None and not (isinstance(token, str) and backend.token_to_id(token) is not None):
            raise DataError(f"{path}: {key}={token!r} is no token of tokenizer.json")
    eos = config.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if (None if eos is None else backend.token_to_id(eos)) != eos_id:
        raise DataError(f"{path}: eos_token={eos!r}, but tetron_tokenizer.json's eos_id is {eos_id} "
                        f"({None if eos_id is None else repr(backend.id_to_token(eos_id))}): the files disagree")


def _meant(spec: str) -> str | None:
    """The built-in tokenizer a spec that names nothing here was likely meant to be: bpe1024 -> bpe:1024."""
    bpe = re.fullmatch(r"bpe[\s_=/-]?(\d+)|BPE[\s_=:/-]?(\d+)", spec.strip(), re.IGNORECASE)
    if bpe:
        return f"bpe:{bpe.group(1) or bpe.group(2)}"
    return "bytes" if spec.strip().lower() in ("byte", "bytes", "byte-level", "bytelevel") else None


def _load_pretrained(spec: str) -> Tokenizer:
    """A Hugging Face tokenizer folder, tokenizer.json file, or hub name, through transformers."""
    path = Path(spec).expanduser()
    if not path.exists() and (meant := _meant(spec)) is not None:
        raise DataError(f"data.tokenizer={spec}: no such tokenizer folder or hub name; did you mean {meant}?")
    if not path.exists() and (problem := hub_problem(spec, "model")) is not None:
        raise DataError(f"data.tokenizer={spec}: {problem}")  # at once, not after a minute of retries
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if path.is_file():
            if (path.parent / "tokenizer_config.json").exists():
                tok = AutoTokenizer.from_pretrained(str(path.parent))
            else:
                tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
        else:
            tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec)
    except Exception as e:  # OSError, ValueError, hub errors: all mean "cannot load this"
        raise DataError(
            f"data: cannot load tokenizer {spec!r} (use 'bytes', 'bpe:N', a tokenizer folder or "
            f"tokenizer.json, or a hub name that is cached): {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from e
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise DataError(f"data: tokenizer {spec!r} has no fast (tokenizers) backend; give one with a tokenizer.json")
    return Tokenizer(backend, tok.eos_token_id, vocab_size=len(tok))


def load_tokenizer(
    spec: str,
    *,
    data_spec: str | None,
    cache_dir: Path,
    text_field: str = "text",
    max_bytes: int | None = None,
    say: Callable[[str], None] | None = None,
    skip_bad: bool = False,
) -> Tokenizer:
    """`bytes`, `bpe:N` (trained on the data once, then cached), or a Hugging Face tokenizer. `say`
    is told when a tokenizer is trained (seconds to minutes); `skip_bad`: data.on_bad_record=skip."""
    if spec == "bytes":
        return Tokenizer(None, None)
    if spec.startswith("bpe:"):
        vocab_size = _bpe_vocab_size(spec)
        if data_spec is None:
            raise DataError(f"data: tokenizer {spec!r} is trained on the data; give a data spec to train it on")
        data_fp = data_fingerprint(data_spec, text_field=text_field, max_bytes=max_bytes, skip_bad=skip_bad)
        key = hashlib.sha256(f"bpe:{vocab_size}:{data_fp}".encode()).hexdigest()
        folder = Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-{key[:20]}"
        if (folder / "tetron_tokenizer.json").exists():
            return _load_saved(folder)
        if say is not None:
            say(f"training a {vocab_size}-token byte-level BPE on {data_spec} (once; cached in {folder.parent})")
        skip = BadRecords() if skip_bad else None
        tok = _train_bpe(vocab_size, iter_texts(data_spec, text_field=text_field, max_bytes=max_bytes, skip=skip),
                         data_spec=data_spec)
        # Save under a temporary name and rename, so a crash never leaves a partial cache entry.
        tmp = temp_name(folder)
        tok.save(tmp)
        try:
            replace_folder(tmp, folder, overwrite=False)
        except OSError:  # another process finished first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
            if not (folder / "tetron_tokenizer.json").exists():
                raise
        return _load_saved(folder)
    path = Path(spec).expanduser()
    if (path / "tetron_tokenizer.json").exists():
        return _load_saved(path)
    looks_like_path = spec.startswith(("/", "./", "../", "~")) or spec.endswith(".json")
    if looks_like_path and not path.exists():
        raise DataError(
            f"data: tokenizer path {spec} does not exist (use 'bytes', 'bpe:N', a tokenizer folder or tokenizer.json)"
        )
    return _load_pretrained(spec)
