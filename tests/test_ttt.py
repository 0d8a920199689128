"""The TTT loss and metrics against a naive reference with an explicit (steps*T)^2 mask."""

import math

import pytest
import torch

from eagle3.model import DraftModelConfig, Eagle3DraftModel, apply_rope, rope_cos_sin
from eagle3.shards import collate, pack
from eagle3.teacher import VerifierHead, make_teacher
from eagle3.ttt import StepStats, TTTSpec, teacher_rows, training_targets, ttt_forward

V, VD, H, HT, NAUX = 96, 40, 32, 24, 3


def tiny_model(norm_before_residual=False, num_layers=1, **extra) -> Eagle3DraftModel:
    cfg = DraftModelConfig(hidden_size=H, target_hidden_size=HT, num_aux=NAUX,
                           intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, num_layers=num_layers, rms_norm_eps=1e-6,
                           rope_theta=10000.0, max_position_embeddings=256, vocab_size=V,
                           draft_vocab_size=VD, norm_before_residual=norm_before_residual,
                           **extra)
    torch.manual_seed(0)
    m = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        selected = torch.sort(torch.randperm(V)[:VD]).values
        m.d2t.copy_(selected - torch.arange(VD))
        m.t2d.zero_()
        m.t2d[selected] = True
    return m.double()


def samples(lengths):
    out = []
    for L in lengths:
        out.append({"input_ids": torch.randint(0, V, (L,)),
                    "loss_mask": (torch.rand(L) > 0.3).long(),
                    "aux": torch.randn(L, NAUX * HT, dtype=torch.float64),
                    "final": torch.randn(L, HT, dtype=torch.float64)})
    return out


# ---------------------------------------------------------------------------------------------
# Naive reference: one document at a time, keys of all steps concatenated, explicit mask.


def naive_layer(layer, h, emb, pos, keys, values, step, T, nbr):
    normed = layer.hidden_norm(h)
    residual = normed if nbr else h
    x = torch.cat([layer.input_layernorm(emb), normed], -1)
    a = layer.self_attn
    q = a.q_proj(x).view(T, a.n_heads, a.head_dim).transpose(0, 1)
    k = a.k_proj(x).view(T, a.n_kv, a.head_dim).transpose(0, 1)
    v = a.v_proj(x).view(T, a.n_kv, a.head_dim).transpose(0, 1)
    cos, sin = rope_cos_sin(pos, a.head_dim, 10000.0, h.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = a.n_heads // a.n_kv
    keys.append(k.repeat_interleave(rep, 0))
    values.append(v.repeat_interleave(rep, 0))
    K = torch.cat(keys, dim=1)      # [h, (step+1)*T, d]
    Vv = torch.cat(values, dim=1)
    mask = torch.zeros(T, (step + 1) * T, dtype=torch.bool)
    for t in range(T):
        mask[t, :t + 1] = True                      # step-0 keys, causal
        for j in range(1, step + 1):
            mask[t, j * T + t] = True               # own earlier steps, same position
    s = (q @ K.transpose(-1, -2)) / math.sqrt(a.head_dim)
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.softmax(s, -1) @ Vv
    h = residual + a.o_proj(o.transpose(0, 1).reshape(T, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def naive_doc(model, s, lm_head, steps, decay, nbr, temperature=0.7, reach="off"):
    """Per-step sums for one document, from the written-out definition (LK terms: the LK
    paper's acceptance alpha = sum_x min(p(x), q(x)), p the full softmax on draft tokens;
    `reach`: the loss at step k weighted by whether (greedy) or how likely (sampled) serving
    drafts step k from that position)."""
    T = len(s["input_ids"])
    ids, mask = s["input_ids"], s["loss_mask"].bool()
    full = s["final"] @ lm_head.T                   # verifier logits at every position
    draft_ids = torch.arange(VD) + model.d2t
    h = model.fc(s["aux"])
    keys, values = [], []
    out = {"ce": [], "n": [], "correct": [], "alive": [], "nla": [], "kl": [], "tv": [],
           "alpha_w": [], "alpha": [], "chain": [], "chain_g": []}
    alive = torch.ones(T, dtype=torch.bool)
    chain = torch.ones(T, dtype=torch.float64)
    chain_g = torch.ones(T, dtype=torch.float64)
    reached = torch.ones(T, dtype=torch.float64)
    started = torch.zeros(T, dtype=torch.bool)
    for k in range(steps):
        inp = torch.tensor([ids[t + 1 + k] if t + 1 + k < T else 0 for t in range(T)])
        h = naive_layer(model.layers[0], h, model.embed_tokens(inp), torch.arange(T) + k,
                        keys, values, k, T, nbr)
        logits = model.lm_head(model.norm(h))
        ce_sum, n, correct = 0.0, 0, torch.zeros(T, dtype=torch.bool)
        nla = kl = tv = alpha_w = alpha_all = 0.0
        counted = torch.zeros(T, dtype=torch.bool)
        a_temp = torch.zeros(T, dtype=torch.float64)
        g_temp = torch.zeros(T, dtype=torch.float64)
        here = torch.zeros(T, dtype=torch.float64)
        for t in range(T):
            src, tgt = t + 1 + k, t + 2 + k
            if src >= T:
                continue
            teacher = full[src]
            arg = int(teacher.argmax())
            pred = int(draft_ids[logits[t].argmax()])
            q = torch.softmax(logits[t], -1).detach()
            p_full = torch.softmax(teacher, -1)[draft_ids]
            alpha = sum(min(float(p_full[x]), float(q[x])) for x in range(VD))
            here[t] = alpha if reach == "sampled" else float(pred == arg)
            if tgt >= T or not mask[tgt]:
                continue
            n += 1
            counted[t] = True
            correct[t] = pred == arg
            alpha_all += alpha
            qt = torch.softmax(logits[t] / temperature, -1).detach()
            pt = torch.softmax(teacher / temperature, -1)[draft_ids]
            a_temp[t] = sum(min(float(pt[x]), float(qt[x])) for x in range(VD))
            g_temp[t] = float(pt[int(logits[t].argmax())])  # greedy draft, accepted w.p. p_T
            if model.t2d[arg]:
                p = torch.softmax(teacher[draft_ids], -1)
                ce_sum = ce_sum - reached[t] * (p * torch.log_softmax(logits[t], -1)).sum()
                kl = kl + (p * (p.log() - torch.log_softmax(logits[t], -1))).sum()
                nla = nla - math.log(max(alpha, 1e-5))
                tv = tv + (1 - alpha)
                alpha_w += alpha
        alive = alive & correct
        if reach != "off":
            reached = reached * here
        if k == 0:
            started = counted.clone()
        chain = chain * torch.where(counted, a_temp, torch.zeros_like(a_temp))
        out["chain"].append(float((chain * started).sum()))
        chain_g = chain_g * torch.where(counted, g_temp, torch.zeros_like(g_temp))
        out["chain_g"].append(float((chain_g * started).sum()))
        out["nla"].append(nla)
        out["kl"].append(kl)
        out["tv"].append(tv)
        out["alpha_w"].append(alpha_w)
        out["alpha"].append(alpha_all)
        out["ce"].append(ce_sum)
        out["n"].append(n)
        out["correct"].append(int(correct.sum()))
        out["alive"].append(int(alive.sum()))
    return out


@pytest.mark.parametrize("nbr", [False, True])
@pytest.mark.parametrize("lengths", [[13], [9, 6, 11]])
def test_ttt_matches_naive_reference(lengths, nbr):
    steps, decay = 4, 0.8
    model = tiny_model(norm_before_residual=nbr)
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    docs = samples(lengths)
    batch = collate(docs, max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    loss, stats = ttt_forward(model, batch, teacher, TTTSpec(steps, decay))

    refs = [naive_doc(model, d, lm_head, steps, decay, nbr) for d in docs]
    ref_loss = 0.0
    for k in range(steps):
        n = sum(r["n"][k] for r in refs)
        ce = sum(r["ce"][k] for r in refs)
        ref_loss = ref_loss + decay ** k * ce / max(n, 1)
        assert stats.counted[k] == n
        assert stats.correct[k] == sum(r["correct"][k] for r in refs)
        assert stats.full[k] == sum(r["alive"][k] for r in refs)
    torch.testing.assert_close(loss, torch.as_tensor(ref_loss, dtype=loss.dtype),
                               rtol=1e-6, atol=1e-6)  # loss math runs in fp32


@pytest.mark.parametrize("reach", ["greedy", "sampled"])
def test_reach_weighted_loss_matches_naive_reference(reach):
    """`train.reach_weight`: step k's loss at a position counts only as far as serving would
    draft step k there; the counts and metrics are those of the unweighted run."""
    steps, decay = 3, 0.8
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    docs = samples([13, 9, 11])
    batch = collate(docs, max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    loss, stats = ttt_forward(model, batch, teacher, TTTSpec(steps, decay, reach=reach))
    plain, plain_stats = ttt_forward(model, batch, teacher, TTTSpec(steps, decay))
    refs = [naive_doc(model, d, lm_head, steps, decay, False, reach=reach) for d in docs]
    want = sum(decay ** k * sum(r["ce"][k] for r in refs) / sum(r["n"][k] for r in refs)
               for k in range(steps))
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype),
                               rtol=1e-6, atol=1e-6)
    # later steps lost the positions that serving never reaches
    assert float(loss.detach()) < float(plain.detach())
    assert stats.correct == plain_stats.correct and stats.full == plain_stats.full


def test_kl_temperature_sharpens_the_target_only():
    """`train.kl_temperature`: the KL target is the verifier's draft-vocabulary softmax at that
    temperature (the naive reference with logits / tau); counts and argmax are unchanged."""
    steps, decay, tau = 3, 0.8, 0.5
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    docs = samples([13, 9])
    batch = collate(docs, max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    loss, stats = ttt_forward(model, batch, teacher, TTTSpec(steps, decay, kl_temperature=tau))
    _, plain_stats = ttt_forward(model, batch, teacher, TTTSpec(steps, decay))
    refs = [naive_doc(model, d, lm_head / tau, steps, decay, False) for d in docs]
    want = sum(decay ** k * sum(r["ce"][k] for r in refs) / sum(r["n"][k] for r in refs)
               for k in range(steps))
    torch.testing.assert_close(loss, torch.as_tensor(want, dtype=loss.dtype),
                               rtol=1e-6, atol=1e-6)
    assert stats.correct == plain_stats.correct and stats.counted == plain_stats.counted


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda"])
def test_lk_losses_and_sampled_estimate_match_naive_reference(loss):
    steps, decay, eta, temp = 3, 0.8, 3.0, 0.7
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    docs = samples([13, 9])
    batch = collate(docs, max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t),
                           temperature=temp)
    got, stats = ttt_forward(model, batch, teacher, TTTSpec(steps, decay, loss, eta), temp)
    refs = [naive_doc(model, d, lm_head, steps, decay, False, temp) for d in docs]
    want = 0.0
    for k in range(steps):
        n = sum(r["n"][k] for r in refs)
        if loss == "lk_alpha":
            step = sum(r["nla"][k] for r in refs) / n
        else:
            lam = math.exp(-eta * sum(r["alpha_w"][k] for r in refs) / n)
            step = (lam * sum(r["kl"][k] for r in refs)
                    + (1 - lam) * sum(r["tv"][k] for r in refs)) / n
        want += decay ** k * float(torch.as_tensor(step).detach())
        assert stats.alpha[k] == pytest.approx(sum(r["alpha"][k] for r in refs), rel=1e-5)
        assert stats.expected[k] == pytest.approx(sum(r["chain"][k] for r in refs), rel=1e-5)
        assert stats.expected_greedy[k] == pytest.approx(sum(r["chain_g"][k] for r in refs),
                                                         rel=1e-5)
    assert float(got.detach()) == pytest.approx(want, rel=1e-5)
    m = stats.metrics()
    chains = stats.counted[0]
    assert m["est_accept_len_sampled"] == pytest.approx(
        1 + sum(stats.expected) / chains, abs=1e-5)


def test_acceptance_probability_identity():
    """alpha = sum min(p, q) = 1 - TV(p, q) for full distributions, and with p restricted to
    the draft vocabulary it is at most p(V_d) (the mass the drafter can propose)."""
    from eagle3.ttt import acceptance_probability

    torch.manual_seed(3)
    z_q, z_p = torch.randn(5, V), torch.randn(5, V)
    alpha = acceptance_probability(z_q, z_p, z_p.logsumexp(-1))
    tv = 0.5 * (torch.softmax(z_p, -1) - torch.softmax(z_q, -1)).abs().sum(-1)
    torch.testing.assert_close(alpha, 1 - tv)
    draft_ids = torch.randperm(V)[:VD]
    restricted = acceptance_probability(torch.randn(5, VD), z_p[:, draft_ids], z_p.logsumexp(-1))
    assert (restricted <= torch.softmax(z_p, -1)[:, draft_ids].sum(-1) + 1e-6).all()
    # identical distributions on the draft vocabulary accept with probability p(V_d)
    same = acceptance_probability(z_p[:, draft_ids], z_p[:, draft_ids], z_p.logsumexp(-1))
    assert (same <= 1).all() and (same > 0).all()


@pytest.mark.parametrize("loss", ["kl", "lk_alpha", "lk_lambda"])
def test_losses_have_finite_gradients_on_edge_cases(loss):
    """No counted position at all, and teachers whose argmax lies outside the draft vocabulary:
    finite loss and gradients (zero where nothing counts)."""
    model = tiny_model().float()
    lm_head = torch.randn(V, HT)
    docs = [{k: (v.float() if v.is_floating_point() else v) for k, v in s.items()}
            for s in samples([12])]
    docs[0]["loss_mask"] = torch.zeros(12, dtype=torch.long)
    batch = collate(docs, 1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    out, _ = ttt_forward(model, batch, teacher, TTTSpec(3, 0.8, loss))
    out.backward()
    assert float(out.detach()) == 0.0
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    # every teacher argmax outside the draft vocabulary: nothing is trained, nothing breaks
    model.zero_grad()
    docs[0]["loss_mask"] = torch.ones(12, dtype=torch.long)
    batch = collate(docs, 1000)
    outside = (~model.t2d).nonzero().squeeze(1)
    head = torch.zeros(V, HT)
    head[outside[0]] = 50.0  # the argmax is always this token
    teacher = make_teacher(batch.final.abs() + 1,
                           VerifierHead.of(head, torch.arange(VD) + model.d2t))
    out, stats = ttt_forward(model, batch, teacher, TTTSpec(3, 0.8, loss))
    out.backward()
    assert float(out.detach()) == 0.0 and stats.counted[0] > 0
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters())


@pytest.mark.parametrize("steps", [1, 4])
def test_teacher_only_on_supervised_rows_changes_nothing(steps):
    """Skipping teacher rows no step reads (prompt positions) leaves loss, grads and counts
    bit-identical; a row wrongly skipped would turn its target into the uniform one."""
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    docs = samples([14, 9, 12])
    for d in docs:  # a prompt (no loss) then a supervised answer, as in real data
        d["loss_mask"][: len(d["loss_mask"]) // 2] = 0
    batch = collate(docs, max_tokens=1000)
    draft_ids = torch.arange(VD) + model.d2t
    rows = teacher_rows(batch)
    assert 0 < int(rows.sum()) < batch.num_tokens // 2 + 3
    results = []
    for teacher in (make_teacher(batch.final, VerifierHead.of(lm_head, draft_ids)),
                    make_teacher(batch.final, VerifierHead.of(lm_head, draft_ids), rows)):
        model.zero_grad()
        loss, stats = ttt_forward(model, batch, teacher, TTTSpec(steps, 0.8))
        loss.backward()
        results.append((loss.detach(), stats, [p.grad.clone() for p in model.parameters()
                                                if p.grad is not None]))
    (l1, s1, g1), (l2, s2, g2) = results
    assert torch.equal(l1, l2) and s1 == s2
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_loss_on_all_trains_on_prompt_positions_too():
    """`train.loss_on=all` counts every in-document target (prompt tokens too) and its teacher
    is computed there; `assistant` counts exactly the loss-masked targets."""
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    docs = samples([14, 9])
    for d in docs:
        d["loss_mask"][:] = 1
        d["loss_mask"][: len(d["loss_mask"]) // 2] = 0
    batch = collate(docs, max_tokens=1000)
    draft_ids = torch.arange(VD) + model.d2t
    assert training_targets(batch, "assistant") is batch
    counts = {}
    for loss_on in ("assistant", "all"):
        b = training_targets(batch, loss_on)
        teacher = make_teacher(b.final, VerifierHead.of(lm_head, draft_ids), teacher_rows(b))
        counts[loss_on] = ttt_forward(model, b, teacher, TTTSpec(3, 0.8))[1].counted
    # step k at aux position t >= 0 predicts x_{t+2+k}, t+2+k < L (a document of length L)
    assert counts["all"] == [sum(L - 2 - k for L in (14, 9)) for k in range(3)]
    assert counts["assistant"] == [sum(L - max(2 + k, L // 2) for L in (14, 9))
                                   for k in range(3)]
    assert torch.equal(batch.loss_mask.sum(), torch.tensor(7 + 5))  # the input is untouched


def test_packing_does_not_leak_between_documents():
    """A document's loss is the same alone and packed after another document."""
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    a, b = samples([10, 12])
    head = VerifierHead.of(lm_head, torch.arange(VD) + model.d2t)
    alone = collate([b], 1000)
    packed = collate([a, b], 1000)
    _, s_alone = ttt_forward(model, alone, make_teacher(alone.final, head), TTTSpec(3, 0.8))
    _, s_a = ttt_forward(model, collate([a], 1000),
                         make_teacher(collate([a], 1000).final, head), TTTSpec(3, 0.8))
    _, s_packed = ttt_forward(model, packed, make_teacher(packed.final, head), TTTSpec(3, 0.8))
    for k in range(3):
        assert s_packed.counted[k] == s_alone.counted[k] + s_a.counted[k]
        assert s_packed.correct[k] == s_alone.correct[k] + s_a.correct[k]


def test_gradients_reach_every_trainable_weight():
    model = tiny_model(num_layers=2).float()
    lm_head = torch.randn(V, HT)
    batch = collate([{k: (v.float() if v.is_floating_point() else v) for k, v in s.items()}
                     for s in samples([16])], 1000)
    head = VerifierHead.of(lm_head, torch.arange(VD) + model.d2t)
    loss, _ = ttt_forward(model, batch, make_teacher(batch.final, head), TTTSpec(3, 0.8))
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.embed_tokens.weight.grad is None


@pytest.mark.parametrize("norm_output", [False, True])
def test_bf16_autocast_keeps_every_step_in_one_dtype(norm_output):
    """Under bf16 autocast the fp32 norm weights promote what they touch; the state a step hands
    the next (EAGLE-3.1's normed output included) must stay bf16, or the next step's rope and
    keys come out fp32 beside bf16 ones and attention refuses them."""
    model = tiny_model(fc_norm=True, norm_output=norm_output).float()
    docs = [{k: (v.float() if v.is_floating_point() else v) for k, v in s.items()}
            for s in samples([12, 7])]
    batch = collate(docs, 1000)
    head = VerifierHead.of(torch.randn(V, HT), torch.arange(VD) + model.d2t)
    teacher = make_teacher(batch.final, head)  # outside autocast, as training builds it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, stats = ttt_forward(model, batch, teacher, TTTSpec(3, 0.8))
    loss.backward()
    assert torch.isfinite(loss) and stats.counted[2] > 0
    assert model.fc.weight.grad is not None


def test_metrics_definitions():
    s = StepStats(loss=[0.0] * 3, counted=[10, 9, 8], correct=[8, 6, 4], full=[8, 5, 2])
    m = s.metrics()
    assert m["acc"] == [0.8, round(6 / 9, 5), 0.5]
    assert m["full_acc"] == [0.8, 0.5, 0.2]
    assert m["cond_acc"] == [0.8, round(5 / 8, 5), 0.4]
    assert m["est_accept_len"] == pytest.approx(2.5)


def test_pack_respects_budget_and_order():
    assert pack([5, 5, 5, 20], [0, 1, 2, 3], 10) == [[0, 1], [2], [3]]


@pytest.mark.parametrize("fused", [False, True], ids=["recurrence", "fused-kernel"])
@pytest.mark.parametrize("n_later,chunk", [(0, 5), (2, 4), (3, 64)])
def test_linear_memory_attention_equals_the_dense_one(n_later, chunk, fused):
    """`TTTAttention`, as the plain recurrence (query blocks, scores recomputed in backward) and
    with the fused flash kernel merged with the diagonal keys, against the [L, L + n] score
    matrix built whole: outputs and every gradient, in float64."""
    from eagle3.model import TTTAttention, _FlashKernel

    B, h, L, d = 2, 3, 13, 8
    torch.manual_seed(1)
    q, k0, v0 = (torch.randn(B, h, L, d, dtype=torch.float64, requires_grad=True)
                 for _ in range(3))
    later = [(torch.randn(B, h, L, d, dtype=torch.float64, requires_grad=True),
              torch.randn(B, h, L, d, dtype=torch.float64, requires_grad=True))
             for _ in range(n_later)]
    scale = 0.3

    def dense():
        s = (q @ k0.transpose(-1, -2)) * scale
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        if later:
            s = torch.cat([s] + [(q * k).sum(-1, keepdim=True) * scale for k, _ in later], -1)
        p = torch.softmax(s, -1)
        out = p[..., :L] @ v0
        for j, (_, v) in enumerate(later):
            out = out + p[..., L + j, None] * v
        return out

    grad = torch.randn(B, h, L, d, dtype=torch.float64)
    inputs = [q, k0, v0] + [t for kv in later for t in kv]
    ref = dense()
    ref_grads = torch.autograd.grad(ref, inputs, grad)
    stack = (lambda i: torch.stack([kv[i] for kv in later], 3) if later
             else q.new_zeros(B, h, L, 0, d))
    ours = TTTAttention.apply(q, k0, v0, stack(0), stack(1), scale, chunk,
                              _FlashKernel("cpu") if fused else None)
    our_grads = torch.autograd.grad(ours, inputs, grad)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(our_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("loss", ["kl", "lk_alpha", "lk_lambda"])
def test_chunked_checkpointed_loss_equals_the_whole_one(loss, monkeypatch):
    """The step loss over token chunks under activation checkpointing (nothing float32 of
    [T, V_draft] saved for backward) against one chunk covering every row: the loss, every
    metric and every gradient."""
    import eagle3.ttt as ttt

    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    batch = collate(samples([13, 9, 11]), max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    spec = TTTSpec(3, 0.8, loss, reach="sampled")
    results = []
    for chunk in (1 << 20, 5):
        monkeypatch.setattr(ttt, "LOSS_CHUNK", chunk)
        model.zero_grad()
        got, stats = ttt_forward(model, batch, teacher, spec)
        got.backward()
        results.append((got.detach(), stats, {n: p.grad.clone() for n, p in
                                              model.named_parameters() if p.grad is not None}))
    (whole, s_whole, g_whole), (chunked, s_chunked, g_chunked) = results
    # the loss math runs in float32: only the order of its sums differs
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)
    assert s_chunked.correct == s_whole.correct and s_chunked.full == s_whole.full
    assert s_chunked.alpha == pytest.approx(s_whole.alpha, rel=1e-6)
    assert g_chunked.keys() == g_whole.keys() and len(g_whole) > 5
    for name in g_whole:
        torch.testing.assert_close(g_chunked[name], g_whole[name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_activation_checkpointing_changes_no_number(num_layers, monkeypatch):
    """`train.activation_checkpointing`: each TTT step recomputed in backward gives the same
    loss, metrics and gradients as the step kept whole. The checkpointed run goes first, with
    the fused kernel not yet checked in this process: its check, made on first use, must not
    be seen by the checkpoint (recomputation saves what the first forward saved)."""
    import eagle3.model
    monkeypatch.setattr(eagle3.model, "_KERNEL_CHECKED", {})
    model = tiny_model(num_layers=num_layers)
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    batch = collate(samples([13, 9, 11]), max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    results = []
    for on in (True, False):
        model.zero_grad()
        loss, stats = ttt_forward(model, batch, teacher,
                                  TTTSpec(4, 0.8, "lk_lambda", checkpoint_steps=on))
        loss.backward()
        results.append((loss.detach(), stats, {n: p.grad.clone() for n, p in
                                               model.named_parameters() if p.grad is not None}))
    (ckpt, s_ckpt, g_ckpt), (plain, s_plain, g_plain) = results
    assert torch.equal(ckpt, plain)
    assert s_ckpt.correct == s_plain.correct and s_ckpt.alpha == s_plain.alpha
    assert g_ckpt.keys() == g_plain.keys() and len(g_plain) > 5
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=1e-12, atol=1e-14)


def saved_for_backward(model, batch, teacher, spec) -> list[torch.Tensor]:
    """Every tensor autograd keeps for backward in one TTT forward (what checkpointed regions
    keep: their inputs and outputs)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ttt_forward(model, batch, teacher, spec)
    return saved


def test_what_backward_keeps_is_bounded():
    """The loss keeps no float32 [T, V_draft] tensor (only the logits' gradient, in their
    dtype: float64 here), and activation checkpointing keeps under a fifth of the bytes kept
    without it."""
    model = tiny_model()
    lm_head = torch.randn(V, HT, dtype=torch.float64)
    batch = collate(samples([40, 30, 50]), max_tokens=1000)
    teacher = make_teacher(batch.final, VerifierHead.of(lm_head, torch.arange(VD) + model.d2t))
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    for loss in ("kl", "lk_alpha", "lk_lambda"):
        kept = saved_for_backward(model, batch, teacher, TTTSpec(4, 0.8, loss))
        teacher_storage = teacher.draft_logits.untyped_storage().data_ptr()  # held anyway
        assert not [t.shape for t in kept if t.dtype == torch.float32 and t.shape[-1] == VD
                    and t.untyped_storage().data_ptr() != teacher_storage]
    whole = saved_for_backward(model, batch, teacher, TTTSpec(4, 0.8))
    ckpt = saved_for_backward(model, batch, teacher, TTTSpec(4, 0.8, checkpoint_steps=True))
    assert nbytes(ckpt) < nbytes(whole) / 5, (nbytes(ckpt), nbytes(whole))


def test_the_fused_kernel_is_used_where_it_agrees():
    """On this CPU the fused kernel matches the recurrence in every dtype the drafter trains
    in, so `ttt_attention` uses it (a build or dtype where it does not falls back, warned)."""
    from eagle3.model import fused_kernel
    for dtype in (torch.float32, torch.bfloat16):
        assert fused_kernel(torch.zeros(1, 2, 4, 64, dtype=dtype)) is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rms_norm_backward_equals_autograd(dtype):
    """The RMSNorm with its backward written out (it keeps x and one float per row) against
    autograd through the same formula: the output bit for bit, the gradients to rounding."""
    from eagle3.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(2, 7, 16) * 3).to(dtype).requires_grad_()
    grad = torch.randn(2, 7, 16, dtype=torch.float64)

    def reference(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    ours, ref = norm(x), reference(x, norm.weight)
    assert torch.equal(ours, ref)
    got = torch.autograd.grad(ours, (x, norm.weight), grad.to(ours.dtype))
    want = torch.autograd.grad(ref, (x, norm.weight), grad.to(ref.dtype))
    # the normalisation runs in float32 whatever x's dtype: float32 rounding either way
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float64 else dict(rtol=2e-2, atol=1e-2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def reference_step_loss(loss, z, t_logits, lse, weight, temperature, lam):
    """The per-position losses of eagle3/ttt.py's docstring, written plainly for autograd."""
    log_q = torch.log_softmax(z, -1)
    p_tilde = torch.softmax(t_logits / temperature, dim=-1)
    alpha = torch.minimum(torch.exp(t_logits - lse[..., None]), log_q.exp()).sum(-1)
    if loss == "kl":
        per_pos = -(p_tilde * log_q).sum(-1)
    elif loss == "lk_alpha":
        per_pos = -torch.log(alpha.clamp(min=1e-5))
    else:
        kl = (p_tilde * (torch.log(p_tilde.clamp(min=1e-30)) - log_q)).sum(-1)
        per_pos = lam * kl + (1 - lam) * (1 - alpha)
    return (per_pos * weight).sum()


@pytest.mark.parametrize("loss", ["kl", "lk_alpha", "lk_lambda"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_step_loss_equals_autograd(loss, temperature, monkeypatch):
    """`StepLoss` (each loss with its gradient made in forward, chunks of 3 rows) against
    autograd through the losses written plainly: the weighted sum, alpha against
    `acceptance_probability`, the logits' gradient; rows past the teacher's carry nothing."""
    import eagle3.ttt as ttt

    monkeypatch.setattr(ttt, "LOSS_CHUNK", 3)
    torch.manual_seed(0)
    T, n = 11, 8
    logits = (torch.randn(1, T, VD, dtype=torch.float64) * 2).requires_grad_()
    full = torch.randn(1, n, V, dtype=torch.float64) * 2
    t_logits, lse = full[..., :VD], full.logsumexp(-1)
    t_lse = (t_logits / temperature).logsumexp(-1)
    weight = (torch.rand(1, T) > 0.3).double()
    weight[:, n:] = 0
    lam = torch.tensor(0.3, dtype=torch.float64)
    total, alpha = ttt.StepLoss.apply(logits, t_logits, t_lse, lse, weight, temperature, loss,
                                      lam if loss == "lk_lambda" else None)
    (total * 0.37).backward()

    z = logits.detach()[:, :n].clone().requires_grad_()
    want = reference_step_loss(loss, z, t_logits, lse, weight[:, :n], temperature, lam)
    (want * 0.37).backward()
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits.grad[:, :n], z.grad, rtol=1e-12, atol=1e-12)
    assert logits.grad[:, :n].abs().sum() > 0
    assert torch.equal(logits.grad[:, n:], torch.zeros_like(logits.grad[:, n:]))
    torch.testing.assert_close(alpha[:, :n], ttt.acceptance_probability(z, t_logits, lse)
                               .double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(alpha[:, n:], torch.zeros_like(alpha[:, n:]))


def test_lk_alpha_below_its_floor_has_no_gradient():
    """-log max(alpha, 1e-5): a position whose draft puts no mass where the verifier does
    contributes -log 1e-5 and no gradient (as autograd through the clamp gives)."""
    import eagle3.ttt as ttt
    logits = torch.full((1, 2, VD), -50.0, dtype=torch.float64)
    logits[0, :, 0] = 50.0                 # q: all mass on token 0
    t_logits = torch.full((1, 2, VD), -50.0, dtype=torch.float64)
    t_logits[0, 0, 1] = 50.0               # row 0: p all on token 1 -> alpha ~ 0
    t_logits[0, 1, 0] = 50.0               # row 1: p on token 0 too -> alpha ~ 1
    lse = t_logits.logsumexp(-1)
    logits.requires_grad_()
    total, alpha = ttt.StepLoss.apply(logits, t_logits, lse, lse,
                                      torch.ones(1, 2, dtype=torch.float64), 1.0, "lk_alpha", None)
    total.backward()
    assert alpha[0, 0] < 1e-5 and alpha[0, 1] > 0.99
    assert float(total.detach()) == pytest.approx(-math.log(1e-5) - math.log(float(alpha[0, 1])))
    assert torch.equal(logits.grad[0, 0], torch.zeros(VD, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_swiglu_backward_equals_autograd(dtype):
    """The MLP's silu(gate) * up with its backward written out (gate and up kept, not
    silu(gate)) against autograd: the output bit for bit, the gradients to rounding."""
    from eagle3.model import _SwiGLU

    torch.manual_seed(0)
    gate, up = (torch.randn(2, 5, 12) * 3).to(dtype), torch.randn(2, 5, 12).to(dtype)
    grad = torch.randn(2, 5, 12).to(dtype)
    ins = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    ref_ins = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    ours = _SwiGLU.apply(*ins)
    ref = torch.nn.functional.silu(ref_ins[0]) * ref_ins[1]
    assert torch.equal(ours, ref)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(ours, ins, grad), torch.autograd.grad(ref, ref_ins, grad)):
        torch.testing.assert_close(a, b, **tol)
