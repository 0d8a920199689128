"""Training throughput of our TTT drafter vs speculators 0.9.0's Eagle3DraftModel (CPU).

    .venv/bin/python bench/bench_train.py [--tokens 2048] [--draft-vocab 8192] [--ttt 7]

A SmolLM2-135M-sized drafter (hidden 576, 9 heads / 3 KV heads, head_dim 64, intermediate
1536, vocab 49152, one layer), the same weights and the same packed batch of several
documents for both; one forward + backward of the whole TTT unroll per iteration, fp32.
speculators runs with `draft_attn_impl` sdpa (or eager) and its eager loss
(`resolve_loss_config("kl_div", "eager")`); its verifier head is applied inside its forward,
ours is `make_teacher` (full-vocabulary logits, for the in-vocabulary argmax check) and is
timed separately. Each implementation runs in its own subprocess so that peak memory
(`ru_maxrss`) belongs to one of them; "train peak" is the rise of the peak over the resident
size right before the first iteration (model and batch built, no optimizer).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.model import DraftModelConfig, Eagle3DraftModel  # noqa: E402
from eagle3.shards import collate  # noqa: E402
from eagle3.teacher import VerifierHead, make_teacher  # noqa: E402
from eagle3.ttt import TTTSpec, ttt_forward  # noqa: E402

VOCAB, HIDDEN = 49152, 576


def draft_config(draft_vocab: int) -> DraftModelConfig:
    return DraftModelConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_aux=3,
                            intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, head_dim=64, num_layers=1, rms_norm_eps=1e-5,
                            rope_theta=100000.0, max_position_embeddings=8192,
                            vocab_size=VOCAB, draft_vocab_size=draft_vocab)


def doc_lengths(tokens: int, docs: int) -> list[int]:
    """Uneven document lengths summing to `tokens` (a realistic packed row)."""
    weights = [1.0 + 0.5 * ((i * 7) % 5) for i in range(docs)]
    lengths = [max(8, int(tokens * w / sum(weights))) for w in weights]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def setup(args: argparse.Namespace):
    """Model, verifier head/norm and packed documents; identical in both workers (seeded)."""
    torch.manual_seed(0)
    model = Eagle3DraftModel(draft_config(args.draft_vocab))
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 0.02)
        selected = torch.randperm(VOCAB)[:args.draft_vocab].sort().values
        model.d2t.copy_(selected - torch.arange(args.draft_vocab))
        model.t2d.zero_()
        model.t2d[selected] = True
    verifier_head = torch.randn(VOCAB, HIDDEN) * 0.02
    verifier_norm = torch.rand(HIDDEN) + 0.5
    model.lm_head.weight.data.copy_(verifier_head[selected])
    docs = []
    for L in doc_lengths(args.tokens, args.docs):
        y = torch.randn(L, HIDDEN)
        final = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5) * verifier_norm
        docs.append({"input_ids": torch.randint(0, VOCAB, (L,)),
                     "loss_mask": (torch.arange(L) >= 16).long(),
                     "aux": torch.randn(L, 3 * HIDDEN), "final": final, "y": y})
    return model, verifier_head, verifier_norm, selected, docs


def run_ours(args, model, verifier_head, docs) -> tuple[callable, dict]:
    batch = collate([{k: v for k, v in d.items() if k != "y"} for d in docs], 1 << 30)
    head = VerifierHead.of(verifier_head, torch.arange(args.draft_vocab) + model.d2t)
    teacher_s: list[float] = []

    def step() -> None:
        t0 = time.perf_counter()
        teacher = make_teacher(batch.final, head)
        teacher_s.append(time.perf_counter() - t0)
        loss, _ = ttt_forward(model, batch, teacher, TTTSpec(args.ttt, 0.8))
        loss.backward()
        model.zero_grad(set_to_none=True)
    return step, {"teacher_s": teacher_s}


def run_speculators(args, model, verifier_head, verifier_norm, selected, docs):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel as SpecEagle3
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    c = model.cfg
    layer = LlamaConfig(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
                        max_position_embeddings=c.max_position_embeddings,
                        rope_theta=c.rope_theta)
    layer._attn_implementation = args.attn
    spec = SpecEagle3(Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=c.draft_vocab_size,
        norm_before_residual=False, norm_before_fc=False, norm_output=False,
        eagle_aux_hidden_state_layer_ids=[2, 15, 27],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt)],
            verifier=VerifierConfig(name_or_path="smollm2", architectures=["LlamaForCausalLM"]))))
    state = dict(model.state_dict())
    state["verifier_lm_head.weight"] = verifier_head[selected]
    state["verifier_norm.weight"] = verifier_norm
    spec.load_state_dict(state, strict=True)
    del model
    # their packed row: shift_batch per document (see tests/test_speculators_parity.py)
    cat = lambda xs: torch.cat(xs)[None]  # noqa: E731
    inputs = {
        "input_ids": cat([d["input_ids"][1:] for d in docs]),
        "hidden_states": cat([d["aux"][:-1] for d in docs]),
        "verifier_last_hidden_states": cat([d["y"][1:] for d in docs]),
        # their mask marks the input token, ours the predicted one: hand them ours shifted
        "loss_mask": cat([torch.cat([d["loss_mask"][2:], d["loss_mask"].new_zeros(1)]).bool()
                          for d in docs]),
        "position_ids": cat([torch.arange(len(d["input_ids"]))[1:] for d in docs]),
        "document_ids": cat([torch.full((len(d["input_ids"]) - 1,), i)
                             for i, d in enumerate(docs)]),
    }
    loss_config = resolve_loss_config("kl_div", "eager")

    def step() -> None:
        _, loss, _ = spec(**inputs, ttt_steps=args.ttt, ttt_step_loss_decay=0.8,
                          loss_config=loss_config)
        loss.backward()
        spec.zero_grad(set_to_none=True)
    return step, {}


def worker(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, verifier_head, verifier_norm, selected, docs = setup(args)
    if args.worker == "ours":
        step, extra = run_ours(args, model, verifier_head, docs)
    else:
        step, extra = run_speculators(args, model, verifier_head, verifier_norm, selected, docs)
    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    best = min(times)
    out = {"impl": args.worker, "s_per_iter": [round(t, 3) for t in times],
           "tokens_per_s": round(args.tokens / best, 1), "peak_rss_mb": round(peak_mb),
           "rss_before_mb": round(base_mb)}
    if extra.get("teacher_s"):
        teacher = min(extra["teacher_s"][args.warmup:] or extra["teacher_s"])
        out["teacher_s"] = round(teacher, 3)
        out["tokens_per_s_model_only"] = round(args.tokens / (best - teacher), 1)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens per batch")
    ap.add_argument("--docs", type=int, default=5, help="documents in the packed batch")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--iters", type=int, default=3, help="timed iterations (best is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa",
                    help="speculators' draft_attn_impl")
    ap.add_argument("--worker", choices=["ours", "speculators"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for impl in ("ours", "speculators"):
        cmd = [sys.executable, __file__, "--worker", impl] + sys.argv[1:]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"{impl} worker failed:\n{proc.stderr[-3000:]}")
        results[impl] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(results[impl]))
    ours, theirs = results["ours"], results["speculators"]
    threads = args.threads or torch.get_num_threads()
    print(f"tokens {args.tokens} in {args.docs} documents, draft vocab {args.draft_vocab}, "
          f"TTT {args.ttt}, speculators attn {args.attn}, torch threads {threads}")
    print(f"ours        {ours['tokens_per_s']:8.1f} tok/s (incl. teacher), "
          f"{ours['tokens_per_s_model_only']:8.1f} tok/s model only, peak RSS "
          f"{ours['peak_rss_mb']} MB (+{ours['peak_rss_mb'] - ours['rss_before_mb']})")
    print(f"speculators {theirs['tokens_per_s']:8.1f} tok/s (teacher inside), peak RSS "
          f"{theirs['peak_rss_mb']} MB (+{theirs['peak_rss_mb'] - theirs['rss_before_mb']})")
    print(f"speed-up {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x incl. teacher, "
          f"{ours['tokens_per_s_model_only'] / theirs['tokens_per_s']:.2f}x model only")


if __name__ == "__main__":
    main()
