"""Stage 05 at Kimi-K2.5 size: peak memory and wall time of `05_fix_keys.py --from` (one tensor
at a time, eagle3.weights_io) against the naive load-everything conversion.

    .venv/bin/python bench/bench_export.py [--dir /tmp/bench_export] [--keep]

Writes a synthetic bf16 drafter shaped like the published Kimi drafters (AQ-MedAI's layout:
`midlayer.*`, embedding 163840 x 7168 shipped, fc 7168 x 21504, 64 heads of 128, MLP 18432,
lm_head 32000 x 7168: 2.36B parameters, 4.7 GB) and a verifier directory holding Kimi's
config and its embedding, then runs each approach in its own process and reads its peak RSS
(`ru_maxrss` of the child):

- streaming: `05_fix_keys.py --from` with the verifier, writing the vLLM and SGLang exports
  (each read, cast, written and validated one tensor at a time) after comparing the
  drafter's embedding with the verifier's in 256 MB blocks of rows;
- naive: `safetensors.torch.load_file` of the whole drafter, rename, cast, `save_file` (one
  format, no validation).

The goal (issue 13): streaming peak <= 1.5 x the largest tensor + 0.5 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
H, VOCAB, DRAFT_VOCAB, HEADS, HEAD_DIM, MLP = 7168, 163840, 32000, 64, 128, 18432
GB = 1e9


def kimi_drafter() -> dict:
    """name -> a tensor made on demand (normal(0, 0.02), fixed seed per name): a 4.7 GB drafter
    without ever holding it."""
    import torch

    from eagle3.weights_io import LazyTensor

    class Synthetic(LazyTensor):
        def load(self) -> torch.Tensor:
            g = torch.Generator().manual_seed(zlib.crc32(self.key.encode()))
            if self.dtype == torch.bool:  # t2d: the first DRAFT_VOCAB ids (d2t offsets 0)
                return torch.arange(self.shape[0]) < DRAFT_VOCAB
            if not self.dtype.is_floating_point:
                return torch.zeros(self.shape, dtype=self.dtype)
            out = torch.empty(self.shape, dtype=torch.float32)
            return out.normal_(0, 0.02, generator=g).to(self.dtype)

    q = HEADS * HEAD_DIM
    shapes = {
        "embed_tokens.weight": (VOCAB, H), "fc.weight": (H, 3 * H),
        "midlayer.hidden_norm.weight": (H,), "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (q, 2 * H),
        "midlayer.self_attn.v_proj.weight": (q, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (MLP, H), "midlayer.mlp.up_proj.weight": (MLP, H),
        "midlayer.mlp.down_proj.weight": (H, MLP), "norm.weight": (H,),
        "lm_head.weight": (DRAFT_VOCAB, H)}
    out = {k: Synthetic(Path(), k, torch.Size(s), torch.bfloat16) for k, s in shapes.items()}
    out["d2t"] = Synthetic(Path(), "d2t", torch.Size([DRAFT_VOCAB]), torch.int64)
    out["t2d"] = Synthetic(Path(), "t2d", torch.Size([VOCAB]), torch.bool)
    return out


def write_inputs(root: Path) -> dict:
    """The synthetic drafter and verifier directories (kept when present) and their facts. Run
    in a child process: the memory it takes never counts against the measured ones."""
    import torch

    from eagle3.weights_io import write_safetensors

    src, verifier = root / "aq-medai-kimi", root / "kimi-verifier"
    tensors = kimi_drafter()
    if not (src / "model.safetensors").is_file():
        src.mkdir(parents=True, exist_ok=True)
        tmp = src / "model.safetensors.tmp"
        write_safetensors(tmp, tensors)
        tmp.rename(src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": MLP, "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0, "max_position_embeddings": 262144, "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}))
    verifier.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "configs" / "verifiers" / "kimi-k2.5" / "config.json",
                verifier / "config.json")
    if not (verifier / "model.safetensors").is_file():
        # The verifier's embedding under Kimi's name: the same bytes the drafter ships.
        embed = {"language_model.model.embed_tokens.weight": tensors["embed_tokens.weight"]}
        write_safetensors(verifier / "model.safetensors.tmp", embed)
        (verifier / "model.safetensors.tmp").rename(verifier / "model.safetensors")
    largest = max(t.numel() * 2 for t in tensors.values() if t.dtype == torch.bfloat16)
    shipped = max(t.numel() * 2 for k, t in tensors.items()
                  if t.dtype == torch.bfloat16 and k != "embed_tokens.weight")
    params = sum(t.numel() for t in tensors.values() if t.dtype == torch.bfloat16)
    return {"parameters": params, "largest_tensor_bytes": largest,
            "largest_shipped_tensor_bytes": shipped,
            "source_bytes": (src / "model.safetensors").stat().st_size}


NAIVE = """
import sys, torch
from safetensors.torch import load_file, save_file
state = load_file(sys.argv[1])
out = {k.replace("midlayer.", "layers.0."): v.to(torch.bfloat16) if v.is_floating_point() else v
       for k, v in state.items() if k != "embed_tokens.weight"}
save_file(out, sys.argv[2])
"""


def measure(cmd: list[str], log: Path) -> dict:
    """Wall time and the peak RSS of that one child (wait4's rusage: kilobytes on Linux)."""
    t = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.time() - t
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{log.read_text()[-2000:]}")
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / GB, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/bench_export")
    ap.add_argument("--only", choices=["streaming", "naive"])
    ap.add_argument("--keep", action="store_true", help="keep the synthetic inputs")
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.dir)
    py = sys.executable
    if args.prepare:
        print(json.dumps(write_inputs(root)))
        return
    # This process never imports torch: a child's peak RSS (wait4) starts from its parent's
    # size at fork, so the measuring parent stays a bare interpreter.
    prep = subprocess.run([py, __file__, "--dir", str(root), "--prepare"], capture_output=True,
                          text=True)
    if prep.returncode != 0:
        sys.exit(prep.stderr[-2000:])
    facts = json.loads(prep.stdout.strip().splitlines()[-1])
    src, verifier = root / "aq-medai-kimi", root / "kimi-verifier"
    floor = measure([py, "-c", "pass"], root / "floor.log")
    runs = {
        "streaming": [py, "05_fix_keys.py", "--from", str(src), "--out", str(root / "out"),
                      "--verifier", str(verifier), "--formats", "vllm,sglang", "--dtype",
                      "bfloat16", "--source-sglang", "post-25454"],
        "naive": [py, "-c", NAIVE, str(src / "model.safetensors"), str(root / "naive.st")],
    }
    order = [args.only] if args.only else ["streaming", "naive"]
    results = {}
    for name in order:
        for out in (root / "out", root / "naive.st"):
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        results[name] = measure(runs[name], root / f"{name}.log")
        print(name, results[name], flush=True)
    goal = 1.5 * facts["largest_tensor_bytes"] / GB + 0.5
    print(json.dumps({**facts, "goal_peak_rss_gb": round(goal, 2),
                      "bare_interpreter_rss_gb": floor["peak_rss_gb"], "results": results},
                     indent=2))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
