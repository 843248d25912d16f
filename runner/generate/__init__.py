"""Generation: preparing a completion request, the decode pipeline, Go's sampler, UTF-8 hold-
back.
"""
