"""The Go runner's wire: request and response structs, Go's JSON decoding rules, Go's error
texts.
"""
