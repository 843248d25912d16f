"""GGUF model files (llama.cpp's and Ollama's format), read exactly: the container (`reader`)
and the GGML tensor types, repacked onto MLX's quantization where that is exact, else
dequantized to float32 as llama.cpp does (`quants`). Nothing here imports MLX at module
level.
"""
