"""The tensor-parallel Llama layer (autofuse.bench.llama_layer, run by examples/llama_layer.py) on 2 CPU ranks: autofuse = baseline = float64.

One spawned job builds the tiny config's layer twice over one set of bf16 weights, on autofuse's
public API and on torch.distributed + torch.matmul (the baseline), and runs prefill (16 tokens,
8 per rank) and two decode steps (3 sequences at different positions, a KV cache split over the
ranks in blocks of 4 positions, the second step reading what the first wrote) with autofuse's
default choice and then with every non-bsp variant of every op forced through AUTOFUSE_VARIANT
(listed from autofuse.core.registry, so new variants are covered when they land). Each output is
compared with the other layer's and with a float64 single-process reference of the whole layer
written independently here (explicit softmax, complex-number RoPE) from the same rounded weights.

Tolerance, as ||out - other|| / ||other|| over a whole output (TOL = 2.5e-2):
- Both layers compute in bf16 (unit roundoff u = 2^-8) with float32 accumulation from the same bf16
  inputs and weights, so they differ only where they round differently; the float64 reference
  does not round at all.
- Roundings to bf16 on the path from the input to the output: QKV GEMM, RoPE (q, k), attention
  output, o_proj (partial and reduced sum in NCCL-style collectives, one in a fused kernel),
  residual, RMSNorm, gate/up GEMM, SiLU, SiLU * up, down_proj (partial and sum), residual: about
  n = 14. Round to nearest leaves a relative error of at most u per element (rms <= u/sqrt(3));
  the Triton interpreter truncates instead (up to 2u, one-sided, rms <= 2u/sqrt(3)): the reason
  its bf16 errors run ~3x the GPU's (tests/test_flash_decode.py). Fused kernels own up to 6 of
  the 14 roundings.
- Every linear map has N(0, 1/fan_in) weights, so a relative perturbation of its input comes out
  at about the same relative size (norm-wise); softmax and SiLU have slopes <= ~1 at these
  scales; the residual stream carries the exact input, which only shrinks relative errors.
- Independent roundings add in quadrature: baseline vs exact <= sqrt(14) u/sqrt(3) = 8.4e-3;
  fused vs exact <= u/sqrt(3) sqrt(8 + 6 * 4) = 1.3e-2; fused vs baseline <= sqrt(8.4^2 + 12.7^2)
  e-3 = 1.5e-2. TOL = 2.5e-2 leaves a factor 1.6 over that.
- Measured on CPU: baseline vs float64 4-5e-3, fused vs float64 and vs baseline up to 8e-3.
- Small enough to catch real mistakes: `test_tolerance_catches_small_bugs` checks that the
  smallest bugs we could think of (one cached token dropped, the new token missing, a position off
  by one, no RoPE, no causal mask) move the float64 reference by more than 2 x TOL (they move it
  by 0.075 to 0.46 at these sizes).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from autofuse.comm.world import spawn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama_layer.py"
TOL = 2.5e-2
OPS = ("ag_gemm", "gemm_rs", "gemm_ar", "flash_decode")
T, B, BLOCK = 16, 3, 4
CONTEXT = (35, 16, 5)  # tokens cached per sequence = the first decode step's positions; with BLOCK 4 on
# 2 ranks the new tokens land on ranks (0, 0, 1), then (1, 0, 1): both ranks append, sequence 0 crosses a block


def example():
    """The layer module (autofuse.bench.llama_layer) that examples/llama_layer.py and `bench layer` run."""
    from autofuse.bench import llama_layer

    return llama_layer


# ------------------------------------------------------------------- float64 reference of the layer
def _norm(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Rotate-half RoPE as complex multiplication of (x[:D/2], x[D/2:]) pairs."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(torch.ones(len(pos), 1, d // 2, dtype=torch.float64), pos.double()[:, None, None] * inv)
    z = torch.complex(x[..., :d // 2], x[..., d // 2:]) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def _attend(q, k, v, mask):
    """q (Hq, Tq, D), k, v (Hkv, Tk, D), mask (Tq, Tk) True = visible -> (Tq, Hq D)."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)
    return (p @ v).transpose(0, 1).reshape(q.shape[1], -1)


def _mlp(full, cfg, x):
    h = _norm(x, full["mlp_norm"], cfg.eps)
    return x + (torch.nn.functional.silu(h @ full["wg"]) * (h @ full["wu"])) @ full["wd"]


def _qkv(full, cfg, x, pos):
    n, d = x.shape[0], cfg.head_dim
    h = _norm(x, full["attn_norm"], cfg.eps)
    q = _rope((h @ full["wq"]).view(n, cfg.heads, d), pos, cfg.rope_theta)
    k = _rope((h @ full["wk"]).view(n, cfg.kv_heads, d), pos, cfg.rope_theta)
    return q, k, (h @ full["wv"]).view(n, cfg.kv_heads, d)


def ref_prefill(full, cfg, x):
    t = x.shape[0]
    q, k, v = _qkv(full, cfg, x, torch.arange(t))
    o = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), torch.ones(t, t, dtype=torch.bool).tril())
    return _mlp(full, cfg, x + o @ full["wo"])


def ref_decode(full, cfg, x, pos, kc, vc):
    """One decode step; writes the new k, v into the full caches kc, vc (B, Hkv, S, D)."""
    q, k, v = _qkv(full, cfg, x, pos)
    rows = []
    for b, p in enumerate(pos.tolist()):
        kc[b, :, p], vc[b, :, p] = k[b], v[b]
        rows.append(_attend(q[b][:, None], kc[b, :, :p + 1], vc[b, :, :p + 1], torch.ones(1, p + 1, dtype=torch.bool)))
    return _mlp(full, cfg, x + torch.cat(rows) @ full["wo"])


def _inputs(cfg):
    """The test's bf16 inputs: prefill rows, two decode steps' hidden states, a full KV cache."""
    g = torch.Generator().manual_seed(11)
    x_pre = torch.randn(T, cfg.hidden, generator=g).to(torch.bfloat16)
    x_dec = [torch.randn(B, cfg.hidden, generator=g).to(torch.bfloat16) for _ in range(2)]
    smax = max(CONTEXT) + 2
    k_full = torch.randn(B, cfg.kv_heads, smax, cfg.head_dim, generator=g).to(torch.bfloat16)
    v_full = torch.randn(B, cfg.kv_heads, smax, cfg.head_dim, generator=g).to(torch.bfloat16)
    return x_pre, x_dec, k_full, v_full


# -------------------------------------------------------------------------------- the rank job
def _combos(world) -> list[str]:
    """'' (autofuse's default choice), then AUTOFUSE_VARIANT values forcing every non-bsp variant of
    every op available here: combo i takes each op's i-th variant (cycling), so max(#variants) runs."""
    from autofuse.core import registry

    per_op = {op: [n for n, v in registry.get(op).variants.items() if n != "bsp" and v.available(world)]
              for op in OPS if op in registry.names()}
    per_op = {op: vs for op, vs in per_op.items() if vs}
    runs = max((len(vs) for vs in per_op.values()), default=0)
    return [""] + [",".join(f"{op}:{vs[i % len(vs)]}" for op, vs in per_op.items()) for i in range(runs)]


def _job(world) -> dict:
    import autofuse

    torch.set_num_threads(1)
    m = example()
    cfg, w, r = m.CONFIGS["tiny"], world.size, world.rank
    full = m.full_weights(cfg, seed=0)
    full64 = {k: v.double() for k, v in full.items()}
    weights = m.shard_weights(full, cfg, r, w)
    recorded: dict[str, tuple] = {}

    class Recording(m.AutofuseOps):
        """AutofuseOps that keeps each op's first arguments, to ask autofuse.explain what ran."""

        def _keep(self, op, *args):
            recorded.setdefault(op, args)
            return getattr(super(), op)(*args)

        def ag_gemm(self, a, b):
            return self._keep("ag_gemm", a, b)

        def gemm_rs(self, a, b):
            return self._keep("gemm_rs", a, b)

        def gemm_ar(self, a, b):
            return self._keep("gemm_ar", a, b)

        def flash_decode(self, q, k, v, lengths):
            return self._keep("flash_decode", q, k, v, lengths)

    layers = {"autofuse": m.TPLlamaLayer(cfg, weights, Recording(world.group), world.group),
              "baseline": m.TPLlamaLayer(cfg, weights, m.TorchOps(world.group), world.group)}

    x_pre, x_dec, k_full, v_full = _inputs(cfg)
    smax = k_full.shape[2]
    pos = [torch.tensor(CONTEXT), torch.tensor(CONTEXT) + 1]

    ref = {"prefill": ref_prefill(full64, cfg, x_pre.double()).chunk(w)[r]}
    kc, vc = k_full.double(), v_full.double()
    for step in range(2):
        ref[f"decode{step}"] = ref_decode(full64, cfg, x_dec[step].double(), pos[step], kc, vc)

    rows, chosen = [], {}
    for combo in _combos(world):
        os.environ["AUTOFUSE_VARIANT"] = combo
        autofuse.set_policy(None)  # forget cached decisions: the next calls read AUTOFUSE_VARIANT again
        recorded.clear()
        label = combo or "default"
        out: dict[str, dict] = {}
        for name, layer in layers.items():
            cache = m.KVCache.from_full(k_full, v_full, smax, r, w, BLOCK)
            out[name] = {"prefill": layer.prefill(x_pre.chunk(w)[r].contiguous())}
            for step in range(2):
                out[name][f"decode{step}"] = layer.decode(x_dec[step], pos[step], cache)
        for case in ref:
            a, b = out["autofuse"][case], out["baseline"][case]
            rows.append((f"{label}/{case}/autofuse-vs-baseline", m.rel_diff(a, b)))
            rows.append((f"{label}/{case}/autofuse-vs-float64", m.rel_diff(a, ref[case])))
            rows.append((f"{label}/{case}/baseline-vs-float64", m.rel_diff(b, ref[case])))
        chosen[label] = {op: autofuse.explain(op, *args, group=world.group).variant for op, args in recorded.items()}
    os.environ.pop("AUTOFUSE_VARIANT", None)
    return {"rows": rows, "chosen": chosen}


@pytest.fixture(scope="module")
def job() -> list[dict]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return spawn(_job, 2, device_kind="cpu", timeout_s=300)


# ------------------------------------------------------------------------------------------ tests
def test_kv_cache_split() -> None:
    """Every position has exactly one owner; lengths count a rank's positions; from_full puts them
    at slots 0..n-1 in position order; append writes the owner's slot and the others' scratch."""
    m = example()
    w, block, s = 3, 4, 29
    k = torch.arange(s, dtype=torch.float32).view(1, 1, s, 1).expand(2, 1, s, 1).contiguous()
    caches = [m.KVCache.from_full(k, k, s + 5, r, w, block) for r in range(w)]
    n = torch.tensor([s, 7])
    lengths = [c.lengths(n) for c in caches]
    assert [int(x[0]) for x in lengths] == [12, 9, 8] and sum(int(x[1]) for x in lengths) == 7
    got = sorted(v for c, n_r in zip(caches, lengths) for v in c.keys[0, 0, :int(n_r[0]), 0].tolist())
    assert got == list(range(s))
    new = torch.full((2, 1, 1), -1.0)
    for c in caches:
        c.append(new, new, torch.tensor([s, 5]))
    owners = [[c.rank for c in caches if (c.keys[b] == -1).any()] for b in range(2)]
    assert owners == [[(s // block) % w], [(5 // block) % w]]
    assert all(int(c.lengths(torch.tensor([s + 1]))[0]) - int(c.lengths(torch.tensor([s]))[0])
               == (c.rank == (s // block) % w) for c in caches)


def test_layer_matches_baseline_and_float64(job) -> None:
    bad = [(case, err) for case, err in job[0]["rows"] if not err <= TOL]
    assert not bad, f"errors above {TOL}: {bad}\nall: {job[0]['rows']}"
    for a, b in zip(job[0]["rows"], job[1]["rows"]):
        assert a[0] == b[0]


def test_forced_variants_ran(job) -> None:
    """Each forced combo ran the variants it named (read back through autofuse.explain); the
    default choice ran something for every op."""
    chosen = job[0]["chosen"]
    assert set(chosen["default"]) == set(OPS)
    forced = [c for c in chosen if c != "default"]
    assert forced, "no non-bsp variant is registered for any op"
    for combo in forced:
        want = dict(item.split(":") for item in combo.split(","))
        assert {op: chosen[combo][op] for op in want} == want, combo


def test_tolerance_catches_small_bugs() -> None:
    """The float64 reference with a small deliberate bug differs from the correct one by > 2 x TOL."""
    global _attend, _rope
    m = example()
    cfg = m.CONFIGS["tiny"]
    full = {k: v.double() for k, v in m.full_weights(cfg, seed=0).items()}
    x_pre, x_dec, k_full, v_full = _inputs(cfg)
    x_pre, x_dec, k_full, v_full = x_pre.double(), [x.double() for x in x_dec], k_full.double(), v_full.double()
    pos = torch.tensor(CONTEXT)

    def decode(p=pos):
        return ref_decode(full, cfg, x_dec[0], p, k_full.clone(), v_full.clone())

    good_dec, good_pre = decode(), ref_prefill(full, cfg, x_pre)
    attend, rope = _attend, _rope
    bugs = {}
    try:
        _attend = lambda q, k, v, mask: attend(q, k[:, 1:], v[:, 1:], mask[:, 1:])  # noqa: E731
        bugs["decode: oldest cached token dropped"] = m.rel_diff(decode(), good_dec)
        _attend = lambda q, k, v, mask: attend(q, k[:, :-1], v[:, :-1], mask[:, :-1])  # noqa: E731
        bugs["decode: new token not attended"] = m.rel_diff(decode(), good_dec)
        _attend = lambda q, k, v, mask: attend(q, k, v, torch.ones_like(mask))  # noqa: E731
        bugs["prefill: no causal mask"] = m.rel_diff(ref_prefill(full, cfg, x_pre), good_pre)
        _attend = attend
        _rope = lambda x, p, theta: x  # noqa: E731
        bugs["prefill: no RoPE"] = m.rel_diff(ref_prefill(full, cfg, x_pre), good_pre)
        _rope = rope
        bugs["decode: position off by one"] = m.rel_diff(decode(pos - 1), good_dec)
    finally:
        _attend, _rope = attend, rope
    small = {k: v for k, v in bugs.items() if not v > 2 * TOL}
    assert not small, f"bugs the tolerance {TOL} would not catch: {small}"


def test_bench_layer_cpu() -> None:
    """`autofuse bench layer` through the bench contract (load_target, BenchOptions, run, render) on
    2 CPU ranks: one prefill and one decode shape, autofuse's choice and one forced configuration
    (op:variant items of --variants form one); JSON-able rows with every reported quantity."""
    import io
    import json
    import warnings

    from rich.console import Console

    from autofuse.bench.bench import BenchOptions, dumps, load_target
    from autofuse.bench.bench_layer import OPS

    module = load_target("layer")
    forced = ["ag_gemm:pull", "gemm_rs:push_last", "gemm_ar:one_shot", "flash_decode:split_heap"]
    options = BenchOptions(target="layer", shapes=["T=16,1x24"], reps=1, variants=["default", *forced],
                           progress=False).resolved()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = module.run(options)
    rows, config = result["rows"], ",".join(forced)
    assert [(r["phase"], r["shape"], r["autofuse"]) for r in rows] == [
        ("prefill", "T=16", "default"), ("prefill", "T=16", config),
        ("decode", "B=1 S=24", "default"), ("decode", "B=1 S=24", config)]
    for r in rows:
        assert r["mode"] == "eager" and r["ok"] and r["rel_diff"] <= TOL
        assert r["autofuse_us"] > 0 and r["baseline_us"] > 0 and r["comm_us"] > 0
        assert set(r["ops_us"]["autofuse"]) == {*OPS, "rest"}
    assert {r["variants"]["o_proj"] for r in rows if r["autofuse"] == config} == {"gemm_rs:push_last",
                                                                                 "gemm_ar:one_shot"}
    assert (result["sweep"], result["world"], result["device_kind"]) == ("tiny", 2, "cpu")
    assert any("interpreter" in line for line in result["notes"])
    json.loads(dumps(result))
    text = io.StringIO()
    module.render(result, Console(file=text, width=80, markup=False))
    out = text.getvalue()
    assert "interpreter timings" in out and "outputs agree" in out
    assert "geomean" not in out and "x base" not in out and "captured" not in out  # CPU: never a speedup
    assert all(r["speedup"] is None and r["ceiling"] is None for r in rows)
    assert "compares BSP with itself" in out  # no CPU policy: autofuse's own choice is bsp everywhere
    assert max(len(line) for line in out.splitlines()) <= 80


def test_bench_layer_numbers_on_gpu_timings() -> None:
    """A GPU row (made-up timings): x base, the ceiling from the layer's bound max(collectives, rest) as
    autofuse.measure.compare defines it, x alt against the fastest alternative layer; rendered at 80 columns."""
    import io

    from rich.console import Console

    from autofuse.bench.bench_layer import _row, render, summarize

    item = {"phase": "decode", "batch": 8, "context": 4096}
    t = {"baseline": 100.0, "autofuse": 80.0, "alternative 0": 90.0, "alternative 1": 95.0}
    alts = {"alternative 0": {"ag_gemm": "torch_symm"}, "alternative 1": {"ag_gemm": "other"}}
    row = _row(item, "graph", "default", t, 30.0, {}, 1e-3, {"o_proj": "gemm_ar:one_shot"}, False, alts)
    assert row["speedup"] == 1.25 and row["bound_us"] == 70.0 and abs(row["ceiling"] - 100 / 70) < 1e-12
    assert abs(row["ceiling_captured"] - 0.25 / (100 / 70 - 1)) < 1e-12
    assert row["alternative_us"] == 90.0 and row["alternative"] == {"ag_gemm": "torch_symm"}
    assert row["speedup_vs_alternative"] == 90.0 / 80.0
    heavy = _row(item, "graph", "default", t, 70.0, {}, 1e-3, {}, False, {})  # collectives > rest: bound = comm
    assert heavy["bound_us"] == 70.0 and heavy["speedup_vs_alternative"] is None
    (s,) = summarize([row])
    assert s["speedup_geomean"] == 1.25 and s["speedup_vs_alternative_geomean"] == 90.0 / 80.0 and not s["all_bsp"]
    text = io.StringIO()
    render({"rows": [row], "modes": ["graph"], "model": "70b", "world": 2, "device": "GPU"},
           Console(file=text, width=80, markup=False))
    out = text.getvalue()
    assert "x alt" in out and "1.125" in out and "x1.250 geomean" in out and "over the best alternative" in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_bench_layer_plan() -> None:
    from autofuse.bench.bench_layer import Options, plan

    full = plan(Options(), "cuda")
    assert [x["tokens"] for x in full if x["phase"] == "prefill"] == [512, 2048, 8192]
    assert len([x for x in full if x["phase"] == "decode"]) == 16
    got = plan(Options(shapes="T=2048,B=8,S=16K,1x4k", phases=None), "cuda")
    assert got == [{"phase": "prefill", "tokens": 2048}, {"phase": "decode", "batch": 1, "context": 4096},
                   {"phase": "decode", "batch": 8, "context": 16384}]
    assert plan(Options(phases=["decode"], shapes="B=128"), "cuda")[-1] == {"phase": "decode", "batch": 128,
                                                                          "context": 32768}
    with pytest.raises(ValueError):
        plan(Options(shapes="M=3"), "cuda")


def test_bench_layer_options() -> None:
    """The CLI's BenchOptions map onto the layer's: sweep names the model, --shapes items may hold
    commas, --variants: default/each kept, a bare name forces it on every op that has it, op:variant
    items form one configuration."""
    from autofuse.core import registry
    from autofuse.bench.bench import BenchOptions
    from autofuse.bench.bench_layer import Options, autofuse_configs, plan

    o = Options.of(BenchOptions(target="layer", sweep="8b", shapes=["T=512,B=1", "S=4K"], reps=5,
                                variants=["default", "push", "ag_gemm:pull", "gemm_ar:one_shot"]))
    assert (o.model, o.reps) == ("8b", 5)
    assert plan(o, "cuda") == [{"phase": "prefill", "tokens": 512}, {"phase": "decode", "batch": 1, "context": 4096}]
    with_push = ",".join(f"{op}:push" for op in registry.names() if "push" in registry.get(op).variants)
    assert autofuse_configs(o) == ["", with_push, "ag_gemm:pull,gemm_ar:one_shot"]
    assert autofuse_configs(Options(autofuse="default;each")) == ["", "each"]
    with pytest.raises(ValueError):
        autofuse_configs(Options(variants=["no_such_variant"]))


# --------------------------------------------------------------------------------------- GPU check
def _gpu_job(world, model: str) -> list[tuple[str, float]]:
    """Real sizes: both layers eager, and each captured in a CUDA graph and replayed, for autofuse's
    default choice and every forced combination; (case, rel. difference) rows."""
    import autofuse

    m = example()
    cfg, w, r, dev = m.CONFIGS[model], world.size, world.rank, world.device
    fused, base = m.make_layers(cfg, world.group, seed=0, device=dev)
    g = torch.Generator(device=dev).manual_seed(5 + r)
    x = torch.randn(512 // w, cfg.hidden, generator=g, device=dev).to(torch.bfloat16)
    xd = torch.randn(8, cfg.hidden, generator=torch.Generator(device=dev).manual_seed(6), device=dev).to(torch.bfloat16)
    pos = torch.full((8,), 4096, device=dev)
    cache = m.KVCache.random(cfg, 8, 4097, r, w, device=dev)
    calls = {"prefill": (lambda: fused.prefill(x), lambda: base.prefill(x)),
             "decode": (lambda: fused.decode(xd, pos, cache), lambda: base.decode(xd, pos, cache))}

    def replayed(fn):
        fn()
        graph, out = m.capture(fn)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    rows = []
    for combo in _combos(world):
        os.environ["AUTOFUSE_VARIANT"] = combo
        autofuse.set_policy(None)
        for phase, (f, b) in calls.items():
            expected = b()
            label = f"{combo or 'default'}/{phase}"
            rows.append((f"{label}/eager autofuse-vs-baseline", m.rel_diff(f(), expected)))
            rows.append((f"{label}/graph autofuse-vs-baseline", m.rel_diff(replayed(f), expected)))
            rows.append((f"{label}/graph baseline-vs-eager", m.rel_diff(replayed(b), expected)))
    os.environ.pop("AUTOFUSE_VARIANT", None)
    return rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("model", ["8b", "70b"])
def test_layer_gpu(model: str) -> None:
    """Two GPUs, real Llama-3 sizes, prefill of 512 tokens and decode of 8 x 4K: the autofuse layer
    matches the baseline (eager and replayed from a CUDA graph) with every forced combination."""
    rows = spawn(_gpu_job, 2, model, device_kind="cuda", timeout_s=900)
    bad = [(case, err) for case, err in rows[0] if not err <= TOL]
    assert not bad, f"errors above {TOL}: {bad}\nall: {rows[0]}"


def test_example_default_run_checks_autofuse_variants_without_torchrun(tmp_path) -> None:
    """`python examples/llama_layer.py`, as the examples README says, without torchrun: it starts its own
    2 CPU ranks; with no policy here autofuse's choice is bsp everywhere, so it checks every variant forced
    in turn against the baseline layer (a bsp-vs-bsp comparison alone would check nothing)."""
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "AUTOFUSE_VARIANT")}
    env["XDG_DATA_HOME"] = str(tmp_path)  # no user policy
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    forced = re.findall(r"^(prefill|decode): autofuse \(forced: ([^)]*)\) vs baseline: rel\. difference \S+ \(ok",
                        proc.stdout, re.M)
    ran = {v for _, names in forced for v in names.split(", ")}
    from autofuse.core import registry

    # the example forces every op's variants, but the layer calls only OPS: the others (MoE's dispatch and
    # combine) are skipped here, since a layer that never calls them cannot show they ran
    skipped = sorted(set(registry.names()) - set(OPS))
    every = {f"{op}:{n}" for op in registry.names() if op in OPS for n, v in registry.get(op).variants.items()
             if v.family not in ("bsp", "peer")}  # peers (torch's symmetric memory) run on CUDA only
    assert ran == every, (ran ^ every, f"not called by the layer, skipped: {skipped}", proc.stdout)
    assert "WRONG" not in proc.stdout
