"""HTTP: the routes, the endpoint façades, MLX memory as requests see it."""
