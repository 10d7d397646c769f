"""The device checks (`load_tests.gpu_features`, `load_tests.gpu_serve`, `load_tests.calibrate_sim`) run
here up to their CUDA-only parts, so a session lent a GPU spends its minutes measuring, not debugging the script: on CPU the
features' every row equals its reference, and the Serve check's config is serve_config.gpu.yaml's
application with only the documented changes."""

from __future__ import annotations

import json
import sys

import torch
import yaml

from deployments.app import build_app, load_config
from load_tests import gpu_features
from load_tests.gpu_serve import ROOT, app_config


def test_features_on_cpu_match_their_references(tmp_path, monkeypatch):
    out = tmp_path / "features.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["gpu_features", "--device", "cpu", "--sections", "structured,async,compile_after_async", "--out", str(out)],
    )
    gpu_features.main()
    report = json.loads(out.read_text())
    assert not [k for k in report if k.endswith("_error")], report
    assert [r["forward_mode"] for r in report["structured"]] == ["eager", "inductor"]
    for row in report["structured"]:
        assert row["exact"] and row["rows"]["json"]["parses"], row
        assert all(r.get("finish", "stop") == "stop" for r in row["rows"].values()), row
    assert all(r["exact"] and r["streams"] == 12 for r in report["async"]), report["async"]
    assert report["compile_after_async"] == [{"forward_mode": "inductor"}]


def test_serve_check_deploys_the_gpu_config_with_only_the_documented_changes(tmp_path):
    shipped = yaml.safe_load((ROOT / "serve_config.gpu.yaml").read_text())["applications"][0]["args"]
    cfg = app_config(tmp_path / "model", {"a": str(tmp_path / "a")}, "cuda")
    changed = {
        section: {k: v for k, v in cfg[section].items() if shipped.get(section, {}).get(k) != v}
        for section in cfg
        if isinstance(cfg[section], dict)
    }
    assert changed == {
        "engine": {
            "model": str(tmp_path / "model"),
            "max_model_len": 1024,
            "kv_cache_memory_gib": 8.0,
            "lora": {"adapters": {"a": str(tmp_path / "a")}, "max_loras": 2},
        },
        "replica": {},
        "ingress": {"num_replicas": 1},
        "stream": {},
        "autoscaling": {"max_replicas": 1},
        "router": {},
    }
    assert load_config(cfg).engine.device == "cuda" and build_app(cfg) is not None
    assert app_config(tmp_path / "model", {}, "cpu")["replica"]["num_gpus"] == 0


def test_calibration_fits_the_last_sweep_of_a_random_model_and_sets_it_beside_a_preset(tmp_path):
    """`load_tests.calibrate_sim` as run on an H100 (random weights from a config, two sweeps, a preset
    compared), here on CPU with a 2-layer model of the 8B config's family."""
    from batcher.simulated import PRESETS
    from load_tests import calibrate_sim

    config = json.loads((ROOT / "load_tests/configs/llama-3.1-8b-like.json").read_text())
    config.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=49152,
    )
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    out = tmp_path / "calibrate.json"
    args = [
        "--config",
        str(tmp_path / "tiny.json"),
        "--dtype",
        "bfloat16",
        "--compile",
        "off",
        "--batches",
        "1,3",
        "--prompt-lens",
        "8,40",
        "--max-tokens",
        "3",
        "--max-num-batched-tokens",
        "32",
        "--num-kv-blocks",
        "256",
    ]
    one_sweep = calibrate_sim.main(args)
    report = calibrate_sim.main(args + ["--passes", "2", "--preset", "h100-llama3-8b", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["steps"] == one_sweep["steps"] >= 4 * 3  # the last sweep's steps only: 4 runs of 3 tokens or more
    step = report["step"]
    assert step["mean_relative_error"] < 1.0 and min(v for k, v in step.items() if k.endswith("_s")) >= 0
    compare = report["compare"]
    assert set(compare["models"]) == {"preset", "measured", "router learns"}
    assert compare["models"]["preset"] == vars(PRESETS["h100-llama3-8b"].step)
    for name, (prefill, decode, context) in calibrate_sim.PROBES.items():
        assert (
            compare["probes_ms"][name]["preset"]
            == PRESETS["h100-llama3-8b"].step.step_seconds(prefill, decode, context) * 1e3
        )
    assert all(v > 0 for row in compare["capacity_rps"].values() for k, v in row.items() if k == "preset")


def test_the_calibration_fit_never_gives_a_term_a_negative_cost():
    """Steps whose time falls as their context grows (what a few stalls of a busy machine looked like
    to the fit): unconstrained, the context term came out negative; the fit zeroes it and fits the
    rest, and no other non-negative model does better."""
    from load_tests import calibrate_sim

    rng = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(40):
        prefill, decode, context = [int(v) for v in torch.randint(0, 64, (3,), generator=rng)]
        seconds = 0.005 + 1e-4 * prefill + 5e-4 * decode - 2e-6 * context
        samples.append((prefill, decode, context, seconds, seconds))
    x, y = calibrate_sim.design(samples, 3)
    plain = torch.linalg.lstsq(x / y.unsqueeze(1), torch.ones_like(y).unsqueeze(1)).solution.squeeze(1)
    assert plain[3] < 0  # the case: what the fit did before
    coef, error = calibrate_sim.fit(samples)
    assert min(coef) >= 0 and coef[3] == 0 and coef[0] > 0 and error < 0.2

    def loss(c):
        return float((((x @ torch.tensor(c, dtype=x.dtype)) - y) / y).pow(2).sum())

    for _ in range(200):  # nudged anywhere in the non-negative orthant: never better
        nudged = [max(0.0, c + float(d) * (abs(c) + 1e-6)) for c, d in zip(coef, torch.randn(4, generator=rng) * 0.1)]
        assert loss(nudged) >= loss(coef) - 1e-12
