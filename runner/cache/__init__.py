"""Cache kinds, snapshots and (later) the prefix trie."""
