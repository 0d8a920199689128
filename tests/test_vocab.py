"""Draft vocabulary: offsets not absolute ids, bool mask, counts over loss-masked tokens only."""

import numpy as np
import pytest
import torch

from eagle3.vocab import build_vocab_map, count_tokens, coverage, draft_to_target_ids


def test_counts_only_supervised_tokens():
    ids = [np.array([5, 5, 7, 9, 9, 9]), np.array([1, 2, 3])]
    masks = [np.array([0, 0, 1, 1, 1, 0]), np.array([1, 0, 0])]
    counts = count_tokens(ids, masks, 12)
    assert counts.tolist() == [0, 1, 0, 0, 0, 0, 0, 1, 0, 2, 0, 0]


def test_round_trip_d2t_t2d():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 100, size=500)
    d2t, t2d = build_vocab_map(counts, 64)
    assert d2t.dtype == torch.int64 and d2t.shape == (64,)
    assert t2d.dtype == torch.bool and t2d.shape == (500,) and int(t2d.sum()) == 64
    targets = draft_to_target_ids(d2t)
    # offsets: target ids are strictly increasing, each one marked in t2d, and map back
    assert torch.all(targets[1:] > targets[:-1])
    assert torch.all(t2d[targets])
    assert torch.equal(torch.nonzero(t2d).flatten(), targets)
    # the chosen ids are the most frequent ones
    top = set(np.argsort(-counts, kind="stable")[:64].tolist())
    assert set(targets.tolist()) == top
    assert coverage(counts, t2d) == counts[targets.numpy()].sum() / counts.sum()


def test_padding_and_forced_end_of_turn():
    counts = np.zeros(100, dtype=np.int64)
    counts[[50, 60, 70]] = [3, 2, 1]
    d2t, t2d = build_vocab_map(counts, 8, always_include=[99])
    targets = draft_to_target_ids(d2t).tolist()
    # seen tokens, the forced EOS, then the lowest unseen ids as padding
    assert targets == [0, 1, 2, 3, 50, 60, 70, 99]


def test_draft_vocab_capped_at_verifier_vocab():
    d2t, t2d = build_vocab_map(np.ones(10, dtype=np.int64), 32)
    assert len(d2t) == 10 and torch.all(d2t == 0) and torch.all(t2d)


def test_full_draft_vocabulary_is_the_identity():
    """`vocab.draft_vocab_size: full` is the verifier's vocabulary, whatever was counted; any
    other string is a one-line config error."""
    from eagle3.config import ConfigError, VocabConfig

    assert VocabConfig(draft_vocab_size="full").size_for(49152) == 49152
    assert VocabConfig(draft_vocab_size=4096).size_for(49152) == 4096
    assert VocabConfig(draft_vocab_size=65536).size_for(49152) == 49152
    counts = np.zeros(50, dtype=np.int64)
    counts[[3, 7]] = 5
    d2t, t2d = build_vocab_map(counts, VocabConfig(draft_vocab_size="full").size_for(50))
    assert torch.equal(d2t, torch.zeros(50, dtype=torch.long)) and bool(t2d.all())
    with pytest.raises(ConfigError, match="a number of tokens or `full`, got 'ful'"):
        VocabConfig(draft_vocab_size="ful")
