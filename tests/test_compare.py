"""autofuse.measure.compare: the one definition of best, x BSP, x alt, bound and ceiling every command shows."""
from __future__ import annotations

from autofuse.measure.compare import alternatives, compare, geomean


def test_best_includes_bsp_and_ratios_are_never_below_one():
    c = compare("ag_gemm", {"bsp": 10.0, "push": 30.0, "torch_symm": 20.0})
    assert (c.best, c.best_us, c.speedup_vs_bsp) == ("bsp", 10.0, 1.0)  # BSP 3x faster: best is BSP, x BSP 1.00
    assert (c.alternative, c.speedup_vs_alternative) == ("torch_symm", 2.0)
    assert (c.own, c.own_vs_bsp) == ("push", 10.0 / 30.0)  # autofuse's own variants lose: below 1, said as such
    assert c.own_vs_alternative == 20.0 / 30.0  # own vs alt: torch's op beats every kernel of autofuse's own
    c = compare("ag_gemm", {"bsp": 12.0, "push": 8.0})
    assert (c.best, c.speedup_vs_bsp, c.alternative, c.speedup_vs_alternative) == ("push", 1.5, None, None)
    assert c.own_vs_alternative is None  # no alternative measured
    c = compare("ag_gemm", {"bsp": 12.0, "heap_mm": 9.0, "push": 6.0, "torch_symm": 7.5})
    assert (c.own, c.own_us, c.own_vs_alternative) == ("push", 6.0, 1.25)


def test_bound_above_bsp_gives_no_ceiling_and_interpreter_timings_no_ratio():
    assert compare("gemm_ar", {"bsp": 20004.0}, bound_us=40007.0).ceiling is None  # pieces inconsistent with BSP
    c = compare("gemm_ar", {"bsp": 100.0, "one_shot": 80.0}, bound_us=70.0)
    assert abs(c.ceiling - 100 / 70) < 1e-12 and abs(c.ceiling_captured - 0.25 / (100 / 70 - 1)) < 1e-12
    cpu = compare("gemm_ar", {"bsp": 100.0, "one_shot": 80.0}, bound_us=70.0, is_interpreted=True)
    assert cpu.best == "one_shot" and cpu.best_us == 80.0 and cpu.bound_us == 70.0
    assert all(getattr(cpu, k) is None for k in ("speedup_vs_bsp", "speedup_vs_alternative", "own_vs_bsp",
                                                  "own_vs_alternative", "ceiling", "ceiling_captured"))


def test_alternatives_are_the_peer_family_of_each_op():
    """Torch's own ops: async TP for ag_gemm / gemm_rs, symmetric-memory all-reduce for gemm_ar; a peer
    variant added later joins the set without touching the commands."""
    assert "torch_symm" in alternatives("ag_gemm") and "torch_symm" in alternatives("gemm_rs")
    assert alternatives("gemm_ar") and "bsp" not in alternatives("gemm_ar") and "one_shot" not in alternatives("gemm_ar")
    assert geomean([2.0, 8.0, None]) == 4.0 and geomean([]) is None
