"""Checkpoints: a Hugging Face model folder (config.json, safetensors, index) that transformers loads, the
optimizer state in safetensors beside it, and a sealed trainer state; any layout resumes from any other.

    save.py                 the folder written atomically by every rank; OUT/model
    shards.py               who writes which tensor (balanced by bytes), gathering to it, its shards, crc32
    background.py           checkpoint.async_save: a copy of this rank's state, written on a thread
    load.py                 reading this rank's slices (a checkpoint, or Hugging Face weights); load_model
    check.py                every check before start (sizes, headers, the trainer state, the model); tetron check
    convert.py              `tetron convert`: checkpoint <-> standalone Hugging Face folder
    safetensors_stream.py   a safetensors writer that streams tensors to disk

Imports everything below observe (tetron/__init__.py's layers). The run folder's layout (checkpoints/,
latest, trainer_state.json) is in fs.py, which data and observe read too.
"""
