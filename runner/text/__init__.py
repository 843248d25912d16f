"""Tokenization with the Go runner's semantics over `tokenizers`."""
