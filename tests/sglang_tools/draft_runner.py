"""The attention backends SGLang 0.5.23 builds for the target and the EAGLE-3 draft worker, on CPU.

Called by parse_args.parse(..., backends=True) on a command it has just resolved, inside the same
platform override (an H100 or a B200 stand-in) and with the same stand-in model directories.
What runs (all SGLang code; line numbers at 0.5.23):

  1. runtime_context.publish(server_args, role="scheduler") (runtime_context.py:1489), as the
     scheduler process does: get_spec()/attention_backends() then answer from the command.
  2. each runner's ModelConfig as TpModelWorker._init_model_config builds it
     (managers/tp_worker.py:465-482): the target from --model-path; the draft from
     --speculative-draft-model-path with is_draft_model=True and the target's context length
     (EagleDraftWorker passes it, speculative/eagle_worker_v2.py:229).
  3. ModelRunner(...) (model_executor/model_runner.py:344), the draft one with
     is_draft_worker=True and no draft_attention_backend: EagleDraftWorker builds its
     TpModelWorker without one (eagle_worker_v2.py:223-232), so __init__ takes
     resolve_draft_attention_backend()'s answer, --speculative-draft-attention-backend or None
     (model_runner.py:306-320, 379), and sets use_mla_backend from the model's attention
     architecture (model_runner.py:406). __init__ runs until its first GPU call,
     torch.cuda.set_device (model_runner.py:455).
  4. the runner's backend, as ModelRunner.init_attention_backends does it
     (model_runner.py:1105-1122) after its aux-hidden-state hook (which needs the loaded model;
     a draft runner captures nothing): resolve_attention_backend_strs
     (attention_backend_setup.py:184-204: a draft runner without a backend of its own gets the
     process's (prefill, decode) pair, i.e. the target's), the pair stamped on the runner, then
     build_attention_backends (attention_backend_setup.py:75) -> _build_full_attention_backend_
     from_str (:277-283) -> the registry's factory (layers/attention/attention_registry.py),
     whose trtllm_mla entry raises "trtllm_mla backend can only be used with MLA models." for a
     runner whose model is not MLA (attention_registry.py:94-97).

Stand-ins, for the hardware only (installed for the call, then removed):
  * torch.cuda.set_device raises GpuReached, which carries the runner __init__ built so far.
  * attention_backend_setup.init_cublas does nothing (it creates a cuBLAS handle).
  * attention_registry.get_device_capability (the fa3 factory's probe, attention_registry.py:
    241, which asks torch.cuda directly) answers get_platform().device_capability, the
    platform override's answer, as every other SGLang probe does.
  * AttentionBackend.__new__ records the backend class the factory chose and stops there: the
    class's __init__ reads the runner's KV pools and allocates GPU workspaces, which exist only
    after ModelRunner.alloc_memory_pool on a GPU. Every check of the factory has run by then.
And for the imports only: uvicorn and fastapi, absent from .venv-sglang, are inert modules
(sglang_cpu.install_web_server_stubs). fa3's backend module imports sgl_kernel, which is not
installed: an fa3 runner (Hopper's MLA default) answers that ModuleNotFoundError.

Not built: the multi-step draft backends EagleDraftWorker.init_attention_backend creates after
step 4 (eagle_worker_v2.py:391-410, speculative/draft_utils.py DraftBackendFactory). They take the
draft runner's backend and make the same choice: trtllm_mla raises for a non-MLA runner
(draft_utils.py:358-362), flashinfer gives it FlashInferMultiStepDraftBackend (:226-237).
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import sglang_cpu


class GpuReached(BaseException):
    """ModelRunner.__init__ reached its first GPU call. A BaseException, so that no SGLang
    `except Exception` on the way takes it for an error of its own."""

    def __init__(self, runner: Any):
        super().__init__("ModelRunner reached torch.cuda.set_device")
        self.runner = runner


class BackendChosen(BaseException):
    """The registry's factory constructs `cls`: the selection is made and its checks passed."""

    def __init__(self, cls: type):
        super().__init__(cls.__name__)
        self.cls = cls


def _stop_at_gpu(*args: Any, **kwargs: Any) -> None:
    # Called as torch.get_device_module(self.device).set_device(...) from ModelRunner.__init__:
    # the caller's frame holds the runner.
    raise GpuReached(sys._getframe(1).f_locals.get("self"))


def _stop_at_construction(cls: type, *args: Any, **kwargs: Any) -> None:
    raise BackendChosen(cls)


@contextlib.contextmanager
def hardware_stand_ins() -> Iterator[None]:
    import torch

    import sglang.srt.layers.attention.attention_registry as registry
    import sglang.srt.model_executor.model_runner_components.attention_backend_setup as setup
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.runtime_context import get_platform

    saved = torch.cuda.set_device, setup.init_cublas, registry.get_device_capability
    torch.cuda.set_device, setup.init_cublas = _stop_at_gpu, lambda: None
    registry.get_device_capability = lambda device_id=0: get_platform().device_capability
    AttentionBackend.__new__ = _stop_at_construction
    try:
        yield
    finally:
        torch.cuda.set_device, setup.init_cublas, registry.get_device_capability = saved
        del AttentionBackend.__new__  # back to object.__new__


def runner_up_to_gpu(server_args: Any, model_config: Any, is_draft_worker: bool) -> Any:
    """SGLang's ModelRunner for `model_config`, as far as its __init__ goes without a GPU."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    try:
        ModelRunner(model_config=model_config, mem_fraction_static=0.8, gpu_id=0,
                    nccl_port=0, server_args=server_args, is_draft_worker=is_draft_worker)
    except GpuReached as reached:
        assert isinstance(reached.runner, ModelRunner), "set_device called from elsewhere"
        return reached.runner
    raise AssertionError("ModelRunner.__init__ never reached torch.cuda.set_device")


def build_backend(runner: Any) -> dict:
    """The attention backend SGLang creates for `runner`: {"backend", "mla_model", "class"}, or
    "error" in place of "class" when its factory refuses."""
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        build_attention_backends,
        resolve_attention_backend_strs,
    )

    # model_runner.py:1119-1122, the part of init_attention_backends after the aux-state hook
    resolved = resolve_attention_backend_strs(model_runner=runner)
    runner.prefill_attention_backend_str = resolved.prefill
    runner.decode_attention_backend_str = resolved.decode
    out = {"backend": resolved.decode if resolved.decode == resolved.prefill
           else f"{resolved.prefill}/{resolved.decode}", "mla_model": runner.use_mla_backend}
    try:
        build_attention_backends(model_runner=runner)
    except BackendChosen as chosen:
        return out | {"class": chosen.cls.__name__}
    except Exception as e:  # noqa: BLE001 - the factory's own refusal is the answer
        return out | {"error": f"{type(e).__name__}: {e}"}
    raise AssertionError("build_attention_backends constructed no backend")


def attention_backends(server_args: Any) -> dict:
    """{"target": ..., "draft": ...}: build_backend's answer for each runner of the command."""
    sglang_cpu.install_web_server_stubs()
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.runtime_context import SpawnRanks, get_model, get_spec, publish

    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    target = ModelConfig.from_server_args(server_args, model_path=get_model().model_path,
                                          model_revision=get_model().revision)
    draft = ModelConfig.from_server_args(
        server_args, model_path=get_spec().speculative_draft_model_path,
        model_revision=get_spec().speculative_draft_model_revision, is_draft_model=True,
        context_length=target.context_len)
    out = {}
    with hardware_stand_ins():
        for role, config in (("target", target), ("draft", draft)):
            runner = runner_up_to_gpu(server_args, config, is_draft_worker=role == "draft")
            out[role] = build_backend(runner)
    return out
