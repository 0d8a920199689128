"""EAGLE-3 speculative decoding in plain PyTorch: what an exported drafter *should* accept,
independent of any serving engine (stage 06's `bench.engines: [{name: hf}]`).

    decoder = ReferenceDecoder.load(cfg, export_dir)          # 05_export/vllm: what is shipped
    out = decoder.decode(prompt_ids, k=3, temperature=0.0, max_tokens=64)

The drafter is read from the vLLM export through the same reader as any base drafter
(`eagle3.base_drafter`), with the aux ids the export writes and vLLM's reading of a missing
`d2t` (zeros): an export fault shows here too, and an engine that accepts clearly less than
this decoder on the same prompts has a fault of its own (docs/engines.md, "Engine parity").

One round, for a chain of `k` drafts (the engines' chain drafting):
1. Draft: step 0 over the positions whose aux states arrived since the last round (state t
   with token t+1 at RoPE position t; their keys join the drafter's cache, as in an engine),
   then k - 1 more steps at the last position only, each fed its own pre-norm hidden state
   and the previous draft: the training-time-test unrolling (`Eagle3DraftModel.step`) read
   at the last position, computed for that position alone (`DecodeCache`;
   tests/test_reference_decoder.py checks it against the whole unrolling).
2. Verify: one verifier forward over [last token, drafts] on its KV cache.
3. Accept: at T = 0 the longest prefix equal to the verifier's argmax, then the verifier's
   token. At T > 0 speculative sampling: draft d is accepted with min(1, p(d) / q(d)), p the
   verifier's and q the drafter's distribution at temperature T (q one-hot for greedy
   drafts, `draft_sample: greedy`); the first rejection is replaced by a sample of
   max(p - q, 0) renormalised; with every draft accepted a bonus token comes from p. The
   output is distributed as the verifier's own sampling (lossless); at T = 0 it is the
   verifier's greedy decoding.
4. The cache is cut back to the kept tokens; their aux states join the drafter's input.

Counts are the engines': one draft per round, acceptance length = 1 + accepted / drafts,
per-position acceptance = share of rounds that accepted more than p drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from eagle3.config import Config, default_aux_layer_ids
from eagle3.model import DecodeCache, Eagle3DraftModel
from eagle3.runs import StageError


@dataclass
class Decoded:
    """One prompt's decoding: the generated ids and the acceptance counts of its rounds."""
    tokens: list[int]
    rounds: int = 0
    accepted: int = 0
    accepted_hist: list[int] = field(default_factory=list)
    """accepted_hist[n] = rounds that accepted exactly n drafts (n = 0..k)."""
    seconds: float = 0.0


def acceptance(decoded: list[Decoded], k: int) -> dict[str, Any]:
    """The engines' acceptance figures over many decodings of chains of k drafts."""
    rounds = sum(d.rounds for d in decoded)
    accepted = sum(d.accepted for d in decoded)
    hist = [sum(d.accepted_hist[n] for d in decoded) for n in range(k + 1)]
    return {"num_drafts": rounds, "num_draft_tokens": rounds * k, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / rounds if rounds else None,
            "per_position_acceptance": [sum(hist[p + 1:]) / rounds for p in range(k)]
            if rounds else [],
            "draft_acceptance_rate": accepted / (rounds * k) if rounds else None}


def _sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


class ReferenceDecoder:
    def __init__(self, verifier: torch.nn.Module, drafter: Eagle3DraftModel, aux_ids: list[int],
                 stop_ids: list[int]):
        self.verifier = verifier
        self.drafter = drafter
        self.aux_ids = list(aux_ids)
        self.stop_ids = set(stop_ids)
        self.device = next(verifier.parameters()).device
        self.vocab = drafter.cfg.vocab_size

    @classmethod
    def load(cls, cfg: Config, export_dir: Path, device: Optional[str] = None
             ) -> "ReferenceDecoder":
        """The verifier (transformers, `verifier.dtype`) and the drafter of `export_dir`."""
        from eagle3.verifier import load_text_lm, load_tokenizer, stop_token_ids

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        verifier = load_text_lm(cfg.verifier_path, cfg.verifier.dtype, device,
                                trust_remote_code=cfg.verifier.trust_remote_code)
        drafter, aux_ids = load_drafter(cfg, export_dir)
        return cls(verifier, drafter.to(device), aux_ids,
                   stop_token_ids(load_tokenizer(cfg), cfg))

    # -- one round's parts --------------------------------------------------------------------

    def _verifier_step(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[n, V]` (fp32) and aux states `[n, n_aux*H]` of `ids` appended to `cache`."""
        out = self.verifier(input_ids=torch.tensor([ids], device=self.device),
                            past_key_values=cache, use_cache=True, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_ids], dim=-1)
        return out.logits[0].float(), aux

    def _draft(self, feats: torch.Tensor, context: list[int], k: int, temperature: float,
               sampled: bool, generator: torch.Generator, cache: list[DecodeCache]
               ) -> tuple[list[int], list[Optional[torch.Tensor]]]:
        """k draft tokens (target ids) after `context`, and for sampled drafts the drafter's
        distribution over the target vocabulary each was drawn from (None: greedy). `cache`
        holds the step-0 keys of the positions drafted from in earlier rounds; the rest of
        `feats` is new."""
        d = self.drafter
        n = feats.shape[0]  # = len(context) - 1: the last token has no aux state yet
        done = cache[0].length
        h = d.project(feats[None, done:].to(d.fc.weight.dtype))
        ids = torch.tensor([context[done + 1:]], device=self.device)
        positions = torch.arange(done, n, device=self.device)[None]
        for layer in cache:
            layer.extend()
        drafts, dists = [], []
        for step in range(k):
            h, logits = d.step(h, ids, positions, None, cache)
            if step == 0:
                for layer in cache:
                    layer.draft()
                h, positions = h[:, -1:], positions[:, -1:]
            last = logits[0, -1].float()
            if sampled:
                probs = torch.softmax(last / temperature, dim=-1)
                pick = _sample(probs, generator)
                dist = torch.zeros(self.vocab, device=self.device)
                dist[d.draft_to_target(torch.arange(last.numel(), device=self.device))] = probs
            else:
                pick, dist = int(last.argmax()), None
            target = int(d.draft_to_target(torch.tensor(pick, device=self.device)))
            drafts.append(target)
            dists.append(dist)
            ids, positions = torch.tensor([[target]], device=self.device), positions + 1
        return drafts, dists

    @staticmethod
    def _judge(logits: torch.Tensor, drafts: list[int], dists: list[Optional[torch.Tensor]],
               temperature: float, generator: torch.Generator) -> tuple[int, int]:
        """(drafts accepted, the token that follows them) for verifier logits `[k+1, V]`."""
        if temperature == 0:
            best = logits.argmax(-1).tolist()
            n = 0
            while n < len(drafts) and drafts[n] == best[n]:
                n += 1
            return n, best[n]
        for n, (draft, q) in enumerate(zip(drafts, dists)):
            p = torch.softmax(logits[n] / temperature, dim=-1)
            q = torch.nn.functional.one_hot(torch.tensor(draft), p.numel()).to(p) \
                if q is None else q
            u = torch.rand((), generator=generator, device=p.device)
            if u * q[draft] < p[draft]:  # u < min(1, p/q)
                continue
            residual = (p - q).clamp_min(0)
            total = residual.sum()
            return n, _sample(residual / total if total > 0 else p, generator)
        return len(drafts), _sample(torch.softmax(logits[-1] / temperature, dim=-1), generator)

    # -- a whole decoding ---------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, prompt_ids: list[int], *, k: int, temperature: float, max_tokens: int,
               draft_sample: str = "greedy", seed: int = 0) -> Decoded:
        """Speculative decoding of up to `max_tokens` tokens after `prompt_ids` (stops after a
        stop token), chains of `k` drafts."""
        from transformers import DynamicCache

        start = time.time()
        generator = torch.Generator(device=self.device).manual_seed(seed)
        sampled = temperature > 0 and draft_sample == "probabilistic"
        cache, draft_cache = DynamicCache(), self.drafter.new_decode_cache()
        logits, feats = self._verifier_step(list(prompt_ids), cache)
        if temperature == 0:
            first = int(logits[-1].argmax())
        else:
            first = _sample(torch.softmax(logits[-1] / temperature, dim=-1), generator)
        out = Decoded(tokens=[first], accepted_hist=[0] * (k + 1))
        while len(out.tokens) < max_tokens and out.tokens[-1] not in self.stop_ids:
            context = list(prompt_ids) + out.tokens
            drafts, dists = self._draft(feats, context, k, temperature, sampled, generator,
                                        draft_cache)
            logits, aux = self._verifier_step([context[-1], *drafts], cache)
            n, follow = self._judge(logits, drafts, dists, temperature, generator)
            out.rounds += 1
            out.accepted += n
            out.accepted_hist[n] += 1
            # keep the last token and the accepted drafts (a negative count removes tokens;
            # transformers has deprecated the positive one, which gives the length to keep)
            rejected = cache.get_seq_length() - (len(context) + n)
            if rejected:
                cache.crop(-rejected)
            feats = torch.cat([feats, aux[:n + 1]])
            for token in [*drafts[:n], follow]:
                out.tokens.append(token)
                if token in self.stop_ids or len(out.tokens) >= max_tokens:
                    break
        out.seconds = time.time() - start
        return out


def load_drafter(cfg: Config, export_dir: Path) -> tuple[Eagle3DraftModel, list[int]]:
    """The drafter of an export directory as vLLM reads it: its weights (float32), the
    verifier's embedding, `d2t` (zeros when absent, as vLLM leaves it) and the aux ids the
    config writes (vLLM's default when it writes none)."""
    from eagle3 import base_drafter
    from eagle3.verifier import read_tensor

    base = base_drafter.load(export_dir)
    if base.unsupported_flags:
        raise StageError(f"{export_dir}: the reference decoder does not implement "
                         f"{', '.join(base.unsupported_flags)}")
    info = cfg.verifier_info
    aux = base.aux_ids_internal(info.architecture) or default_aux_layer_ids(info.num_hidden_layers)
    shape = base.shape
    model = Eagle3DraftModel(shape)
    d2t = base.d2t if base.d2t is not None else torch.zeros(shape.draft_vocab_size,
                                                            dtype=torch.long)
    t2d = base.t2d if base.t2d is not None else torch.zeros(shape.vocab_size, dtype=torch.bool)
    state = base_drafter.base_state_dict(base, read_tensor(cfg.verifier_path, "embed"), d2t, t2d)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in state.items()})
    return model.eval(), aux
