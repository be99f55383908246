"""Rollouts across families: a CosyVoice3 version beside a CosyVoice2 one in a versioned render (its pipeline is
``cosyvoice3_vc`` on its folder), and the whole sequence against a live tritonserver under load with no client
retries: stage the CosyVoice3 version (smoke test instead of parity), canary 50 %, promote (the CosyVoice2 graphs and
stages unloaded), then back: stage the CosyVoice2 version again (its graphs and stages loaded), promote. No request
fails; the load's ``seed`` never reaches the CosyVoice3 pipeline (which would refuse it)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import served
from test_rollout import Load, _phase

from cosyvoice_triton.serving.launch.rollout import (
    VERSIONED,
    Rollout,
    VersionSpec,
    check_version,
    pipeline_model,
    read_manifests,
    startup_models,
)
from cosyvoice_triton.serving.repository import RenderError, render_repository


@pytest.fixture(scope="module")
def specs(serving_assets, cv3_demo_dir):
    return [VersionSpec(1, serving_assets["model_dir"], serving_assets["onnx_dir"]),
            VersionSpec(2, Path(cv3_demo_dir), serving_assets["onnx_dir"])]


@pytest.fixture(scope="module")
def repo(specs, tmp_path_factory):
    out = tmp_path_factory.mktemp("rollout3") / "model_repository"
    report = render_repository("local", out, model_dir="unused", versions=specs, max_queue_delay_us=20000,
                               instances={"cosyvoice_vc": 2})
    assert report.models[pipeline_model(2)].startswith("python (cosyvoice3_vc on ")
    return out


def test_a_cosyvoice3_version_is_its_folder_in_process(repo, cv3_demo_dir):
    text = (repo / pipeline_model(2) / "config.pbtxt").read_text()
    found = re.search(r'key: "model_dir"\s*value: \{\s*string_value: "([^"]*)"', text)
    assert found and Path(found.group(1)) == Path(cv3_demo_dir).resolve()
    assert 'name: "seed"' not in text and 'backend: "python"' in text
    assert (repo / pipeline_model(2) / "1" / "model.py").read_text() == (
        Path(__file__).parents[2] / "ensemble" / "cosyvoice3_vc" / "model.py").read_text()
    manifests = read_manifests(repo)
    assert (manifests[1]["family"], manifests[2]["family"]) == ("cosyvoice2", "cosyvoice3")
    assert set(manifests[2]["checkpoint"]) == {"cosyvoice3.yaml", "flow.pt", "hift.pt", "speech_tokenizer_v3.onnx",
                                               "campplus.onnx"}
    assert manifests[2]["graphs"] == {}
    for model in VERSIONED:  # only the CosyVoice2 version has graph and stage folders
        assert sorted(p.name for p in (repo / model).iterdir() if p.name.isdigit()) == ["1"], model
    router = (repo / "cosyvoice_vc" / "config.pbtxt").read_text()
    assert re.search(r'key: "seedless_versions"\s*value: \{\s*string_value: "2"', router)
    # another family's settings are not a problem; its checkpoint digests are
    assert check_version(manifests[2], manifests[1]) == []


def test_checkpoint_changes_of_a_cosyvoice3_version_are_found(specs, cv3_demo_dir, tmp_path):
    folder = tmp_path / "cv3"
    shutil.copytree(cv3_demo_dir, folder)
    out = tmp_path / "repo"
    render_repository("local", out, model_dir="unused", versions=[specs[0], VersionSpec(2, folder, Path("unused"))])
    (folder / "hift.pt").write_bytes(b"not the checkpoint")
    manifests = read_manifests(out)
    assert any("wrong checkpoint" in p and "hift.pt" in p for p in check_version(manifests[2], manifests[1]))


def _rollout(answers):
    """A :class:`Rollout` without a server whose two versions (v1 CosyVoice2, v2 CosyVoice3) answer ``answers``."""
    ro = object.__new__(Rollout)
    ro.manifests = {1: {"version": 1, "family": "cosyvoice2"}, 2: {"version": 2, "family": "cosyvoice3"}}
    ro._answers = lambda version, live, seed: answers
    return ro


def test_the_smoke_test_refuses_what_a_conversion_cannot_be():
    live = np.zeros(48000, np.float32)
    ok = np.full(48000 + 1200, 0.5, np.float32)  # 2.5 % longer
    assert _rollout((ok, live)).smoke(2, 1)["passed"]
    for bad, why in ((np.zeros(48000 + 4800, np.float32), r"10.0% apart; the bar is 5%"),
                     (np.full(48000, np.nan, np.float32), "not finite"),
                     (np.full(48000, 1.5, np.float32), "peak 1.5"),
                     (np.zeros(0, np.float32), "gave 0 samples")):
        result = _rollout((bad, live)).smoke(2, 1)
        assert not result["passed"] and re.search(why, result["problem"]), (why, result)


def test_the_render_refuses_a_cosyvoice3_live_version_and_audio_bytes(specs, tmp_path):
    with pytest.raises(RenderError, match="live_version 2 is a cosyvoice3 version"):
        render_repository("local", tmp_path / "a", model_dir="unused", versions=specs, live_version=2)
    with pytest.raises(RenderError, match="CosyVoice3 version answers no audio_bytes"):
        render_repository("local", tmp_path / "b", model_dir="unused", versions=specs, output_format="wav")


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two CosyVoice2 stages load 8 models each on a loaded 2-core machine
def test_rollout_to_cosyvoice3_and_back_under_load(repo):
    with served(repo, model_control="explicit", load_models=startup_models(repo)) as server, \
            Rollout(server.http_url, repo, admin_key=server.admin_key) as ro:
        figures = {}
        with Load(server.http_url) as load:  # seed=0 on every request
            load.wait(3)
            smoke = ro.stage(2)
            assert smoke["check"] == "smoke" and smoke["passed"] and smoke["duration_diff"] <= 0.05, smoke
            st = ro.status()
            assert (st.candidate, st.ready[2], st.loaded["flow"]) == (2, True, [1])  # v1's stages only
            figures["staged"] = _phase(ro, load, 4)
            assert figures["staged"][2] == 0
            ro.canary(50)
            figures[50] = _phase(ro, load, 12)
            assert figures[50][1] >= 3 and figures[50][2] >= 3, figures
            assert ro.promote() == 2
            st = ro.status()
            assert (st.live, st.candidate, st.split, st.ready[1]) == (2, 0, {2: 100.0}, False)
            assert not any(st.loaded.get(m) for m in VERSIONED), st.loaded  # no CosyVoice2 version is left
            figures["promoted to CosyVoice3"] = _phase(ro, load, 6)
            assert figures["promoted to CosyVoice3"][1] == 0, figures

            smoke = ro.stage(1)  # back to CosyVoice2: its graphs and stages loaded again
            assert smoke["check"] == "smoke" and smoke["passed"], smoke
            assert ro.status().loaded["flow_estimator"] == [1]
            assert ro.promote() == 1
            st = ro.status()
            assert (st.live, st.ready[2], st.loaded["hift"]) == (1, False, [1])
            figures["back to CosyVoice2"] = _phase(ro, load, 6)
            assert figures["back to CosyVoice2"][2] == 0, figures
        assert load.failures == [], load.failures
        print(f"\nrollout across families under load: {len(load.ok)} requests, 0 failed; per phase (v1, v2): "
              + ", ".join(f"{k}: {v[1]}/{v[2]}" for k, v in figures.items()))
        assert "seed: CosyVoice3" not in server.log_text()
