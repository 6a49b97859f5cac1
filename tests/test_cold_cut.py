"""Where a restore ends (kvbridge.engine.cold_cut): the rule, and that the engine's arithmetic after it is the
cold run's, bit for bit, on both embedded models (the probe of Docs/Research.md §26, at its rule's positions)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import needs_model
from kvbridge.models.cut_probe import PromptProbe, derive_rule, differing_cuts, probe
from kvbridge.backends.llama_cpp_model import model_path_for
from kvbridge.engine import cut_verdicts
from kvbridge.engine.cold_cut import DEFAULT_RULE, GRID, CutRule, on_grid, restorable
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


# a proven rule (kvbridge.engine.cut_verdicts): finer grids, fewer rows, and cuts before the last piece or not
@pytest.mark.parametrize("grid, rows, crosses, reach, n, cut", [
    (1, 2, True, 1663, 1676, 1663),     # SmolLM2 here: a restore ends where the question diverges
    (1, 2, True, 1676, 1676, 1674),     # the whole prompt stored: all but the last 2
    (4, 7, True, 1663, 1676, 1660),     # Gemma 3 here: the 4-row grid below the divergence
    (4, 7, True, 1676, 1676, 1668),     # 8 left: the grid point leaving 7 or more
    (4, 7, True, 600, 1676, 600),       # a shorter stored prompt: before the last piece, allowed
    (4, 7, False, 600, 1676, 512),      # ... not proven: back to the piece start, the cold run's pieces follow
    (4, 7, False, 1400, 1676, 1024),
    (4, 7, False, 1540, 1676, 1540),
    (8, 8, True, 5, 6, 0),              # a prompt shorter than the rows left: computed whole
    (1, 2, True, 0, 50, 0),
])
def test_a_proven_rule_ends_restores_where_it_allows(grid, rows, crosses, reach, n, cut):
    rule = CutRule(grid, rows, crosses, proven=True, source="test")
    assert rule.cut(reach, n) == cut
    assert rule.cut(cut, n) == cut                     # where a restore ends is itself allowed
    assert rule.restorable(n) >= rule.cut(reach, n)


def test_the_default_rule_is_the_fixed_grid_and_bad_rules_are_refused():
    assert (DEFAULT_RULE.grid, DEFAULT_RULE.min_rows, DEFAULT_RULE.proven) == (GRID, GRID, False)
    assert "fixed grid of 8" in DEFAULT_RULE.describe()
    for grid, rows in ((3, 2), (0, 2), (4, 0)):
        with pytest.raises(ValueError, match="grid"):
            CutRule(grid, rows)


def test_derive_rule_picks_the_finest_grid_then_the_fewest_rows_no_probed_cut_contradicts():
    smol = [PromptProbe(555, list(range(515, 555)), [554]), PromptProbe(130, list(range(90, 130)), [])]
    assert (derive_rule(smol).grid, derive_rule(smol).min_rows) == (1, 2)
    # Gemma 3 here: cuts off the 4-row grid differ, and 4-aligned ones leaving 6 rows (§28)
    gemma = [PromptProbe(130, list(range(90, 130)), [90, 94, 98, 102, 106, 110, 114, 118, 122, 123, 124, 126, 129]),
             PromptProbe(45, list(range(5, 45)), [c for c in range(5, 45) if c % 4] + [44])]
    rule = derive_rule(gemma)
    assert (rule.grid, rule.min_rows) == (4, 7) and rule.proven
    crossing = [PromptProbe(555, list(range(500, 555)), [508])]    # a cut before the last piece differed
    assert derive_rule(crossing).crosses_pieces is False and derive_rule(crossing).grid == 1
    assert derive_rule(smol, repeatable=False) is DEFAULT_RULE     # runs that do not repeat prove nothing
    nothing = [PromptProbe(555, list(range(1, 555)), list(range(1, 555)))]
    assert derive_rule(nothing).grid == 512                        # only piece starts are left


def _key() -> dict[str, str]:
    return {"model_sha256": "ab" * 32, "model_file": "m.gguf", "llama_cpp_python": "0.3.36", "build_flags": "x",
            "cache_type_k": "f16", "cache_type_v": "f16", "flash_attn": "off", "batch_tokens": "512",
            "threads": "2", "cpu": "cpu"}


def test_a_verdict_round_trips_and_a_damaged_or_foreign_one_is_not_trusted(tmp_path, caplog):
    rule = CutRule(4, 7, True, proven=True)
    path = cut_verdicts.save(_key(), rule, [PromptProbe(130, [120, 121], [121])], 12.0, folder=tmp_path)
    loaded = cut_verdicts.load(_key(), folder=tmp_path)
    assert (loaded.grid, loaded.min_rows, loaded.crosses_pieces, loaded.proven) == (4, 7, True, True)
    assert "verdict" in loaded.describe() and "m.gguf" in loaded.describe()
    assert cut_verdicts.load({**_key(), "threads": "1"}, folder=tmp_path) is None   # another key: not probed
    # the same GGUF under another name (an Ollama blob, a copy) is the same model by its sha256
    blob = cut_verdicts.load({**_key(), "model_file": "sha256-" + "ab" * 32}, folder=tmp_path)
    assert blob is not None and blob.grid == 4 and "sha256-" in blob.describe()
    body = json.loads(path.read_text())
    body["rule"]["grid"] = 1                                                    # edited by hand: checksum fails
    path.write_text(json.dumps(body))
    assert cut_verdicts.load(_key(), folder=tmp_path) is None
    assert "checksum" in caplog.text
    path.write_text("{not json")
    assert cut_verdicts.load(_key(), folder=tmp_path) is None
    # an engine of another build (a llama-server built elsewhere) never takes this machine's verdict
    assert cut_verdicts.rule_for(Settings(), None, {}) is DEFAULT_RULE


@needs_model
def test_the_probe_proves_a_rule_for_smollm2_and_an_engine_ends_restores_by_it(tmp_path, monkeypatch):
    """A short probe (two prompt lengths) on the real model; saved, the engine reads it at start, and a question
    that diverges off the 8-grid restores to where the rule allows: the answer equals cold token for token."""
    settings = Settings.from_env().replace(model="smollm2-135m", model_path="", ctx_size=2048, flash_attn=False,
                                           threads=2, chunk_size=32, l2_dir=str(tmp_path / "l2"), l1_bytes=64 << 20)
    results, repeatable = probe(settings, (45, 130))
    assert repeatable and all(r.cuts for r in results)
    key = cut_verdicts.verdict_key(settings, model_path_for(settings))
    rule = derive_rule(results, repeatable, source=cut_verdicts.source_line(key))
    assert rule.proven and rule.grid <= GRID and rule.min_rows <= GRID
    monkeypatch.setattr(cut_verdicts, "VERDICT_DIR", tmp_path / "verdicts")
    cut_verdicts.save(key, rule, results, 1.0)
    from kvbridge.backends import make_backend
    from kvbridge.engine.cached_engine import CachedEngine

    doc = "The pump house log lists the valves, their owners and the day each was last serviced. " * 12
    with CachedEngine(settings, make_backend("llamacpp", settings)) as engine:
        assert engine.cut_rule == rule and "proven by the cut probe" in engine.status()["cut_rule"]
        engine.infer(doc + "Who owns valve three?", mode="lmcache", n_predict=8)
        prompt = doc + "Which valve was serviced last, and by whom was it done?"
        cold = engine.infer(prompt, mode="cold", n_predict=8)
        warm = engine.infer(prompt, mode="lmcache", n_predict=8)
    assert warm.restore_ok and warm.text == cold.text
    assert warm.matched_tokens == rule.cut(warm.matched_tokens, warm.prompt_tokens) > 0
    assert warm.prefill_tokens == warm.prompt_tokens - warm.matched_tokens
    # SmolLM2 on this CPU needs no 8-token margin: the restore ends closer to the divergence than the old grid
    assert warm.matched_tokens >= DEFAULT_RULE.cut(warm.matched_tokens, warm.prompt_tokens)
