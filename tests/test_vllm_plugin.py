"""vLLM's own code judges the plugin the pipeline gives its vLLM servers
(eagle3/engine_plugins, docs/engines.md "vLLM-CPU at T > 0").

Each check runs in a fresh interpreter with exactly the environment `start_server` gives a
vLLM server, so vLLM's plugin discovery, its CPU platform's kernel registration and its
rejection sampler are the ones that run in the served engine. Without the plugin, vllm-cpu
0.32 spreads float temperatures as uninitialised memory and accepts sampled drafts with a
meaningless probability (both checks fail).
"""

import json
import subprocess
import sys
from pathlib import Path

from eagle3.config import ServerConfig
from eagle3.engines import server_env

PRELUDE = """
import json, torch
from vllm.plugins import load_general_plugins
from vllm.platforms import current_platform
load_general_plugins()                                  # what every vLLM process does first
current_platform.register_triton_kernel_overrides()     # then the CPU worker
"""

EXPAND = PRELUDE + """
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
cu = torch.tensor([3, 6, 7], dtype=torch.int32)
temps = expand_batch_to_tokens(torch.tensor([0.6, 0.0, 0.9]), cu, 7, replace_from=0,
                               replace_to=1)
top_k = expand_batch_to_tokens(torch.tensor([5, 0, 2], dtype=torch.int32), cu, 7)
print(json.dumps({"temps": temps.tolist(), "top_k": top_k.tolist()}))
"""

# Speculative sampling of greedy drafts with no draft probabilities (vLLM's EAGLE path) must
# accept the first draft with the verifier's probability of it at the request's temperature.
SAMPLE = PRELUDE + """
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import apply_sampling_constraints, rejection_sample
torch.manual_seed(0)
R, K, V, T = 4000, 3, 64, 0.6
logits = torch.randn(R * K, V) * 2.0
draft = torch.distributions.Categorical(logits=logits).sample()  # not always the argmax
cu = torch.arange(1, R + 1, dtype=torch.int32) * K
zeros = torch.zeros(R)
meta = SamplingMetadata(
    temperature=torch.full((R,), T), all_greedy=False, all_random=True, top_p=None,
    top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
    prompt_token_ids=None, frequency_penalties=zeros, presence_penalties=zeros,
    repetition_penalties=torch.ones(R), output_token_ids=[[] for _ in range(R)],
    allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
target = apply_sampling_constraints(logits.clone(), cu, meta)
out = rejection_sample(draft, [K] * R, K, cu, None, target,
                       torch.zeros(R, 1, dtype=torch.int32), meta)
first = draft.view(R, K)[:, 0]
p = torch.softmax(logits / T, -1).gather(1, draft[:, None]).view(R, K)[:, 0]
print(json.dumps({"accepted": (out[:, 0].long() == first).float().mean().item(),
                  "expected": p.mean().item()}))
"""


AVX2_KERNELS = Path(__file__).resolve().parent / "avx2_kernels"


def run_in_vllm_env(script: str, env: dict | None = None) -> dict:
    done = subprocess.run([sys.executable, "-c", script],
                          env=server_env("vllm", ServerConfig(env=env or {})),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_plugin_lets_vllm_choose_the_avx2_kernels():
    """On an AVX2-only CPU vLLM loads `_C_AVX2`; importing `_C` (AVX-512 + BF16) there is
    SIGILL in every vLLM process. Here vLLM's AVX-512 probes answer no (the AVX2 library runs
    on any x86-64 CPU with AVX2): the plugin must leave `_C` alone and still repair."""
    script = EXPAND.replace('print(json.dumps({', 'import eagle3_vllm_fixes as fixes\n'
                            'print(json.dumps({"kernels": fixes.loaded_kernels(), ')
    got = run_in_vllm_env(script, {"PYTHONPATH": str(AVX2_KERNELS)})
    assert got["kernels"] == ["_C_AVX2"]
    assert got["temps"] == [0.6000000238418579] * 3 + [1.0] * 3 + [0.8999999761581421]


def test_expand_spreads_float_temperatures_and_int_top_k():
    got = run_in_vllm_env(EXPAND)
    assert got["temps"] == [0.6000000238418579] * 3 + [1.0] * 3 + [0.8999999761581421]
    assert got["top_k"] == [5, 5, 5, 0, 0, 0, 2]


def test_sampled_drafts_accepted_with_the_verifiers_probability():
    got = run_in_vllm_env(SAMPLE)
    # 4000 Bernoulli draws: standard error <= 0.008; 0.03 is ~4 of them.
    assert abs(got["accepted"] - got["expected"]) < 0.03, got
