"""The device API compiles for Hopper (sm_90) and uses the intended memory instructions."""
import re

import pytest

from conftest import CTX, VERSIONS, assert_uniform, compile_request, compile_sm90, compile_sm90_versions

MOD = "autofuse.kernels.selftest"
RING_SIG = {"src": "*fp32", "dst": "*fp32", "flag": "*i32", "ctx": CTX, "epoch": "i32", "n": "i32",
            "BLOCK": "constexpr"}


def test_ring_put_compiles_with_sys_release_volatile_poll_and_global_timer():
    ptx = compile_sm90(MOD, "ring_put_kernel", RING_SIG, {"BLOCK": 128})["ptx"]
    assert "atom.global.sys.release.exch.b32" in ptx
    assert "ld.volatile.global" in ptx
    assert "%globaltimer" in ptx  # waits are bounded in wall-clock time


def test_token_and_cas_kernels_compile():
    ptx = compile_sm90(MOD, "ring_token_kernel", {"flag": "*i32", "ctx": CTX, "first_epoch": "i32",
                                                  "iters": "i32"})["ptx"]
    assert "ld.volatile.global" in ptx
    assert "ld.global.sys.acquire.b32" in ptx  # the acquire after a successful poll is not optimised away
    assert "atom.global.release.sys.cas.b32" in ptx  # give_up's abort of every peer
    ptx = compile_sm90(MOD, "cas_claim_kernel", {"lock": "*i32", "old_out": "*i32", "heap_bases": "*i64", "rank": "i32"})["ptx"]
    assert "cas.b32" in ptx


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("warps", [4, 8])
def test_wait_decisions_are_read_once_per_program(version, warps):
    """shmem.wait_until reads the flag and the status word once for the whole program: one thread
    loads (ld.global.sys, acquire or relaxed), shares the value through shared memory, every thread
    reads it after a barrier; only the hot poll is a per-thread volatile load, and no barrier sits
    in a branch that threads could take differently (tests/divergence.py)."""
    req = compile_request(MOD, "ring_token_kernel", {"flag": "*i32", "ctx": CTX, "first_epoch": "i32", "iters": "i32"},
                          num_warps=warps, name="token")
    k = compile_sm90_versions([req])[version]["token"]
    assert_uniform(k, "ring_token_kernel")
    ptx = "\n".join(line for line in k["ptx"].splitlines() if not line.strip().startswith((".loc", "//")))
    for sem in ("acquire", "relaxed"):
        broadcast = (rf"@%p\d+ ld\.global\.sys\.{sem}\.b32 (%r\d+), \[ %rd\d+ \+ 0 \];\s*"
                     r"@%p\d+ st\.shared(::cta)?\.b32 \[ %r\d+ \+ 0 \], \1;\s*bar\.sync \s*0;\s*ld\.shared\.b32")
        assert re.search(broadcast, ptx), f"no one-thread {sem} read shared with the program"
    assert "ld.volatile.global" in ptx and "%globaltimer" in ptx
