"""``boost-hf doctor`` on this CPU machine: versions, no GPU, the attention kernels, the output folder's filesystem
(read from a mount table) and the accelerate config in effect, with the problems a multi-node run would hit."""

from __future__ import annotations

import json

import yaml

from boost_hf.cli import main
from boost_hf.doctor import doctor, filesystem_type

MOUNTS = """/dev/vda / ext4 rw,relatime 0 0
tmpfs /tmp tmpfs rw 0 0
server:/export /shared nfs4 rw,vers=4.2 0 0
/dev/vdb /shared/local ext4 rw 0 0
"""


def test_filesystem_of_a_folder_is_its_deepest_mount():
    assert filesystem_type("/shared/runs/cola-7b", MOUNTS) == ("/shared", "nfs4")
    assert filesystem_type("/shared/local/x", MOUNTS) == ("/shared/local", "ext4")
    assert filesystem_type("/sharedx", MOUNTS) == ("/", "ext4")
    assert filesystem_type("/tmp", MOUNTS) == ("/tmp", "tmpfs")


def _config(tmp_path, **fields):
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU",
                                    "num_machines": 1, "num_processes": 4, "machine_rank": 0, "mixed_precision": "no",
                                    "use_cpu": True, **fields}))
    return str(path)


def test_a_multi_node_run_needs_a_shared_output_folder(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {tmp_path / 'nfs'} nfs4 rw 0 0\n")
    (tmp_path / "nfs").mkdir()
    one_node = doctor(output_dir=str(tmp_path / "out"), config_file=_config(tmp_path), mounts_path=str(mounts))
    assert one_node["problems"] == [] and one_node["output_dir"]["filesystem"] == "ext4"
    assert one_node["accelerate_config"]["num_processes"] == 4 and one_node["accelerate_config"]["distributed_type"] == "MULTI_GPU"
    two_nodes = _config(tmp_path, num_machines=2, num_processes=8)
    local = doctor(output_dir=str(tmp_path / "out"), config_file=two_nodes, mounts_path=str(mounts))
    (problem,) = local["problems"]
    assert "not a shared filesystem" in problem and "2 machines" in problem and "--output_dir" in problem
    shared = doctor(output_dir=str(tmp_path / "nfs" / "run"), config_file=two_nodes, mounts_path=str(mounts))
    assert shared["problems"] == [] and shared["output_dir"]["shared"]
    honoured = doctor(output_dir=str(tmp_path / "out"), mounts_path=str(mounts),
                      config_file=_config(tmp_path, parallelism_config={"parallelism_config_tp_size": 2}))
    assert honoured["problems"] == []  # boost-hf's --tp_size 2
    refused = doctor(output_dir=str(tmp_path / "out"), mounts_path=str(mounts),
                     config_file=_config(tmp_path, parallelism_config={"parallelism_config_cp_size": 2}))
    assert any("cp_size=2" in p and "--sequence_parallel" in p for p in refused["problems"])
    fsdp2 = doctor(output_dir=str(tmp_path / "out"), mounts_path=str(mounts),
                   config_file=_config(tmp_path, distributed_type="FSDP", fsdp_config={"fsdp_version": 2},
                                       parallelism_config={"parallelism_config_dp_shard_size": 4}))
    assert fsdp2["problems"] == []  # boost-hf's --data_parallel fsdp2
    fsdp1 = doctor(output_dir=str(tmp_path / "out"), mounts_path=str(mounts),
                   config_file=_config(tmp_path, distributed_type="FSDP", fsdp_config={"fsdp_sharding_strategy": "FULL_SHARD"}))
    assert any("FSDP version 1" in p and "fsdp_version: 2" in p for p in fsdp1["problems"])


def test_cli_reports_this_machine(tmp_path, capsys):
    assert main(["doctor", "--output-dir", str(tmp_path), "--config-file", _config(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    import torch
    import transformers

    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["transformers"] == transformers.__version__
    assert report["gpus"] == [] and report["attention_kernels"]["math (sdpa)"] is True  # a CPU machine
    assert main(["doctor", "--output-dir", str(tmp_path), "--config-file", _config(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPUs: none" in out and "no problem found" in out
