"""Training-time acceptance estimate against the engine, on the very sequences it served.

    .venv/bin/python bench/bench_quality.py CONFIG [--k 3] [--temperature 0.6] [section.key=value ...]

Stage 06 records, for each MT-bench prompt, the answer vLLM wrote with the drafter at K
speculative tokens (the greedy cell `results/vllm-K_1_K+1-c*-mtbench-t0.json`), and the engine's mean acceptance length over those drafts. This rebuilds
the same conversations (prompt + served answer, rendered with the verifier's template),
captures the verifier's aux and final states as stage 02 does (same dtype round trip), and
runs the exported checkpoint (`export.checkpoint`) through the TTT metric with K steps:
estimated acceptance length = 1 + sum_k full_acc_k over the answer tokens. Both figures and
their relative gap go to stdout and `runs/<name>/bench_quality_k<K>.json`.

The two differ by construction in small ways: the engine drafts only from positions it reached
(after each accepted run), the estimate from every answer position, and vLLM serves the
verifier in its own dtype and kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3 import checkpoint as ckpt  # noqa: E402
from eagle3.bench import load_mtbench_prompts  # noqa: E402
from eagle3.config import load_config  # noqa: E402
from eagle3.data import tokenize_conversation  # noqa: E402
from eagle3.hidden_states import Capture, capture_samples  # noqa: E402
from eagle3.model import Eagle3DraftModel  # noqa: E402
from eagle3.runs import Stage  # noqa: E402
from eagle3.shards import dequantize_fp8, encode, pack  # noqa: E402
from eagle3.teacher import VerifierHead  # noqa: E402
from eagle3.ttt import StepStats, TTTSpec, prepare_batch, ttt_forward  # noqa: E402
from eagle3.verifier import (load_text_decoder, load_tokenizer, read_tensor,  # noqa: E402
                             stop_token_ids)


def as_stored(aux: torch.Tensor, final: torch.Tensor, dtype: str,
              n_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, final) after the round trip through stage 02's storage, as training saw them."""
    enc = encode(aux, final, dtype, n_aux)
    aux = dequantize_fp8(enc["aux"], enc["aux_scale"]) if "aux_scale" in enc else enc["aux"]
    return aux.float(), enc["final"].float()


def served_cell(cfg, k: int, temperature: float) -> dict:
    """The engine's MT-bench vLLM cell at depth `k` and `temperature`."""
    found = sorted((Stage(cfg, 6).dir / "results").glob(
        f"vllm-{k}_1_{k + 1}-c*-mtbench-t{temperature:g}.json"))
    if not found:
        sys.exit(f"no MT-bench vLLM cell at depth {k} and T={temperature:g} in "
                 f"{Stage(cfg, 6).dir}/results: run `python 06_deploy_and_bench.py "
                 f"{cfg.source}` with {k} in the vllm engine's depths and {temperature} in "
                 f"bench.temperature")
    return json.loads(found[0].read_text())


def served_samples(cfg, result: dict) -> list[dict[str, list[int]]]:
    """Input ids and loss mask of every conversation the engine served in a cell."""
    max_tokens = result["settings"]["max_tokens"]
    tok = load_tokenizer(cfg)
    stop_ids = set(stop_token_ids(tok, cfg))
    samples = []
    for p in load_mtbench_prompts(result["num_requests"]):
        answer = result["outputs"][p["id"]]
        ids, mask = tokenize_conversation(tok, [*p["messages"],
                                                {"role": "assistant", "content": answer}],
                                          stop_ids)
        # An answer cut at max_tokens never produced the end-of-turn the template appends.
        seen = 0
        for i, m in enumerate(mask):
            seen += m
            if m and seen > max_tokens:
                mask[i] = 0
        samples.append({"input_ids": ids, "loss_mask": mask})
    return samples


def estimate(cfg, samples: list[dict], model: Eagle3DraftModel, k: int, batch_tokens: int,
             temperature: Optional[float]) -> dict:
    """The TTT metrics of `model` on `samples`, the verifier's states captured as stage 02
    does (same dtype round trip); with `temperature`, the sampled estimates too."""
    aux_ids = list(cfg.verifier_info.aux_layer_ids)
    base = load_text_decoder(cfg.verifier_path, cfg.verifier.dtype, [torch.device("cpu")],
                             cfg.verifier.trust_remote_code)
    states = capture_samples(base, Capture(base, aux_ids), [s["input_ids"] for s in samples],
                             batch_tokens)
    del base
    docs = []
    for s, (aux, final) in zip(samples, states):
        aux, final = as_stored(aux, final, cfg.hidden_states.dtype, len(aux_ids))
        docs.append({"input_ids": torch.tensor(s["input_ids"]),
                     "loss_mask": torch.tensor(s["loss_mask"]), "aux": aux, "final": final})
    lm_head = read_tensor(cfg.verifier_path, "lm_head").float()
    head = VerifierHead.of(lm_head, torch.arange(len(model.d2t)) + model.d2t)
    stats = StepStats.zeros(k, temperature)
    lengths = [len(d["input_ids"]) for d in docs]
    for group in pack(lengths, list(range(len(docs))), batch_tokens):
        batch, teacher = prepare_batch([docs[i] for i in group], batch_tokens,
                                       torch.device("cpu"), torch.float32, head,
                                       temperature=temperature)
        stats.add(ttt_forward(model, batch, teacher, TTTSpec(k, 0.8), temperature)[1])
    return stats.metrics()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="section.key=value, as given to the stages")
    ap.add_argument("--k", type=int, default=3, help="speculative tokens of the bench run")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="also the expected acceptance at this sampling temperature, on the "
                         "text the engine sampled at it, against that cell")
    args = ap.parse_intermixed_args()
    cfg = load_config(args.config, args.overrides)
    torch.set_grad_enabled(False)

    aux_ids = list(cfg.verifier_info.aux_layer_ids)
    c = ckpt.load(ckpt.resolve(Stage(cfg, 4).dir, cfg.export.checkpoint))
    if c.aux_layer_ids != aux_ids:
        sys.exit(f"{c.path} was trained on aux ids {c.aux_layer_ids}, the config says {aux_ids}")
    model = Eagle3DraftModel(c.draft).eval()
    model.load_state_dict({**c.weights,
                           "embed_tokens.weight": read_tensor(cfg.verifier_path, "embed")})

    result = served_cell(cfg, args.k, 0.0)
    samples = served_samples(cfg, result)
    est = estimate(cfg, samples, model, args.k, args.batch_tokens, None)
    engine = result["mean_acceptance_length"]
    out = {"checkpoint": str(c.path), "k": args.k, "prompts": len(samples),
           "answer_tokens": int(sum(sum(s["loss_mask"]) for s in samples)),
           "engine_accept_len": round(engine, 4),
           "engine_per_position": [round(x, 4) for x in result["per_position_acceptance"]],
           "estimate_accept_len": est["est_accept_len"], "estimate_full_acc": est["full_acc"],
           "estimate_acc": est["acc"],
           "relative_gap": round((est["est_accept_len"] - engine) / engine, 4)}
    if args.temperature:
        sampled = served_cell(cfg, args.k, args.temperature)
        est_t = estimate(cfg, served_samples(cfg, sampled), model, args.k, args.batch_tokens,
                         args.temperature)
        out |= {"temperature": args.temperature,
                "engine_accept_len_sampled": round(sampled["mean_acceptance_length"], 4),
                "engine_per_position_sampled": [
                    round(x, 4) for x in sampled["per_position_acceptance"]],
                "estimate_accept_len_sampled": est_t["est_accept_len_sampled"],
                "estimate_accept_len_greedy_draft": est_t["est_accept_len_greedy_draft"],
                "estimate_argmax_agreement_on_sampled_text": est_t["acc"]}
    name = f"bench_quality_k{args.k}" + (f"_t{args.temperature:g}" if args.temperature else "")
    path = Path(cfg.run_dir) / f"{name}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    print(f"engine {engine:.3f} vs training-time estimate {est['est_accept_len']:.3f} "
          f"({100 * out['relative_gap']:+.1f}%) -> {path}")


if __name__ == "__main__":
    main()
