"""Images in prompts: decoding their bytes (`images`), tags and expansions (`prepare`), and
their features during a forward (`request`). docs/PROTOCOL.md §7."""
