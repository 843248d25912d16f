"""Media in prompts: decoding the bytes a request carries (images) into what models read."""
