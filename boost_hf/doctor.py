"""``boost-hf doctor``: what to check before a long run, on the machine that will run it.

* the versions that matter (Python, torch with its CUDA and NCCL, transformers, accelerate, DeepSpeed, boost-hf);
* the GPUs: name, memory, compute capability and bf16 support (``--bf16`` needs it); none: CPU processes (gloo);
* the attention kernels torch's ``scaled_dot_product_attention`` may use here (flash, memory-efficient, cuDNN, math)
  and whether the ``flash_attn`` package is installed;
* the output folder: its filesystem (``/proc/mounts``) and whether it is writable. Every rank of a multi-node run
  writes its checkpoint shards there and rank 0 reads them back, so with several nodes it must be a shared
  filesystem (NFS, Lustre, GPFS, ...): a local one is reported as a problem;
* the accelerate configuration in effect (``--config_file``, else ``ACCELERATE_CONFIG_FILE``, else accelerate's
  default file): machines, processes, mixed precision, and what boost-hf refuses in it (in accelerate's own
  ``parallelism_config``: ``cp_size``, ``sp_size``; FSDP version 1). Its ``tp_size`` is honoured as ``--tp_size``, its
  ``dp_shard_size`` and FSDP version 2 as ``--data_parallel fsdp2``; the checks that need the run's flags are made at
  training start.

Nothing here starts a process group. The exit status is 1 when a problem was found.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
from pathlib import Path

from .training.compatibility import unsupported_parallelism

#: filesystems every node of a cluster can mount as one folder
SHARED_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
                      "wekafs", "pvfs2", "orangefs", "cifs", "smb3", "fuse.sshfs", "fuse.juicefs", "9p", "virtiofs")
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "boost-hf")


def filesystem_type(path: str, mounts: str) -> tuple[str, str]:
    """``(mount point, filesystem type)`` of ``path`` from a ``/proc/mounts`` text: the longest mount point above it."""
    path = os.path.realpath(path)
    best = ("/", "unknown")
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    import torch

    out = {"python": platform.python_version(), **{name: _version(name) for name in PACKAGES}}
    out["torch"] = torch.__version__  # the running build, with its local tag (2.14.1+cu130, 2.13.0+cpu): which build it is
    out["cuda"] = torch.version.cuda
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return out


def gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        major, minor = props.major, props.minor
        out.append({"index": i, "name": props.name, "memory_gb": round(props.total_memory / 2**30, 1),
                    "compute_capability": f"{major}.{minor}", "bf16": major >= 8})
    return out


def attention_kernels() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    backends = torch.backends.cuda
    return {
        "flash (sdpa)": cuda and backends.flash_sdp_enabled() and backends.is_flash_attention_available(),
        "memory-efficient (sdpa)": cuda and backends.mem_efficient_sdp_enabled(),
        "cudnn (sdpa)": cuda and backends.cudnn_sdp_enabled(),
        "math (sdpa)": backends.math_sdp_enabled(),
        "flash_attn package": importlib.util.find_spec("flash_attn") is not None,
    }


def accelerate_config(path: str | None) -> dict:
    """The accelerate configuration in effect: its file and the fields boost-hf reads (``{"file": None}`` without one)."""
    from accelerate.commands.config.config_args import default_config_file, load_config_from_file

    path = path or os.environ.get("ACCELERATE_CONFIG_FILE") or default_config_file
    if not os.path.isfile(path):
        return {"file": None, "looked_at": path}
    config = load_config_from_file(path)
    parallelism = getattr(config, "parallelism_config", None) or {}
    return {
        "file": path, "distributed_type": getattr(config.distributed_type, "value", str(config.distributed_type)), "num_machines": config.num_machines,
        "num_processes": config.num_processes, "mixed_precision": getattr(config.mixed_precision, "value", str(config.mixed_precision)),
        "use_cpu": bool(getattr(config, "use_cpu", False)), "parallelism_config": dict(parallelism) or None,
        "fsdp_config": dict(getattr(config, "fsdp_config", None) or {}) or None,
    }


def output_folder(path: str, mounts: str) -> dict:
    folder = Path(path)
    existing = next((p for p in (folder, *folder.resolve().parents) if p.exists()), Path("/"))
    point, fs = filesystem_type(str(existing), mounts)
    return {"path": str(folder), "mount": point, "filesystem": fs, "shared": fs in SHARED_FILESYSTEMS,
            "writable": os.access(existing, os.W_OK)}


def problems(report: dict) -> list[str]:
    """What would stop or endanger a run, each with its fix."""
    out = []
    accel, folder = report["accelerate_config"], report["output_dir"]
    machines = accel.get("num_machines") or 1
    if machines > 1 and not folder["shared"]:
        out.append(f"the output folder {folder['path']} is on {folder['filesystem']} ({folder['mount']}), not a shared "
                   f"filesystem, and the accelerate config runs {machines} machines: every node writes its checkpoint "
                   "shards there; use a folder on NFS/Lustre/GPFS (--output_dir).")
    if not folder["writable"]:
        out.append(f"the output folder {folder['path']} is not writable: choose another --output_dir.")
    sizes = {name.removeprefix("parallelism_config_").removesuffix("_size"): value
             for name, value in (accel.get("parallelism_config") or {}).items() if name.endswith("_size")}
    refusal = unsupported_parallelism(sizes, "the accelerate config's parallelism_config")
    if refusal is not None:
        out.append(refusal)
    version = int((accel.get("fsdp_config") or {}).get("fsdp_version", 1))  # (accelerate's default: 1)
    if "FSDP" in str(accel.get("distributed_type")) and version != 2:
        out.append(f"the accelerate config uses FSDP version {version}, which boost-hf refuses (FSDP1 flattens the "
                   "parameters): set fsdp_version: 2 in its fsdp_config (boost-hf applies FSDP2 over each TP x PP rank's "
                   "data-parallel group), or use MULTI_GPU.")
    wants_bf16 = accel.get("mixed_precision") == "bf16"
    if wants_bf16 and report["gpus"] and not all(g["bf16"] for g in report["gpus"]):
        out.append("the accelerate config asks for bf16 and a GPU here has no bf16 (compute capability < 8.0): use fp16 or fp32.")
    return out


def doctor(*, output_dir: str = "outputs", config_file: str | None = None, mounts_path: str = "/proc/mounts") -> dict:
    mounts = Path(mounts_path).read_text() if os.path.isfile(mounts_path) else ""
    report = {"versions": versions(), "gpus": gpus(), "attention_kernels": attention_kernels(),
              "output_dir": output_folder(output_dir, mounts), "accelerate_config": accelerate_config(config_file)}
    report["problems"] = problems(report)
    return report


def render(report: dict) -> str:
    v = report["versions"]
    lines = ["versions: " + ", ".join(f"{k} {v[k] or '-'}" for k in v)]
    if report["gpus"]:
        lines += [f"GPU {g['index']}: {g['name']}, {g['memory_gb']} GiB, sm {g['compute_capability']}, "
                  f"bf16 {'yes' if g['bf16'] else 'NO'}" for g in report["gpus"]]
    else:
        lines.append("GPUs: none (CUDA not available): training runs on CPU processes (gloo)")
    lines.append("attention kernels: " + ", ".join(f"{k} {'yes' if on else 'no'}" for k, on in report["attention_kernels"].items()))
    f = report["output_dir"]
    lines.append(f"output folder {f['path']}: {f['filesystem']} at {f['mount']}, "
                 f"{'shared' if f['shared'] else 'local (not shared across nodes)'}, {'writable' if f['writable'] else 'NOT writable'}")
    a = report["accelerate_config"]
    if a["file"] is None:
        lines.append(f"accelerate config: none ({a['looked_at']} does not exist): accelerate launch's defaults")
    else:
        lines.append(f"accelerate config {a['file']}: {a['distributed_type']}, {a['num_machines']} machine(s), "
                     f"{a['num_processes']} processes, mixed precision {a['mixed_precision']}"
                     + (", use_cpu" if a["use_cpu"] else ""))
    lines += [f"PROBLEM: {p}" for p in report["problems"]] or ["no problem found"]
    return "\n".join(lines)


__all__ = ["SHARED_FILESYSTEMS", "doctor", "filesystem_type", "problems", "render"]
