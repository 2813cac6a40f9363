"""The layout fuzzer's parts (tests/fuzz_layouts.py runs them)."""
