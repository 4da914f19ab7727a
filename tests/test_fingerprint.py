"""Fingerprint layers without a GPU: the topology of the visible GPUs only (recorded `nvidia-smi`
outputs: a 4x H200 NV18 host seen through CUDA_VISIBLE_DEVICES by index, GPU- and MIG- UUID, a
2x H200 host, a host of NVLink pairs), the machine id, and how a policy matches layer by layer
(this machine; same hardware kind on another host, every decision confirmed; other hardware never)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from _toy_op import OP as TOY, tuned_rows

from autofuse.core import registry
from autofuse.core.op import Problem
from autofuse.dispatch.policy import Policy
from autofuse.measure import environment
from autofuse.tuning.fit import fit

ROOT = Path(__file__).resolve().parents[1]
SMI = Path(__file__).parent / "fixtures" / "nvidia_smi"
SHIPPED = sorted((ROOT / "models").glob("nvidia-h200-x2-*.json"))


def smi(name: str) -> str:
    return (SMI / name).read_text()


# -- topology of the visible GPUs ----------------------------------------------------------------

@pytest.mark.parametrize("visible, count, gpus, topology", [
    (None, 4, [0, 1, 2, 3], "X,NV18,NV18,NV18;NV18,X,NV18,NV18;NV18,NV18,X,NV18;NV18,NV18,NV18,X"),
    ("0,1", 2, [0, 1], "X,NV18;NV18,X"),
    ("2,3", 2, [2, 3], "X,NV18;NV18,X"),
    (" 3 , 0", 2, [3, 0], "X,NV18;NV18,X"),
    ("GPU-3b8d0f24-1c5e-4a9b-9d7f-4c2e8a3f5d03,GPU-4c9e1a35-2d6f-4bac-ae80-5d3f9b4a6e04", 2, [2, 3], "X,NV18;NV18,X"),
    ("GPU-2a7c,GPU-1f0e", 2, [1, 0], "X,NV18;NV18,X"),  # unique UUID prefixes, as CUDA takes them
    ("MIG-8f3b2da1-4a5c-5e7f-9bac-1d2e3f4a5b6c", 1, [1], "X"),  # a MIG instance: its GPU
    ("MIG-GPU-3b8d0f24-1c5e-4a9b-9d7f-4c2e8a3f5d03/1/0", 1, [2], "X"),  # the legacy MIG form
    ("1,bogus,2", 1, [1], "X"),  # CUDA stops at the first entry it cannot take
    ("GPU-,0", 0, [], ""),  # an ambiguous UUID prefix: CUDA takes none
])
def test_visible_gpus_of_a_4_gpu_host(visible, count, gpus, topology):
    got = environment.visible_gpus(visible, smi("h200x4-uuids.txt"), count, smi("h200x4-list.txt"))
    assert got == gpus
    assert environment.topology_summary(smi("h200x4-topo.txt"), got) == topology


def test_topology_keeps_rows_and_columns_of_the_visible_gpus_in_order():
    text = smi("pairs4-topo.txt")  # NV4 pairs (0,1) and (2,3), SYS across
    assert environment.topology_summary(text, [0, 1]) == "X,NV4;NV4,X"
    assert environment.topology_summary(text, [1, 2]) == "X,SYS;SYS,X"
    assert environment.topology_summary(text, [0, 2, 3]) == "X,SYS,SYS;SYS,X,NV4;SYS,NV4,X"
    assert environment.topology_summary(text, [0, 7]) == "X,?;?,?"  # a GPU the matrix lacks shows as '?'
    two = smi("h200x2-topo.txt")
    assert environment.topology_summary(two, [0, 1]) == "X,NV18;NV18,X"


@pytest.fixture
def fake_cuda(monkeypatch):
    """`fingerprint("cuda")` on a recorded host: `use(topo, uuids, count, visible)` answers nvidia-smi
    from fixtures and torch.cuda's count and name as that host would."""
    import torch

    shipped = json.loads(SHIPPED[0].read_text())["fingerprint"] if SHIPPED else {}

    def use(topo: str, uuids: str, count: int, visible: str | None, listing: str = "") -> dict:
        answers = {("topo", "-m"): smi(topo), ("--query-gpu=index,uuid", "--format=csv,noheader"): smi(uuids),
                   ("-L",): listing,
                   ("--query-gpu=driver_version", "--format=csv,noheader"): shipped.get("driver", "1")}
        monkeypatch.setattr(environment, "_nvidia_smi", lambda *args: answers.get(args, ""))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        environment.fingerprint.cache_clear()
        return environment.fingerprint("cuda")

    yield use
    environment.fingerprint.cache_clear()


@pytest.mark.skipif(not SHIPPED, reason="no shipped 2x H200 policy in models/")
def test_two_gpus_of_a_4_gpu_host_match_the_shipped_2_gpu_policy(fake_cuda):
    """Issue 43: two GPUs of a 4x H200 host (CUDA_VISIBLE_DEVICES=0,1) recorded four topology rows
    and matched no policy; the visible GPUs' topology gives the shipped 2x H200 hardware id."""
    shipped = json.loads(SHIPPED[0].read_text())["fingerprint"]
    pair01 = fake_cuda("h200x4-topo.txt", "h200x4-uuids.txt", 2, "0,1")
    assert pair01["topology"] == shipped["topology"] == "X,NV18;NV18,X", pair01["topology"]
    assert pair01["hardware_id"] == shipped["hardware_id"]
    pair23 = fake_cuda("h200x4-topo.txt", "h200x4-uuids.txt", 2, "2,3")
    by_uuid = fake_cuda("h200x4-topo.txt", "h200x4-uuids.txt", 2,
                        "GPU-3b8d0f24-1c5e-4a9b-9d7f-4c2e8a3f5d03,GPU-4c9e1a35-2d6f-4bac-ae80-5d3f9b4a6e04")
    host2 = fake_cuda("h200x2-topo.txt", "h200x2-uuids.txt", 2, None)
    assert pair23["hardware_id"] == by_uuid["hardware_id"] == host2["hardware_id"] == shipped["hardware_id"]
    # one machine per set of GPUs: 0,1 and 2,3 of one host are two machines, 2,3 by index or UUID one
    assert by_uuid["machine_id"] == pair23["machine_id"] != pair01["machine_id"] != host2["machine_id"]
    assert "machine_id" not in environment.KEY_FIELDS  # ids and policy file names do not depend on the host
    whole = fake_cuda("h200x4-topo.txt", "h200x4-uuids.txt", 4, None)
    assert whole["hardware_id"] != shipped["hardware_id"]  # four GPUs: another hardware kind


# -- policies matched layer by layer -------------------------------------------------------------

HERE = dict(environment.fingerprint("cpu"), gpu_name="NVIDIA H200", device_kind="cuda", gpu_count=2,
            topology="X,NV18;NV18,X", machine_id="a" * 16)


@pytest.fixture(scope="module")
def data() -> dict:
    return fit(tuned_rows(), HERE, "graph", ops={"toy_mm": TOY}).data


def _tuned() -> Problem:
    return Problem.make("toy_mm", "float32", 2, M=1024, N=16, K=16)  # measured: fused 1.5x faster


def test_policy_of_this_machine_is_trusted_as_fitted(data):
    pol = Policy.from_dict(data, HERE)
    d = pol.decide(_tuned(), TOY)
    assert pol.match == "machine" and not pol.other_host and pol.match_text() == "this machine"
    assert d.basis == "measured" and d.variant == "fused" and d.reason.startswith("measured:"), d
    assert not pol.needs_confirmation(_tuned(), d)


@pytest.mark.parametrize("theirs", [{"machine_id": "b" * 16}, {"machine_id": None}, {}],
                         ids=["other host", "no id recorded", "file from before machine ids"])
def test_policy_of_another_host_of_the_kind_serves_with_every_decision_confirmed(data, theirs):
    fp = {k: v for k, v in data["fingerprint"].items() if k != "machine_id"} | theirs
    pol = Policy.from_dict(dict(data, fingerprint=fp), HERE)
    assert not pol.refused and pol.match == "kind" and pol.other_host
    d = pol.decide(_tuned(), TOY)
    assert d.variant == "fused" and d.basis == "measured", d
    assert pol.needs_confirmation(_tuned(), d)  # even a measured problem: it was measured elsewhere
    assert d.reason.startswith("policy matched by hardware kind (other host): confirmed on first use; measured:"), d
    assert "hardware kind (other host)" in str(d)  # what autofuse.explain prints


@pytest.mark.parametrize("field, value", [("gpu_count", 4), ("gpu_name", "NVIDIA H100 80GB HBM3"),
                                          ("topology", "X,SYS;SYS,X")])
def test_other_model_count_or_links_never_share(data, field, value):
    with pytest.warns(UserWarning, match=f"other hardware .*{field}"):
        pol = Policy.from_dict(data, dict(HERE, **{field: value}))
    assert pol.refused and pol.decide(_tuned(), TOY).basis == "fallback"
    assert environment.hardware_match(data["fingerprint"], dict(HERE, **{field: value})) is None


def test_find_policy_prefers_this_machine_then_serves_another_hosts(data, tmp_path, monkeypatch):
    from autofuse.dispatch import find_policy

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.setenv("AUTOFUSE_MODELS_DIR", str(folder))
    here = dict(HERE, hardware_id=environment.hardware_id(HERE), software_id=environment.software_id(HERE))
    other = dict(data, fingerprint=dict(data["fingerprint"], machine_id="b" * 16))
    (folder / "a-other-host-graph.json").write_text(json.dumps(other))
    assert find_policy(here, "graph") == folder / "a-other-host-graph.json"
    (folder / "z-this-machine-graph.json").write_text(json.dumps(data))
    assert find_policy(here, "graph") == folder / "z-this-machine-graph.json"
    assert find_policy(dict(here, hardware_id="0" * 16), "graph") is None


@pytest.mark.skipif(not SHIPPED, reason="no shipped 2x H200 policy in models/")
def test_shipped_policy_serves_two_gpus_of_a_4_gpu_host(fake_cuda, tmp_path, monkeypatch):
    """The issue's host: CUDA_VISIBLE_DEVICES=0,1 of a 4x H200 host finds the shipped 2x H200 policy,
    matched by hardware kind (another host), every decision confirmed on first use."""
    from autofuse.dispatch import find_policy

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    monkeypatch.delenv("AUTOFUSE_MODELS_DIR", raising=False)
    fp = fake_cuda("h200x4-topo.txt", "h200x4-uuids.txt", 2, "0,1")
    found = find_policy(fp, "graph")
    assert found is not None and found.parent == ROOT / "models" and found.name.endswith("-graph.json"), found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the software here differs from the shipped policy's (said once)
        pol = Policy.load(found, fp)
    assert not pol.refused and pol.match == "kind"
    d = pol.decide(Problem.from_key(next(iter(pol.ops["gemm_ar"]["problems"]))), registry.get("gemm_ar"))
    assert pol.needs_confirmation(d.problem, d) and "policy matched by hardware kind (other host)" in d.reason, d
