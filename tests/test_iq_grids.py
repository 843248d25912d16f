"""runner/native/iq_grids.h holds llama.cpp's grids as the gguf package has them.

The header is generated (tools/iq_grids.py); the native tiles look every grid i-quant's values
up in it, so a stale or hand-edited table would change the products, not fail them."""

from __future__ import annotations

import re

import numpy as np

from tools import iq_grids


def test_the_committed_header_is_the_generator_output() -> None:
    assert iq_grids.HEADER.read_text() == iq_grids.render()


def test_the_header_entries_are_the_grids_values() -> None:
    """Each C table, parsed back, is gguf-py's grid entry by entry (bytes low first), with
    llama.cpp's first and last entries of iq2xxs_grid and iq1s_grid as written in
    ggml-common.h."""
    text = iq_grids.HEADER.read_text()
    for c_name, name in iq_grids.GRIDS:
        body = re.search(rf"{c_name}\[(\d+)\] = \{{(.*?)\}};", text, re.S)
        assert body is not None, c_name
        words = [int(w.rstrip("ul"), 16) for w in re.findall(r"0x[0-9a-f]+u?l*", body.group(2))]
        grid = iq_grids.grid_entries(name)
        assert len(words) == int(body.group(1)) == len(grid)
        width = grid.shape[1]
        back = np.array(words, np.uint64 if width == 8 else np.uint32).view(np.int8)
        np.testing.assert_array_equal(back.reshape(grid.shape), grid)
    assert "IQ2XXS_GRID[256] = {\n    0x0808080808080808ull," in text
    iq1s = re.search(r"IQ1S_GRID\[2048\] = \{(.*?)\};", text, re.S)
    assert iq1s is not None
    assert iq1s.group(1).split()[0] == "0xffffffffffffffffull,"  # {-1, -1, ..., -1}
    assert iq1s.group(1).split()[-1] == "0x0101010101010101ull,"  # {1, 1, ..., 1}
