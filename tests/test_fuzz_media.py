"""bench/fuzz/media.py's hostile-media cases at their small size, against spawned tiny Gemma3
and Qwen3.5 runners (one per family), as CI runs them: every case answers as it states (J and
its kin refused from their headers, rows that cannot fit refused undecoded, transparency
scored, tags of non-ASCII digits read as text, stable error texts), no runner dies, and
`/v1/status` answers throughout. The cases' peaks and latencies are printed, not judged (the
machines that run tests are shared); what one image adds at its peak is, per declared pixel,
in fresh processes. `python -m bench.fuzz --bodies 0 --media full` measures the issue's
sizes.
"""

from __future__ import annotations

import sys

import pytest

from bench.fuzz.media import (
    SMALL,
    Result,
    cases,
    format_peaks,
    media_summary,
    peaks_summary,
    run_media,
)

CASES = [case.name for case in cases(SMALL)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, Result]:
    logs = tmp_path_factory.mktemp("media-logs")
    done = run_media(SMALL, log_dir=logs, fresh=False, settle_s=0.2)
    print(media_summary(done, SMALL))
    return {r.case.name: r for r in done}


@pytest.mark.slow
def test_every_case_ran_and_status_was_polled(results):
    assert sorted(results) == sorted(CASES)
    assert all(r.polls > 0 and not r.status_errors for r in results.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_case(results, name):
    result = results[name]
    assert result.ok, f"{name}: {'; '.join(result.problems)}"
    if result.case.disconnect_after_s is not None:
        assert result.busy_after_s is not None


# What one image adds to the process at its peak, per declared pixel (docs/PROTOCOL.md §7):
# WebP's decoder 16, everything else at most 12 (transparency composited onto white was 20).
PEAK_BYTES_PER_PIXEL = {"RGBA WebP lossless": 16, "RGB WebP": 16}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_one_image_peaks_within_the_documented_bytes_per_pixel():
    """Each kind of 3000 x 3000 image prepared (in a process of their own, the peak reset
    before each): its peak RSS over its declared pixels, with 1.5 bytes a pixel (13 MB) of
    slack for the process's own noise."""
    peaks = format_peaks(3000)
    print(peaks_summary(peaks, 3000))
    for name, peak in peaks.items():
        limit = PEAK_BYTES_PER_PIXEL.get(name, 12) + 1.5
        assert peak["per_pixel"] <= limit, f"{name}: {peak['per_pixel']} bytes a pixel"
