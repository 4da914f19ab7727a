"""The device API compiles for Hopper (sm_90) and uses the intended memory instructions."""
from conftest import compile_sm90

MOD = "autofuse.kernels.selftest"
RING_SIG = {"src": "*fp32", "dst": "*fp32", "flags": "*i32", "status": "*i32", "heap_bases": "*i64",
            "rank": "i32", "world": "i32", "epoch": "i32", "spin_limit": "i32", "n": "i32", "BLOCK": "constexpr"}


def test_ring_put_compiles_with_sys_release_and_volatile_poll():
    ptx = compile_sm90(MOD, "ring_put_kernel", RING_SIG, {"BLOCK": 128})["ptx"]
    assert "atom.global.sys.release.exch.b32" in ptx
    assert "ld.volatile.global" in ptx


def test_token_and_cas_kernels_compile():
    ptx = compile_sm90(MOD, "ring_token_kernel", {"flags": "*i32", "status": "*i32", "heap_bases": "*i64", "rank": "i32",
                                                  "world": "i32", "first_epoch": "i32", "iters": "i32",
                                                  "spin_limit": "i32"})["ptx"]
    assert "ld.volatile.global" in ptx
    ptx = compile_sm90(MOD, "cas_claim_kernel", {"lock": "*i32", "old_out": "*i32", "heap_bases": "*i64", "rank": "i32"})["ptx"]
    assert "cas.b32" in ptx
