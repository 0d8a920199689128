"""The TTT teacher and its per-sample cache (eagle3/teacher.py): the cache changes timing only.

    .venv/bin/pytest tests/test_teacher.py -q
"""

import torch

from eagle3.shards import collate
from eagle3.teacher import (TeacherCache, VerifierHead, document_spans, document_stats,
                            full_vocab_stats, make_teacher)
from eagle3.ttt import prepare_batch, teacher_rows

V, VD, H = 500, 64, 24


def docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in lengths:
        mask = torch.zeros(L, dtype=torch.long)
        mask[L // 3:] = 1  # a prompt, then the answer
        out.append({"input_ids": torch.randint(0, V, (L,), generator=g), "loss_mask": mask,
                    "aux": torch.randn(L, 3 * H, generator=g),
                    "final": torch.randn(L, H, generator=g)})
    return out


def head(seed=1):
    g = torch.Generator().manual_seed(seed)
    return VerifierHead.of(torch.randn(V, H, generator=g),
                           torch.randperm(V, generator=g)[:VD].sort().values)


def assert_same(a, b):
    for x, y in zip(vars(a).values(), vars(b).values()):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


def test_teacher_equals_the_full_vocabulary_product():
    """Draft logits from the head's draft rows, argmax and normalizers from the full product:
    the same numbers the full logits give."""
    hd = head()
    batch = collate(docs([30, 17]), 1000)
    needed = teacher_rows(batch)
    t = make_teacher(batch.final, hd, needed, temperature=0.6,
                     stats=document_stats(batch.final, batch.doc_end, needed, hd, 0.6))
    full = batch.final[0] @ hd.full.T
    rows = needed[0]
    ids = (hd.full[:, None, :] == hd.draft[None]).all(-1).float().argmax(0)  # draft ids
    torch.testing.assert_close(t.draft_logits[0][rows], full[rows][:, ids], rtol=1e-6, atol=1e-5)
    assert torch.equal(t.argmax[0][rows], full[rows].argmax(-1))
    torch.testing.assert_close(t.lse[0][rows], full[rows].logsumexp(-1))
    torch.testing.assert_close(t.lse_t[0][rows], (full[rows] / 0.6).logsumexp(-1))
    assert not t.draft_logits[0][~rows].any()  # rows no TTT step reads are never computed


def test_a_documents_statistics_do_not_depend_on_what_it_is_packed_with():
    """What makes the cache exact: statistics are computed per document, so a sample's are the
    same bits in any micro-batch of any epoch."""
    hd = head()
    a, b, c = docs([40, 23, 31])
    packed = collate([a, b, c], 1000)
    alone = collate([b], 1000)
    s_packed = document_stats(packed.final, packed.doc_end, teacher_rows(packed), hd)
    s_alone = document_stats(alone.final, alone.doc_end, teacher_rows(alone), hd)
    n_a = int(teacher_rows(collate([a], 1000)).sum())
    n_b = len(s_alone.argmax)
    assert torch.equal(s_packed.argmax[n_a:n_a + n_b], s_alone.argmax)
    assert torch.equal(s_packed.lse[n_a:n_a + n_b], s_alone.lse)
    assert document_spans(packed.doc_end) == [(0, 40), (40, 63), (63, 94)]


def test_cached_teacher_is_bit_identical_and_never_touches_the_full_head():
    hd, cache = head(), TeacherCache()
    samples = docs([40, 23, 31])
    first = prepare_batch(samples, 1000, torch.device("cpu"), torch.float32, hd,
                          loss_on="assistant", keys=[7, 8, 9], cache=cache)[1]
    uncached = prepare_batch(samples, 1000, torch.device("cpu"), torch.float32, hd,
                             loss_on="assistant")[1]
    assert_same(first, uncached)
    assert len(cache.entries) == 3 and cache.nbytes > 0
    # A later epoch packs the samples differently; the full head is not needed any more.
    hd.full = torch.full_like(hd.full, float("nan"))
    again = prepare_batch([samples[2], samples[0], samples[1]], 1000, torch.device("cpu"),
                          torch.float32, hd, loss_on="assistant", keys=[9, 7, 8], cache=cache)
    reordered = prepare_batch([samples[2], samples[0], samples[1]], 1000, torch.device("cpu"),
                              torch.float32, head(), loss_on="assistant")
    assert_same(again[1], reordered[1])
    assert torch.isfinite(again[1].lse).all()


def test_cache_keys_separate_supervised_rows_and_temperature():
    """The same sample under another row set (train.loss_on) or estimate temperature is another
    entry, never a stale one."""
    hd, cache = head(), TeacherCache()
    s = docs([30])
    cpu = torch.device("cpu")
    views = [dict(loss_on="assistant"), dict(loss_on="all"), dict(temperature=0.6),
             dict(temperature=1.0)]
    for kw in views:
        cached = prepare_batch(s, 1000, cpu, torch.float32, hd, keys=[0], cache=cache, **kw)[1]
        assert_same(cached, prepare_batch(s, 1000, cpu, torch.float32, hd, **kw)[1])
    assert len(cache.entries) == len(views)


def test_one_process_share_keeps_entries_and_clears_the_fresh_list():
    hd, cache = head(), TeacherCache()
    b = collate(docs([20]), 1000)
    cache.get("x", b.final[0], hd, None)
    assert list(cache.fresh) == ["x"]
    cache.share()
    assert list(cache.entries) == ["x"] and not cache.fresh
    expected = full_vocab_stats(b.final[0], hd)
    got = cache.get("x", b.final[0], hd, None)
    assert torch.equal(got.argmax.long(), expected.argmax) and torch.equal(got.lse, expected.lse)


def test_a_full_head_reads_its_statistics_off_its_own_draft_logits():
    """With the whole vocabulary as draft vocabulary the draft product is the full product: the
    statistics come from those logits (one product, not two), so p restricted to the draft
    vocabulary is exactly p, and no cache entry is made or needed."""
    g = torch.Generator().manual_seed(3)
    hd, cache = VerifierHead.of(torch.randn(V, H, generator=g), torch.arange(V)), TeacherCache()
    assert hd.is_full and not head().is_full
    samples = docs([40, 23, 31])
    batch, t = prepare_batch(samples, 1000, torch.device("cpu"), torch.float32, hd,
                             loss_on="assistant", temperature=0.6, keys=[1, 2, 3], cache=cache)
    assert not cache.entries
    rows = teacher_rows(batch)[0]
    logits = t.draft_logits[0][rows]
    assert torch.equal(t.argmax[0][rows], logits.argmax(-1))
    assert torch.equal(t.lse[0][rows], logits.logsumexp(-1))
    assert torch.equal(t.lse_t[0][rows], (logits / 0.6).logsumexp(-1))
    # the same numbers as the separate full-vocabulary statistics
    two = make_teacher(batch.final, hd, teacher_rows(batch), 0.6, stats=document_stats(
        batch.final, batch.doc_end, teacher_rows(batch), hd, 0.6))
    assert torch.equal(t.argmax, two.argmax) and torch.equal(t.draft_logits, two.draft_logits)
    torch.testing.assert_close(t.lse, two.lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(t.lse_t, two.lse_t, rtol=0, atol=1e-5)
