"""`/v1/score`: validating a decision request (Go's rules and texts), and scoring its rows on
the MLX thread.
"""
