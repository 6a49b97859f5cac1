"""Where a restore ends (kvbridge.engine.cold_cut): the rule, and that the engine's arithmetic after it is the
cold run's, bit for bit, on both embedded models (the probe of Docs/Research.md §26, at its rule's positions)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import needs_model
from kvbridge.bench.probes.cut_probe import differing_cuts
from kvbridge.engine.cold_cut import GRID, on_grid, restorable
from kvbridge.settings import Settings


@pytest.mark.parametrize("n, cut", [(0, 0), (1, 0), (15, 0), (16, 8), (17, 8), (45, 32), (130, 120), (512, 504),
                                    (513, 512), (515, 512), (520, 512), (521, 512), (528, 520), (555, 544),
                                    (1025, 1024), (1100, 1088)])
def test_a_restore_ends_on_the_grid_inside_the_last_prefill_piece(n, cut):
    assert restorable(n) == cut
    if cut:
        last_piece = (n - 1) // 512 * 512
        assert cut == last_piece or (cut % GRID == 0 and n - cut >= GRID and cut > last_piece)
    assert on_grid(cut) == cut and on_grid(cut + GRID - 1) == cut


@needs_model
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_engine_computes_what_a_restore_leaves_as_its_cold_run_did(model):
    """Prompts that end anywhere against the 4-row grid Gemma 3's repacked weights use, and one that spans two
    prefill pieces: the answer after a restore to `restorable(n)` is the cold answer, logits bit for bit."""
    settings = Settings.from_env().replace(model=model, model_path="", ctx_size=1024, flash_attn=False, threads=1)
    rng = np.random.default_rng(7)
    for n in (45, 130, 527):
        tokens = [int(t) for t in rng.integers(100, 20000, size=n)]
        assert differing_cuts(settings, tokens, [restorable(n)]) == [], f"{model}: {n} tokens"
