"""The reference decoder (eagle3/reference_decoder.py) is lossless: at T = 0 it reproduces the
verifier's own greedy decoding, at T > 0 its tokens are distributed as the verifier's own
sampling; and it reads the drafter from a real vLLM export."""

import itertools
import math

import pytest
import torch

from eagle3.model import DraftModelConfig, Eagle3DraftModel, causal_doc_mask
from eagle3.reference_decoder import ReferenceDecoder, acceptance


def small_llama(vocab: int, seed: int, logit_scale: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
        tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.eval()


def drafter_for(verifier, draft_vocab: int, seed: int, logit_scale: float = 1.0):
    c = verifier.config
    torch.manual_seed(seed)
    model = Eagle3DraftModel(DraftModelConfig(
        hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, num_aux=3,
        intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
        num_layers=1, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
        vocab_size=c.vocab_size, draft_vocab_size=draft_vocab))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier.model.embed_tokens.weight)
        model.lm_head.weight.mul_(logit_scale)
        model.t2d[:draft_vocab] = True
    return model.eval()


def greedy(verifier, prompt: list[int], n: int) -> list[int]:
    out = verifier.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                            min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_the_verifiers_greedy_decoding_with_a_random_drafter():
    verifier = small_llama(vocab=512, seed=1, logit_scale=4.0)
    dec = ReferenceDecoder(verifier, drafter_for(verifier, 128, seed=2), [1, 2, 3], [])
    for prompt in ([5, 17, 300, 42], [7] * 12):
        out = dec.decode(prompt, k=3, temperature=0.0, max_tokens=24)
        assert out.tokens == greedy(verifier, prompt, 24)
        assert out.rounds > 0 and len(out.accepted_hist) == 4


def test_greedy_is_lossless_when_drafts_are_accepted(monkeypatch):
    """Drafts that are right for a while, then wrong: accepted prefixes, the verifier's
    correction, the KV cache cut back and the aux states appended must all keep the output
    equal to greedy decoding."""
    verifier = small_llama(vocab=512, seed=3, logit_scale=4.0)
    prompt = [11, 12, 13, 14, 15]
    truth = greedy(verifier, prompt, 40)
    dec = ReferenceDecoder(verifier, drafter_for(verifier, 512, seed=4), [1, 2, 3], [])
    rounds = itertools.count()

    def oracle(feats, context, k, temperature, sampled, generator, cache):
        done = len(context) - len(prompt)
        right = next(rounds) % (k + 1)  # 0..k drafts right, then a wrong one
        drafts = [truth[done + i] if i < right else (truth[done + i] + 1) % 512
                  for i in range(k)]
        assert feats.shape[0] == len(context) - 1  # every token but the last has its states
        return drafts, [None] * k

    monkeypatch.setattr(dec, "_draft", oracle)
    out = dec.decode(prompt, k=3, temperature=0.0, max_tokens=40)
    assert out.tokens == truth
    assert out.accepted > 0 and out.accepted_hist[3] > 0 and out.accepted_hist[0] > 0
    stats = acceptance([out], 3)
    assert stats["mean_acceptance_length"] == pytest.approx(1 + out.accepted / out.rounds)
    assert stats["per_position_acceptance"][0] >= stats["per_position_acceptance"][2]


def whole_unrolling(d: Eagle3DraftModel, feats: torch.Tensor, context: list[int],
                    drafts: list[int]) -> list[torch.Tensor]:
    """Each step's last-row logits, fed `drafts`, from the training forward over the whole
    sequence (step 0 over every position, each later step over every position again)."""
    n = feats.shape[0]
    h = d.project(feats[None])
    ids = torch.tensor([context[1:]])
    positions = torch.arange(n)[None]
    mask, cache = causal_doc_mask(torch.zeros(1, n, dtype=torch.long)), d.new_cache()
    rows = []
    for step, draft in enumerate(drafts):
        h, logits = d.step(h, ids, positions + step, mask, cache)
        rows.append(logits[0, -1])
        ids = torch.cat([ids[:, 1:], torch.tensor([[draft]])], dim=1)
    return rows


@pytest.mark.parametrize("attention", ["mha", "mla", "mha-2-layers-eagle31"])
def test_drafting_from_the_cache_equals_the_whole_unrolling(attention):
    """Round after round (1 to k + 1 positions added each time, as acceptance adds them), what
    the decoder drafts from its cache is what the training forward over the whole sequence
    gives at the last position: greedy drafts its argmax tokens, sampled drafts are drawn from
    its distributions."""
    from test_mla import mla_config

    torch.manual_seed(0)
    V, Vd, H, k = 96, 64, 48, 3
    cfg = mla_config(vocab_size=V, draft_vocab_size=Vd) if attention == "mla" else \
        DraftModelConfig(hidden_size=H, target_hidden_size=H, num_aux=3, intermediate_size=64,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                         num_layers=2 if "2-layers" in attention else 1, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=512, vocab_size=V,
                         draft_vocab_size=Vd, fc_norm="eagle31" in attention,
                         norm_output="eagle31" in attention)
    d = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        d.d2t.copy_(torch.arange(Vd) % 7)  # a map that is not the identity
    d.eval()
    dec = ReferenceDecoder(torch.nn.Linear(1, 1), d, [1, 2, 3], [])
    total = 60
    feats = torch.randn(total, 3 * H)
    context = torch.randint(0, V, (total + 1,)).tolist()
    target = d.draft_to_target(torch.arange(Vd))
    cache, n, rounds = d.new_decode_cache(), 17, 0
    with torch.no_grad():
        while n <= total:
            sampled = rounds % 2 == 1
            drafts, dists = dec._draft(feats[:n], context[:n + 1], k, 0.7, sampled,
                                       torch.Generator().manual_seed(rounds), cache)
            assert [layer.length for layer in cache] == [n] * cfg.num_layers  # new ones only
            rows = whole_unrolling(d, feats[:n], context[:n + 1], drafts)
            for draft, dist, row in zip(drafts, dists, rows):
                if sampled:
                    assert torch.allclose(dist[target], torch.softmax(row / 0.7, -1),
                                          atol=1e-5), (n, attention)  # fp32 rounding
                else:
                    assert draft == int(target[row.argmax()]), (n, attention)
            rounds += 1
            n += 1 + rounds % (k + 1)
    assert rounds >= 10


def exact_distribution(verifier, prompt: list[int], n: int, temperature: float) -> dict:
    vocab = verifier.config.vocab_size
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=n):
            ids = torch.tensor([prompt + list(seq)])
            logits = verifier(ids).logits[0, len(prompt) - 1:-1].float()
            p = torch.softmax(logits / temperature, -1)
            probs[seq] = math.prod(float(p[i, t]) for i, t in enumerate(seq))
    return probs


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("draft_sample", ["greedy", "probabilistic"])
def test_sampled_output_is_distributed_as_the_verifiers_sampling(draft_sample):
    """3 tokens over a 4-token vocabulary, 3000 decodings with a fixed seed: the frequencies of
    the 64 sequences against the verifier's exact probabilities (chi-square, 1e-4 level).
    The drafter (flat, unlike the peaked verifier) is accepted 20-55% of the time, so accepting
    and correcting both count: accepting with p(d) instead of min(1, p/q) gives chi-square
    2085 against a bound of 114."""
    V, T, N, prompt = 4, 0.8, 3000, [1, 2, 3, 0]
    verifier = small_llama(vocab=V, seed=5, logit_scale=3.0)
    dec = ReferenceDecoder(verifier, drafter_for(verifier, V, seed=6, logit_scale=1.0),
                           [1, 2, 3], [])
    exact = exact_distribution(verifier, prompt, 3, T)
    counts = dict.fromkeys(exact, 0)
    rounds = accepted = 0
    for seed in range(N):
        out = dec.decode(prompt, k=2, temperature=T, max_tokens=3, draft_sample=draft_sample,
                         seed=seed)
        counts[tuple(out.tokens)] += 1
        rounds, accepted = rounds + out.rounds, accepted + out.accepted
    assert accepted / (2 * rounds) > 0.15  # drafts accepted often enough to matter
    cells = [(counts[s], N * p) for s, p in exact.items() if N * p >= 5]
    rest = sum(counts[s] for s, p in exact.items() if N * p < 5)
    rest_expected = N - sum(e for _, e in cells)
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    if rest_expected >= 5:
        cells.append((rest, rest_expected))
        chi2 += (rest - rest_expected) ** 2 / rest_expected
    assert chi2 < chi2_critical(len(cells) - 1), (chi2, len(cells))


def test_reads_the_drafter_from_a_vllm_export(tmp_path, tiny_verifier):
    """Through stage 05's export: the weights, d2t and aux ids the export writes."""
    from conftest import make_config, random_drafter, save_drafter
    from eagle3.export import run_export
    from eagle3.reference_decoder import load_drafter
    from eagle3.runs import Stage

    cfg = make_config(tmp_path, tiny_verifier, vocab={"draft_vocab_size": 256},
                      export={"formats": ["vllm"]})
    model = random_drafter(cfg, 256)
    with torch.no_grad():  # draft i -> target 4i: offsets 3i
        model.d2t.copy_(torch.arange(256) * 3)
        model.t2d.zero_()
        model.t2d[torch.arange(256) * 4] = True
    save_drafter(cfg, model)
    run_export(Stage(cfg, 5))

    loaded, aux = load_drafter(cfg, Stage(cfg, 5).dir / "vllm")
    assert aux == [1, 2, 3]
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    exported = model.trainable_state_dict()
    for name, tensor in loaded.trainable_state_dict().items():
        if tensor.is_floating_point():  # exported in bfloat16 (export.dtype), read as float32
            assert torch.equal(tensor, exported[name].to(torch.bfloat16).float()), name
