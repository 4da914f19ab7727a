"""The device API compiles for Hopper (sm_90) and uses the intended memory instructions."""
from conftest import CTX, compile_sm90

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
