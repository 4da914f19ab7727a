#!/usr/bin/env bash
# Round 17 call 2 (one H200): every multi-rank GPU test of dispatch, calls, faults, groups, MoE and autograd at 2 ranks
# sharing the GPU (correctness, graph replay and fault behaviour; nothing timed).
set -u
OUT=${OUT:-/tmp/out}; export OUT
bash scripts/gpu_session.sh --name onegpu-w2 --ranks-per-gpu 2 --world 2 --heap 2G \
  together:test_gemm_rs,test_gemm_ar,test_ag_gemm,test_flash_decode,test_collectives,test_groups,test_dispatch,test_calls:200:test_gpu_faults+and+not+sizes_that_hung+or+test_groups+or+test_dispatch+or+test_calls \
  together:test_moe_hybrid,test_moe_fused,test_autograd:330
