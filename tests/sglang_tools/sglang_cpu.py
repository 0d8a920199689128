"""Import SGLang 0.5.23 on a CPU-only machine that has no torchvision.

Usage (before any `import sglang...`):

    import sglang_cpu
    sglang_cpu.install_torchvision_stub()
    from sglang.srt.server_args import ServerArgs   # etc.

Why: `sglang/srt/configs/__init__.py` imports `configs/nano_nemotron_vl.py`, which
imports `sglang/srt/multimodal/internvl_utils.py`, whose line 5 is a hard
`import torchvision.transforms as T` (and line 7 `from torchvision.transforms.functional
import InterpolationMode`).  torchvision is not installed (the only wheels pip offers
for torch 2.13 are CUDA builds that break transformers' image utils), so we

 1. ask transformers whether torchvision is available *first*; its answer
    (`is_torchvision_available`, an `lru_cache`) is then pinned to False, so
    transformers never takes a torchvision code path later;
 2. register a meta-path finder that serves `torchvision` and any
    `torchvision.<sub>` import with an inert module whose attributes are dummy
    classes. Nothing in the CPU paths we use (argument resolution, config loading,
    EAGLE-3 weight loading) calls into it.

`remove_torchvision_stub()` undoes step 2 (modules that already bound a stub
attribute keep it).

`install_web_server_stubs()` does the same for uvicorn and fastapi, when they are not
installed: `sglang/srt/model_executor/model_runner.py` imports
`sglang/srt/distributed/gated_launch.py`, whose lines 8-10 import uvicorn and fastapi for an
HTTP gate no runner built by our tools starts (tests/sglang_tools/draft_runner.py builds
SGLang's ModelRunner up to its first GPU call).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class _Dummy:
    """Stands in for any torchvision class/function/enum member."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        raise RuntimeError("torchvision stub called: torchvision is not installed")

    def __getattr__(self, name):
        return _Dummy()

    def __mro_entries__(self, bases):  # allow `class X(torchvision.Something)`
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves inert modules for the top-level packages in `names` and their submodules."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+stub"
        return m

    def exec_module(self, module):
        pass


_FINDER = _StubFinder({"torchvision"})
_WEB_FINDER = _StubFinder({"uvicorn", "fastapi"})


def install_torchvision_stub() -> None:
    # Step 1: pin transformers' availability answers to "absent".
    from transformers.utils import import_utils as iu

    for name in ("is_torchvision_available", "is_torchvision_v2_available"):
        fn = getattr(iu, name, None)
        if fn is not None:
            assert fn() is False, f"{name}() is True: a real torchvision is installed"
    # Step 2: the stub.
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def remove_torchvision_stub() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
        del sys.modules[k]


def install_web_server_stubs() -> None:
    """Inert uvicorn and fastapi where they are not installed: the finder comes after the
    real ones, so an installed package is always the one imported."""
    if _WEB_FINDER not in sys.meta_path:
        sys.meta_path.append(_WEB_FINDER)
