"""Data: from text (files, folders, globs, Hugging Face datasets) to the token windows of each step.

    sources.py      the Source protocol: one kind per form of data spec, found by source_of; data fingerprints
    files.py        local files and folders read as documents
    hf_source.py    Hugging Face datasets, streamed or loaded; hub.py: hub names checked before any wait
    tokenizer.py    bytes, a BPE trained on the data, or a Hugging Face tokenizer
    units.py        local files cut into units that workers tokenize independently
    store_build.py  tokenizing into a sharded, memory-mapped token store (token_store.py), resumably
    tokenize.py     `tetron tokenize`
    loader.py       prepare_data (tokenize once, cached by content) and the DataLoader of a dp rank
    mixture.py      several sources mixed by weight
    documents.py    which document each position of a packed window belongs to; restarted positions
    batch.py        MicroBatch, and the cut of a window to one rank's positions

Imports the ground floor, models and config (tetron/__init__.py's layers); nothing of parallel or above.
"""
