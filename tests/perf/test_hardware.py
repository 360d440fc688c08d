"""GPU presets and the interconnect model."""

from __future__ import annotations

import pytest

from boost_hf.perf.hardware import HARDWARE_PRESETS, get_hardware


def test_presets():
    assert {"a100", "h100", "h200"} <= set(HARDWARE_PRESETS)
    assert get_hardware("A100").peak_tflops == 312
    assert get_hardware("h100").peak_tflops == get_hardware("h200").peak_tflops == 989
    assert get_hardware("h200").hbm_gbps > get_hardware("h100").hbm_gbps
    assert get_hardware("h100").peak_flops == 989e12


def test_overrides():
    hw = get_hardware("a100", peak_tflops=100.0, link_gbps=None, latency_us=5.0)
    assert (hw.peak_tflops, hw.link_gbps, hw.latency_us) == (100.0, 230.0, 5.0)
    with pytest.raises(ValueError, match="Unknown GPU"):
        get_hardware("v100")
    with pytest.raises(ValueError, match="link_gbps must be > 0"):
        get_hardware("a100", link_gbps=0.0)


def test_collective_bandwidth_by_topology():
    mesh = get_hardware("a100")  # 4 fully connected GPUs per node
    assert not mesh.nvswitch and mesh.gpus_per_node == 4
    assert mesh.collective_gbps(4) == mesh.link_gbps
    assert mesh.collective_gbps(2) == pytest.approx(mesh.link_gbps / 3)
    assert mesh.collective_gbps(8) == mesh.inter_node_gbps
    assert mesh.point_to_point_gbps(same_node=False) == mesh.inter_node_gbps
    switched = get_hardware("a100-nvswitch")
    assert switched.collective_gbps(2) == switched.collective_gbps(8) == switched.link_gbps
    assert switched.point_to_point_gbps(same_node=True) == switched.link_gbps
