"""The capacity model's arithmetic, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from experiments.capacity import build, gpu_split, propagation_s

COST = {"publish_s_per_gb": 2.0, "load_s_per_gb": 1.0}  # 3 s of CPU per GB, one rank


def test_propagation_by_transport_by_hand():
    # 1 GB to 4 agents over 1e8 B/s links, a 1e9 B/s shared filesystem
    # http: 3 + 4 x 10 = 43; broadcast: 3 + 10 = 13; directory: 3 + (1 + 4) x 1 = 8
    assert propagation_s("http", 1e9, 4, 1e8, 1e9, COST) == pytest.approx(43.0)
    assert propagation_s("broadcast", 1e9, 4, 1e8, 1e9, COST) == pytest.approx(13.0)
    assert propagation_s("directory", 1e9, 4, 1e8, 1e9, COST) == pytest.approx(8.0)
    # three ranks share the CPU path: 3 / 3 = 1 s, the wire unchanged
    assert propagation_s("http", 1e9, 4, 1e8, 1e9, COST, shards=3) == pytest.approx(41.0)


def test_gpu_split_by_hand():
    # a trained token: 6e9 x (1 + 1 critic) x 1.0 + 2e9 = 14e9 FLOPs; 100e12 x 0.5 / 14e9 = 3,571.43 tokens/s;
    # a generated one: 2e9 FLOPs, 100e12 x 0.1 / 2e9 = 5,000 tokens/s; 3,571.43 / 5,000 = 0.714 rollout GPUs
    a = {"value_params_fraction": 1.0, "gpu_peak_tflops": 100.0, "mfu_train": 0.5, "mfu_generate": 0.1}
    split = gpu_split(1e9, a, sao_over_bare=1.0)
    assert split["train_tokens_per_gpu_s"] == pytest.approx(3571.43, rel=1e-5)
    assert split["generate_tokens_per_gpu_s"] == pytest.approx(5000.0)
    assert split["rollout_gpus_per_learner_gpu"] == pytest.approx(0.714286, rel=1e-5)


def test_the_committed_model_reads_the_measured_inputs():
    result = build()
    assert [r["model"] for r in result["models"]] == ["7B", "70B", "750B-A40B"]
    assert result["models"][2]["bytes_per_version"] == 1.5e12  # 750e9 parameters in bf16
    assert set(result["measured"]["version_cpu_cost"]) == {"directory", "http", "broadcast"}
