"""Where a model's files come from: a directory, the Ollama store, the default model; read into
one `ModelSource`.
"""
