"""Environment fingerprint: what a measurement or a policy is valid for, in layers (DESIGN.md, Tuning and store).

- **hardware** (`HARDWARE_FIELDS`: device kind, GPU name, GPU count, link topology of the GPUs this
  process sees): the hardware *kind*. It must match, or a measurement or policy does not apply at all
  (other GPU models or counts never share).
- **machine** (`MACHINE_FIELDS`: `machine_id`, a hash of the visible GPUs' UUIDs, or of the host name
  where there are none): which host of that kind. A policy fitted on this machine is trusted as
  today; one fitted on another host of the same kind (or recording no machine id: files written
  before this layer) serves here with every decision confirmed on first use (`hardware_match`).
- **software** (`SOFTWARE_FIELDS`: driver, CUDA, torch, Triton, NCCL versions): a difference is
  reported, never strands rows; dispatch confirms its decisions on first use when it differs.
- **ops** (`{op name: digest}`): `op_digest(op)` hashes the op's host module and every module it
  imports (transitively) among the kernels (`autofuse.kernels.*`), the other op modules and the
  shared op-building modules (`DIGEST_MODULES`: typed GEMM config, runner, workspace, heap
  collectives, hybrid variants),
  as syntax trees without docstrings, comments or layout; an edit to one op's code invalidates that
  op's rows, studies and policy entries only. Generic infrastructure (op, heap, world, status) is
  not hashed: it does not decide what one op computes or launches.

The topology is that of the visible GPUs only (`visible_gpus`: CUDA_VISIBLE_DEVICES's indices or
GPU-/MIG- UUIDs, in its order), rows and columns of `nvidia-smi topo -m` kept for those GPUs:
two GPUs of a 4-GPU NVLink host read like a 2-GPU host of the same GPUs and links.

`fingerprint()` returns one flat dict: the hardware, machine and software fields, `python`
(informative), `ops`, `hardware_id`, `software_id` and `id` (= `fingerprint_id`: hardware +
software, for display; the machine id is in neither, so ids and file names do not depend on the host).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import platform
import re
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping

HARDWARE_FIELDS = ("device_kind", "gpu_name", "gpu_count", "topology")
MACHINE_FIELDS = ("machine_id",)
SOFTWARE_FIELDS = ("driver", "cuda", "torch", "triton", "nccl")
KEY_FIELDS = HARDWARE_FIELDS + SOFTWARE_FIELDS  # what `fingerprint_id` covers
LAYERS = ("hardware", "machine", "software", "ops")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # terminal attributes nvidia-smi writes even into a pipe
MATCHES = {"machine": "this machine", "kind": "hardware kind (other host)"}  # hardware_match's layers
# Modules that count towards an op's digest when the op module imports them (directly or not).
DIGEST_PACKAGES = ("autofuse.kernels", "autofuse.ops")
DIGEST_MODULES = ("autofuse.core.gemm", "autofuse.core.runner", "autofuse.comm.workspace", "autofuse.comm.collectives",
                  "autofuse.comm.lowlatency")
ALWAYS = ("autofuse.kernels.shmem",)  # the device API every fused kernel stands on


# -- per-op code digest --------------------------------------------------------------------------

def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def _canonical(node: Any) -> str:
    """The syntax tree as text, independent of the Python version's optional fields (empty ones are
    left out, so 3.10 and 3.12's `type_params=[]` read the same) and of positions."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            parts.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(v) for v in node) + "]"
    return f"{type(node).__name__}:{node!r}"


Imports = tuple[tuple[str, int, tuple[str, ...]], ...]  # a file's import statements: (module, level, names)


def _read_code(raw: bytes, path: Path) -> tuple[str, Imports]:
    """One file's digest (its syntax tree without docstrings, comments or layout) and its import
    statements, from its contents: what parsing costs, done once per content (`_CodeCache`)."""
    tree = ast.parse(raw.decode(), filename=str(path))
    imports: list[tuple[str, int, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imports.extend((a.name, 0, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imports.append((node.module or "", node.level, tuple(a.name for a in node.names)))
    digest = hashlib.sha256(_canonical(_strip_docstrings(tree)).encode()).hexdigest()
    return digest, tuple(imports)


class _CodeCache:
    """Digests and imports of file contents seen before, by the contents' sha256: in this process, and
    in `<user cache>/autofuse/code-<python>-<this module's hash>.json`, so a new process (a rank, a
    test) does not parse every op's sources again. The key is the contents and the file names the
    Python version and this module's own code, so an entry can only be what parsing those contents
    gives; an unreadable or damaged file is ignored (and replaced), an unwritable folder skipped."""

    LIMIT = 4096  # entries kept on disk (a file over it starts again)

    def __init__(self) -> None:
        self.entries: dict[str, tuple[str, Imports]] = {}
        self.loaded = False
        self.added = 0

    def path(self) -> Path:
        from autofuse.core import settings

        me = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
        return settings.user_cache_dir() / f"code-py{sys.version_info[0]}.{sys.version_info[1]}-{me}.json"

    def _load(self) -> None:
        self.loaded = True
        try:
            data = json.loads(self.path().read_text())
            for key, (digest, imports) in data.items():
                if isinstance(key, str) and isinstance(digest, str):
                    self.entries.setdefault(key, (digest, tuple((m, int(lv), tuple(n)) for m, lv, n in imports)))
        except (OSError, ValueError, TypeError, AttributeError):
            pass  # no cache yet, or not one this code can read: it is rebuilt

    def get(self, path: Path) -> tuple[str, Imports]:
        raw = path.read_bytes()
        key = hashlib.sha256(raw).hexdigest()
        if key not in self.entries and not self.loaded:
            self._load()
        if key not in self.entries:
            self.entries[key] = _read_code(raw, path)
            self.added += 1
        return self.entries[key]

    def save(self) -> None:
        """Write the entries added since the last save (merged with what another process wrote)."""
        if not self.added:
            return
        self.added = 0
        target = self.path()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                data = json.loads(target.read_text())
                data = data if isinstance(data, dict) and len(data) < self.LIMIT else {}
            except (OSError, ValueError):
                data = {}
            data.update({k: [d, [list(i) for i in imps]] for k, (d, imps) in self.entries.items()})
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, target)
        except OSError:
            pass  # a read-only or full cache folder: the next process parses again


_CODE = _CodeCache()


def source_digest(path: str | Path) -> str:
    """sha256 of one Python file's code: docstrings, comments and formatting do not count."""
    return _CODE.get(Path(path))[0]


def _counts(name: str) -> bool:
    return name in DIGEST_MODULES or any(name == p or name.startswith(p + ".") for p in DIGEST_PACKAGES)


@functools.lru_cache(maxsize=None)
def _installed_roots() -> dict[str, Path]:
    """Where the package's modules are, found without running any of them (an op module that does
    not import cleanly still has a digest)."""
    spec = importlib.util.find_spec("autofuse")
    kernels = importlib.util.find_spec("autofuse.kernels")  # imports the autofuse package only
    assert spec is not None and spec.origin and kernels is not None and kernels.submodule_search_locations
    base = Path(spec.origin).parent
    return {"autofuse": base, "autofuse.kernels": Path(kernels.submodule_search_locations[0])}


def _module_file(name: str, roots: Mapping[str, Path] | None) -> Path | None:
    """The source file of module `name` under `roots` (default: the installed package), else of an
    already imported module or a top-level one (an op defined outside the package); None if none."""
    roots = _installed_roots() if roots is None else roots
    prefix = max((r for r in roots if name == r or name.startswith(r + ".")), key=len, default=None)
    if prefix is not None:
        base = Path(roots[prefix]).joinpath(*name[len(prefix):].split(".")[1:])
        for f in (base / "__init__.py", base.with_suffix(".py")):
            if f.is_file():
                return f
        return None
    if _counts(name) or name == "autofuse" or name.startswith("autofuse."):
        return None
    mod = sys.modules.get(name)
    origin = getattr(mod, "__file__", None) if mod is not None else None
    if origin is None and "." not in name:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
    return Path(origin) if origin and str(origin).endswith(".py") else None


def _imports(path: Path, module: str, roots: Mapping[str, Path] | None) -> set[str]:
    """The modules counted in digests that `path` (module `module`) imports anywhere in its code."""
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for base, level, imported in _CODE.get(path)[1]:
        if not imported:  # import a.b
            names = [base]
        else:
            if level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{a}" for a in imported if a != "*"]
        for name in names:
            if _counts(name) and (name in DIGEST_PACKAGES or _module_file(name, roots) is not None):
                out.add(name)
    return out


def digest_modules(module: str, roots: Mapping[str, Path] | None = None,
                   extra: Iterable[str] = ()) -> dict[str, Path]:
    """`module` and every module counted in digests that it imports, transitively ({name: file}).

    `roots` maps package names to folders (tests hash a copy of the sources); by default modules are
    found where Python would import them from.
    """
    found: dict[str, Path] = {}
    todo = [module, *ALWAYS, *extra]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        f = _module_file(name, roots)
        if f is None:
            continue
        found[name] = f
        todo.extend(_imports(f, name, roots) - set(found))
    return dict(sorted(found.items()))


def _op_module(op: Any) -> str:
    """The module that defines an op: the registry's entry for a registered op, else where its
    functions live (an Op object from any module, e.g. 'tests.test_tune:FAKE_OP')."""
    from autofuse.core import registry

    if isinstance(op, str):
        if op not in registry.MODULES:
            raise KeyError(f"unknown op {op!r}: known ops are {', '.join(registry.MODULES)}")
        return registry.MODULES[op]
    if op.name in registry.MODULES and getattr(sys.modules.get(registry.MODULES[op.name]), "OP", None) is op:
        return registry.MODULES[op.name]
    if type(op).__module__ != "autofuse.core.op":
        return type(op).__module__
    for value in vars(op).values():  # the op's own functions (problem_of, inputs, ...)
        mod = getattr(value, "__module__", None)
        if callable(value) and mod and mod != "autofuse.core.op":
            return mod
    for v in getattr(op, "variants", {}).values():  # else where its variant classes live
        if type(v).__module__ != "autofuse.core.op":
            return type(v).__module__
    raise ValueError(f"cannot tell which module defines op {op.name!r}")


def op_digest(op: Any, roots: Mapping[str, Path] | None = None) -> str:
    """sha256 (16 hex) of an op's code: its host module and what it imports among the kernel modules
    (its kernels module, kernels/shmem.py, shared kernel modules), other op modules it builds on and
    DIGEST_MODULES, as syntax trees without docstrings or comments. `op` is a registered name or an
    Op object; an op module may list more modules to include in `DIGEST_EXTRA` (a tuple of names)."""
    module = _op_module(op)
    files = digest_modules(module, roots)
    main = files.get(module)
    extra: tuple[str, ...] = ()
    if main is not None:
        for node in ast.parse(main.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "DIGEST_EXTRA" for t in node.targets):
                extra = tuple(ast.literal_eval(node.value))
        if extra:
            files = digest_modules(module, roots, extra)
    h = hashlib.sha256()
    for name, f in files.items():
        h.update(f"{name}\n{source_digest(f)}\n".encode())
    return h.hexdigest()[:16]


def op_digests(names: Iterable[str] | None = None) -> dict[str, str]:
    """{op: op_digest(op)} for the registered ops (or `names`)."""
    from autofuse.core import registry

    digests = {n: op_digest(n) for n in (registry.names() if names is None else names)}
    _CODE.save()
    return digests


def legacy_kernel_hash() -> str:
    """The single hash over every kernel and op source file that schema-1 databases and policies
    recorded as `kernel_hash`; used only to carry their rows over when the code is unchanged."""
    roots = _installed_roots()
    h = hashlib.sha256()
    for root in (roots["autofuse.kernels"], roots["autofuse"] / "ops"):
        for f in sorted(root.glob("*.py")):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


# -- hardware and software -----------------------------------------------------------------------

def _nvidia_smi(*args: str) -> str:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ""
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def topology_matrix() -> str:
    """`nvidia-smi topo -m` (links between GPUs: NV18, PIX, SYS, ...) or '' where unavailable."""
    return _nvidia_smi("topo", "-m")


def gpu_uuids() -> str:
    """`nvidia-smi --query-gpu=index,uuid` as CSV lines ('0, GPU-...'), or '' where unavailable."""
    return _nvidia_smi("--query-gpu=index,uuid", "--format=csv,noheader")


def _uuid_table(index_uuid: str) -> dict[int, str]:
    """{nvidia-smi index: UUID} from `gpu_uuids()`'s lines."""
    out: dict[int, str] = {}
    for line in index_uuid.splitlines():
        index, _, uuid = (c.strip() for c in line.partition(","))
        if index.isdigit() and uuid:
            out[int(index)] = uuid
    return out


def _mig_parents(listing: str) -> dict[str, int]:
    """{MIG UUID: its GPU's index} from `nvidia-smi -L` ('GPU 0: ... (UUID: GPU-...)' lines, each
    followed by its '  MIG ... (UUID: MIG-...)' lines)."""
    out: dict[str, int] = {}
    gpu = None
    for line in listing.splitlines():
        head, _, uuid = line.rpartition("(UUID: ")
        uuid = uuid.rstrip(")").strip()
        words = head.split()
        if len(words) >= 2 and words[0] == "GPU" and words[1].rstrip(":").isdigit():
            gpu = int(words[1].rstrip(":"))
        elif words and words[0] == "MIG" and gpu is not None and uuid:
            out[uuid] = gpu
    return out


def visible_gpus(visible: str | None, index_uuid: str, count: int, mig_listing: str = "") -> list[int]:
    """The nvidia-smi indices of the `count` GPUs this process sees, in CUDA's order.

    `visible` is CUDA_VISIBLE_DEVICES (None: unset, every GPU in index order): indices, GPU-UUIDs (a
    unique prefix suffices, as CUDA accepts) or MIG-UUIDs (their GPU's index; `mig_listing` is
    `nvidia-smi -L`, needed only for those), read up to the first entry CUDA would not take.
    `index_uuid` is `gpu_uuids()`'s text. Entries that cannot be mapped end the list there (as CUDA
    stops at them); the first `count` are kept. CUDA's integer indices are taken as nvidia-smi's
    (they agree for one GPU model under CUDA's default order).
    """
    if visible is None:
        return list(range(count))
    uuids = _uuid_table(index_uuid)
    out: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit():
            out.append(int(entry))
        elif entry.startswith("GPU-"):
            hits = [i for i, u in uuids.items() if u.startswith(entry)]
            if len(hits) != 1:
                break
            out.append(hits[0])
        elif entry.startswith("MIG-"):
            parent = entry[4:].split("/")[0] if entry.startswith("MIG-GPU-") else None  # legacy MIG-GPU-<uuid>/gi/ci
            hits = ([i for i, u in uuids.items() if u == parent] if parent else
                    [i for u, i in _mig_parents(mig_listing).items() if u.startswith(entry)])
            if len(set(hits)) != 1:
                break
            out.append(hits[0])
        else:
            break
    return out[:count]


def topology_summary(text: str, gpus: list[int]) -> str:
    """The link cells of `nvidia-smi topo -m` between the GPUs `gpus` (nvidia-smi indices, in that
    order: rows and columns) as 'X,NV18;NV18,X' (stable across runs; '?' where a GPU is missing)."""
    lines = [ANSI.sub("", line).split() for line in text.splitlines()]  # its header is underlined
    header = next((cells for cells in lines if cells[:1] == ["GPU0"] and cells[1:2] != ["X"]), None)
    column = {c: j + 1 for j, c in enumerate(header or [])}  # row cells: name, then header order
    rows = {cells[0]: cells for cells in lines if cells and cells[0].startswith("GPU") and cells[0][3:].isdigit()
            and cells is not header}
    out = []
    for a in gpus:
        row = rows.get(f"GPU{a}")
        cells = []
        for b in gpus:
            j = column.get(f"GPU{b}", b + 1) if header else b + 1
            cells.append(row[j] if row is not None and j < len(row) else "?")
        out.append(",".join(cells))
    return ";".join(out)


def machine_key(uuids: Iterable[str], host: str) -> str:
    """Short stable hash naming one machine: its visible GPUs' UUIDs (sorted), else its host name."""
    uuids = sorted(u for u in uuids if u)
    key = json.dumps({"gpus": uuids} if uuids else {"host": host}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _cuda_fields(count: int) -> dict:
    """The topology and machine id of the visible GPUs (nvidia-smi's view; '' / the host name without it)."""
    index_uuid = gpu_uuids()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    mig = _nvidia_smi("-L") if visible and "MIG-" in visible else ""
    gpus = visible_gpus(visible, index_uuid, count, mig)
    text = topology_matrix()
    uuids = _uuid_table(index_uuid)
    return {"topology": topology_summary(text, gpus) if text else "",
            "machine_id": machine_key([uuids.get(g, "") for g in gpus], socket.gethostname())}


@functools.lru_cache(maxsize=None)
def fingerprint(device_kind: str | None = None) -> dict:
    """This process's environment: hardware, machine and software fields, `ops` digests and the ids.

    Cached per process: call `fingerprint.cache_clear()` after editing op code in a running process.
    """
    import torch
    import triton

    if device_kind is None:
        device_kind = "cuda" if torch.cuda.is_available() else "cpu"
    fp: dict = {"device_kind": device_kind, "torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version()}
    if device_kind == "cuda":
        count = torch.cuda.device_count()
        fp.update(
            gpu_name=torch.cuda.get_device_name(0),
            gpu_count=count,
            **_cuda_fields(count),
            driver=(_nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").splitlines() or [""])[0],
            cuda=torch.version.cuda or torch.version.hip or "",
            nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "",
        )
    else:
        fp.update(gpu_name=f"cpu-emulation ({platform.machine()})", gpu_count=0, topology="shm",
                  machine_id=machine_key((), socket.gethostname()), driver="", cuda="", nccl="")
    fp["ops"] = op_digests()
    fp["hardware_id"] = hardware_id(fp)
    fp["software_id"] = software_id(fp)
    fp["id"] = fingerprint_id(fp)
    return fp


def _hash(fp: Mapping[str, Any], fields: Iterable[str]) -> str:
    key = json.dumps({k: fp.get(k) for k in fields}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def hardware_id(fp: Mapping[str, Any]) -> str:
    """Short stable hash of the hardware layer (must match for a row or policy to apply)."""
    return _hash(fp, HARDWARE_FIELDS)


def software_id(fp: Mapping[str, Any]) -> str:
    """Short stable hash of the software layer (a difference is reported, not disqualifying)."""
    return _hash(fp, SOFTWARE_FIELDS)


def fingerprint_id(fp: Mapping[str, Any]) -> str:
    """Short stable hash of hardware + software: the environment's id, as shown to users."""
    return _hash(fp, KEY_FIELDS)


def layer(fp: Mapping[str, Any], name: str) -> dict:
    """One layer of a fingerprint as a dict: 'hardware', 'machine', 'software' or 'ops'."""
    if name == "ops":
        return dict(fp.get("ops") or {})
    fields = {"hardware": HARDWARE_FIELDS, "machine": MACHINE_FIELDS, "software": SOFTWARE_FIELDS}.get(name)
    if fields is None:
        raise ValueError(f"layer must be one of {LAYERS}, not {name!r}")
    return {k: fp.get(k) for k in fields}


def differences(a: Mapping[str, Any], b: Mapping[str, Any], layer: str | None = None) -> dict[str, tuple]:
    """{field: (a's value, b's value)} where two fingerprints disagree, in one layer ('hardware',
    'machine', 'software', or 'ops': {op: (digest, digest)} over the ops either records) or, with `layer`
    None, over hardware and software together."""
    if layer == "ops":
        ao, bo = dict(a.get("ops") or {}), dict(b.get("ops") or {})
        return {k: (ao.get(k), bo.get(k)) for k in sorted(set(ao) | set(bo)) if ao.get(k) != bo.get(k)}
    fields = {None: KEY_FIELDS, "hardware": HARDWARE_FIELDS, "machine": MACHINE_FIELDS,
              "software": SOFTWARE_FIELDS}.get(layer)
    if fields is None:
        raise ValueError(f"layer must be one of {LAYERS} or None, not {layer!r}")
    return {k: (a.get(k), b.get(k)) for k in fields if a.get(k) != b.get(k)}


def hardware_match(theirs: Mapping[str, Any], here: Mapping[str, Any]) -> str | None:
    """Which layer a fingerprint recorded with a policy or measurement (`theirs`) matches `here` by:
    'machine' (same hardware kind and the same machine id: this machine), 'kind' (same hardware kind,
    another host, or no machine id recorded: files from before this layer), None (other hardware:
    another GPU model, count or link topology, never shared). `MATCHES` names them for messages."""
    if differences(theirs, here, "hardware"):
        return None
    mine = here.get("machine_id")
    return "machine" if mine and theirs.get("machine_id") == mine else "kind"
