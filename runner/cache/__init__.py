"""The prefix cache: cache kinds and their snapshots, the token trie, the live state, the
sessions that compute through it, and batched rows over a shared prefix."""
