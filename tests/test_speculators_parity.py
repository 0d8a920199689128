"""Our drafter and TTT loss against speculators 0.9.0's `Eagle3DraftModel` (the reference).

    .venv/bin/pytest tests/test_speculators_parity.py -q

speculators is installed by `make setup` (`pip install --no-deps speculators==0.9.0`); if it
cannot be imported this module fails, it does not skip.

Both models get the same weights (ours copied into theirs; their frozen `verifier_lm_head` =
the verifier's lm_head rows of the draft vocabulary, their `verifier_norm` = the verifier's
final norm), the same flags (norm_before_residual both ways, norm_before_fc=False,
EAGLE-3.1's fc_norm and norm_output off and on, frozen embedding), the same TTT depth and step decay, on CPU with
`draft_attn_impl` eager or sdpa and `resolve_loss_config("kl_div", "eager")`.

Where the two definitions differ, and what is therefore compared:

- Alignment. Ours keeps each document whole: position t holds aux g_t and TTT step k feeds
  x_{t+1+k}. speculators first applies `shift_batch` per document (drops x_0, g_{L-1}, y_0,
  l_0), so its position i is our t = i of the same document, one position shorter. Its RoPE
  positions start at 1 (`position_ids[1:]`), ours at 0; RoPE is relative, so the scores agree
  up to rounding.
- Per-step logits are compared at every position whose step-k input token lies inside its
  document (our t + 1 + k < doc end). speculators shifts the packed row as a whole, so at later
  steps the last positions of a document read the next document's tokens; those positions are
  masked out of our loss and are not compared.
- Loss positions. Our step-k term at t counts when the *predicted* token x_{t+2+k} is in the
  document and supervised (loss_mask[t+2+k]). speculators masks with the shifted loss mask of
  the *input* token (l_{i+1+k}) and does not stop at document ends. The batch therefore gives
  speculators our mask shifted left by one per document, and every document starts with more
  unsupervised tokens than TTT steps, so both select exactly the same positions.
- Loss function. Ours is the soft cross-entropy -sum p log q against the verifier distribution
  restricted to the draft vocabulary, divided by the positions counted; speculators' `kl_div`
  is KL(p || q) = CE - H(p), divided by (positions + 1e-5). The teacher's entropy H(p) has no
  gradient, so we compare our per-step CE minus the mean teacher entropy with their per-step
  KL (their `loss_k_sum` / decay^k, rescaled by (n + 1e-5) / n), the totals the same way, and
  the gradients of every weight both models train (their lm_head is frozen).
- Our loss also drops positions whose teacher argmax is outside the draft vocabulary;
  speculators keeps them. The verifier head here puts every argmax inside the draft vocabulary
  (asserted), so the sets agree. With that, their full_acc_k counts equal ours.
"""

import math

import pytest
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel as SpecEagle3
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

from eagle3.model import DraftModelConfig, Eagle3DraftModel
from eagle3.shards import collate  # noqa: E402
from eagle3.teacher import VerifierHead, make_teacher
from eagle3.ttt import TTTSpec, ttt_forward

_V, _VD, _H = 160, 48, 32
_TTT, _DECAY = 4, 0.8
_LENGTHS = [17, 9, 21]
_PREFIX = [6, 5, 8]  # unsupervised tokens at the start of each document (> TTT steps)
_TOL = dict(rtol=1e-5, atol=1e-5)


def our_config(nbr: bool, layers: int, eagle31: bool = False) -> DraftModelConfig:
    return DraftModelConfig(hidden_size=_H, target_hidden_size=_H, num_aux=3,
                            intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, num_layers=layers, rms_norm_eps=1e-6,
                            rope_theta=10000.0, max_position_embeddings=256, vocab_size=_V,
                            draft_vocab_size=_VD, norm_before_residual=nbr,
                            fc_norm=eagle31, norm_output=eagle31)


def spec_model(cfg: DraftModelConfig, attn: str) -> SpecEagle3:
    layer = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_hidden_layers=cfg.num_layers,
                        num_attention_heads=cfg.num_attention_heads,
                        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                        rms_norm_eps=cfg.rms_norm_eps, vocab_size=cfg.vocab_size,
                        max_position_embeddings=cfg.max_position_embeddings,
                        rope_theta=cfg.rope_theta)
    layer._attn_implementation = attn
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=cfg.norm_before_residual, norm_before_fc=False,
        fc_norm=cfg.fc_norm, norm_output=cfg.norm_output, embed_requires_grad=False, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=_TTT)],
            verifier=VerifierConfig(name_or_path="tiny", architectures=["LlamaForCausalLM"])))
    return SpecEagle3(config)


def setup(nbr: bool, layers: int, attn: str, eagle31: bool = False):
    torch.manual_seed(0)
    cfg = our_config(nbr, layers, eagle31)
    ours = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.uniform_(0.8, 1.2)
        ours.embed_tokens.weight.normal_()
        ours.lm_head.weight.normal_(0, 0.2)
        selected = torch.randperm(_V)[:_VD].sort().values
        ours.d2t.copy_(selected - torch.arange(_VD))
        ours.t2d.zero_()
        ours.t2d[selected] = True
    # The verifier: pre-norm final states y, final norm weight, full-vocabulary head whose
    # rows outside the draft vocabulary score 0, so every argmax is a draft token.
    verifier_head = torch.randn(_V, _H) * (ours.t2d[:, None].float())
    verifier_norm = torch.rand(_H) + 0.5
    theirs = spec_model(cfg, attn)
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    state["verifier_lm_head.weight"] = verifier_head[selected].clone()
    state["verifier_norm.weight"] = verifier_norm.clone()
    theirs.load_state_dict(state, strict=True)
    return ours, theirs, verifier_head


def documents(theirs: SpecEagle3) -> list[dict[str, torch.Tensor]]:
    docs = []
    for L, prefix in zip(_LENGTHS, _PREFIX):
        y = torch.randn(L, _H)
        with torch.no_grad():
            final = theirs.verifier_norm(y)  # our stage 02 stores post-norm final states
        docs.append({"input_ids": torch.randint(0, _V, (L,)),
                     "loss_mask": (torch.arange(L) >= prefix).long(),
                     "aux": torch.randn(L, 3 * _H), "final": final, "y": y})
    return docs


def spec_batch(docs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """speculators' packed batch: shift_batch per document, then concatenated."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in
                                            ("input_ids", "hidden_states", "loss_mask",
                                             "position_ids", "verifier_last_hidden_states",
                                             "document_ids")}
    for d, doc in enumerate(docs):
        L = len(doc["input_ids"])
        # their loss mask marks the input token; ours the predicted one (module docstring)
        mask = torch.cat([doc["loss_mask"][1:], torch.zeros(1, dtype=torch.long)]).bool()
        parts["input_ids"].append(doc["input_ids"][1:])
        parts["hidden_states"].append(doc["aux"][:-1])
        parts["verifier_last_hidden_states"].append(doc["y"][1:])
        parts["loss_mask"].append(mask[1:])
        parts["position_ids"].append(torch.arange(L)[1:])
        parts["document_ids"].append(torch.full((L - 1,), d))
    return {k: torch.cat(v)[None] for k, v in parts.items()}


def capture_lm_head(model: torch.nn.Module) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda m, i, o: out.append(o.detach()))
    return out


@pytest.mark.parametrize("attn,nbr,layers,eagle31", [
    ("eager", False, 1, False), ("eager", True, 1, False), ("sdpa", False, 1, False),
    ("sdpa", True, 1, False), ("eager", False, 2, False),
    ("sdpa", False, 1, True), ("eager", False, 2, True)])  # EAGLE-3.1: fc_norm + norm_output
def test_logits_loss_and_gradients_match_speculators(attn, nbr, layers, eagle31):
    ours, theirs, verifier_head = setup(nbr, layers, attn, eagle31)
    docs = documents(theirs)
    draft_ids = torch.arange(_VD) + ours.d2t

    batch = collate([{k: v for k, v in d.items() if k != "y"} for d in docs], 10_000)
    teacher = make_teacher(batch.final, VerifierHead.of(verifier_head, draft_ids))
    assert bool(ours.t2d[teacher.argmax].all())  # precondition: see module docstring
    our_logits = capture_lm_head(ours)
    our_loss, stats = ttt_forward(ours, batch, teacher, TTTSpec(_TTT, _DECAY))
    our_loss.backward()

    sb = spec_batch(docs)
    their_logits = capture_lm_head(theirs)
    _, their_loss, metrics = theirs(
        hidden_states=sb["hidden_states"], input_ids=sb["input_ids"],
        document_ids=sb["document_ids"], loss_mask=sb["loss_mask"],
        position_ids=sb["position_ids"],
        verifier_last_hidden_states=sb["verifier_last_hidden_states"], ttt_steps=_TTT,
        ttt_step_loss_decay=_DECAY, loss_config=resolve_loss_config("kl_div", "eager"))
    their_loss.backward()
    assert len(our_logits) == len(their_logits) == _TTT

    # 1. per-step logits at every position whose input token is inside its document
    with torch.no_grad():
        targets = theirs.verifier_lm_head(theirs.verifier_norm(sb["verifier_last_hidden_states"]))
    ours_off = theirs_off = 0
    for L in _LENGTHS:
        for k in range(_TTT):
            n = L - 1 - k
            torch.testing.assert_close(our_logits[k][0, ours_off:ours_off + n],
                                       their_logits[k][0, theirs_off:theirs_off + n], **_TOL)
        ours_off, theirs_off = ours_off + L, theirs_off + L - 1

    # 2. per-step loss: our soft CE - teacher entropy == their KL, on the same positions
    corrected_total = 0.0
    for k in range(_TTT):
        t = targets[:, k:]
        m = sb["loss_mask"][:, k:].float()
        n = float(m.sum())
        assert stats.counted[k] == n
        p = torch.softmax(t.float(), -1)
        entropy = float((-(p * torch.log_softmax(t.float(), -1)).sum(-1) * m).sum() / n)
        their_k = float(metrics[f"loss_{k}_sum"]) / _DECAY ** k * (n + 1e-5) / n
        assert math.isclose(stats.loss[k] - entropy, their_k, rel_tol=1e-5, abs_tol=1e-5)
        corrected_total += _DECAY ** k * (stats.loss[k] - entropy) * n / (n + 1e-5)
        # accuracy: chains of correct steps, counted the same way
        assert stats.full[k] == int(metrics[f"full_acc_{k}_sum"])
    assert math.isclose(corrected_total, float(their_loss.detach()), rel_tol=1e-5, abs_tol=1e-5)

    # 3. gradients of every weight both train (their lm_head is frozen)
    spec_params = dict(theirs.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if not p.requires_grad or name == "lm_head.weight":
            continue
        torch.testing.assert_close(p.grad, spec_params[name].grad, rtol=1e-4, atol=1e-6)
        compared += 1
    assert compared == len([n for n, q in spec_params.items() if q.requires_grad])
