"""Version rollouts: the versioned render, the version checks, the traffic split, and the whole sequence (refusals,
stage, canary 10 / 50 / 100 %, rollback, promote) against a live tritonserver under a small load."""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import PATIENCE_S, served

from cosyvoice_triton.serving.launch.rollout import (
    VERSIONED,
    Rollout,
    RolloutError,
    RolloutRefused,
    Split,
    VersionSpec,
    check_version,
    pipeline_gone,
    pipeline_model,
    read_manifests,
    startup_models,
)
from cosyvoice_triton.serving.repository import MARKER, RenderError, render_repository
from cosyvoice_triton.serving.samples import stage_warmup_samples

# ---------------------------------------------------------------------------------------------------- split


@pytest.mark.parametrize("weights", [{1: 90, 2: 10}, {1: 50, 2: 50}, {1: 0, 2: 100}, {1: 1, 2: 2, 3: 7}])
def test_split_gives_each_version_its_share_in_every_window(weights):
    split = Split(weights)
    total = sum(weights.values())
    picks = [split.choose() for _ in range(3 * total)]
    for start in range(0, len(picks), total):
        window = picks[start:start + total]
        assert {v: window.count(v) for v in weights} == weights
    import random

    rng = random.Random(0)
    for _ in range(5):  # from any point of the cycle: any n consecutive picks within 1 of n * share
        split = Split(weights).start_anywhere(rng)
        for n in (7, 37):
            picks = [split.choose() for _ in range(n)]
            for v, w in weights.items():
                assert abs(picks.count(v) - n * w / total) < 1 + 1e-9, (n, v, picks)
    if weights == {1: 90, 2: 10}:  # interleaved: never more than 9 of v1 in a row... then one v2
        runs = [len(m.group(0)) for m in re.finditer(r"1+", "".join(map(str, picks)))]
        assert max(runs) <= 9


def test_split_parse_format_and_refusals():
    s = Split.parse("2:10, 1:90")
    assert s.format() == "1:90,2:10" and s.percent(2) == pytest.approx(10.0)
    for bad in ("1:0,2:0", "1=90", "x:1", "1:-3", ""):
        with pytest.raises(ValueError):
            Split.parse(bad)


def test_router_resends_only_what_never_ran():
    model = "cosyvoice_vc_v2"
    assert pipeline_gone("requested model 'cosyvoice_vc_v2' is not available", model)
    assert pipeline_gone("Request for unknown model: 'cosyvoice_vc_v2' is not found", model)
    # the pipeline ran and failed inside: not resent (it could have had effects, and it would fail again)
    assert not pipeline_gone("in ensemble 'cosyvoice_vc_v2', internal error: BlsError: flow_encoder: Model "
                             "'flow_encoder' is not ready", model)
    assert not pipeline_gone("preprocess: source_audio is silent", model)


class _FakeTriton:
    """Just the calls ``Rollout._drop`` makes: the dropped pipeline reads as unloaded at once, while ``flow`` of
    the dropped version still runs one BLS request whose graph calls go on for ``busy_reads`` statistics reads."""

    def __init__(self, version: int, busy_reads: int):
        self.version, self.busy_reads, self.reads = version, busy_reads, 0
        self.lost: list[str] = []  # models whose dropped version was unloaded while its work was still running

    def unload_model(self, model, headers=None):
        pass

    def get_model_repository_index(self, headers=None):
        return [{"name": pipeline_model(self.version), "version": "", "state": "UNAVAILABLE"}]

    def get_inference_statistics(self, model, model_version="", headers=None):
        self.reads += 1
        n = min(self.reads, self.busy_reads)  # flow_estimator counts every denoising step; the rest stays still
        count = n if model == "flow_estimator" and model_version == str(self.version) else 7
        return {"model_stats": [{"name": model, "version": model_version, "inference_count": count,
                                 "execution_count": count, "inference_stats": {"success": {"count": count},
                                                                                "fail": {"count": 0}}}]}

    def is_model_ready(self, model, headers=None):
        return True

    def load_model(self, model, headers=None, config=None):
        if self.reads < self.busy_reads:
            self.lost.append(model)


def _fake_rollout(tmp_path, client, **kw):
    for m in VERSIONED:
        (tmp_path / m).mkdir()
        policy = "version_policy { specific { versions: [ 1, 2 ] } }"
        (tmp_path / m / "config.pbtxt").write_text(f'name: "{m}"\n{policy}\n')
    ro = object.__new__(Rollout)
    ro.client, ro.repository, ro.headers, ro.drain_timeout = client, tmp_path, {}, 30.0
    ro.manifests = {1: {"version": 1}, 2: {"version": 2}}  # CosyVoice2 versions (no family recorded)
    for k, v in {"drain_settle": 0.3, **kw}.items():
        setattr(ro, k, v)
    return ro


def test_drop_waits_for_the_stages_in_flight_work(tmp_path):
    client = _FakeTriton(version=1, busy_reads=6)
    ro = _fake_rollout(tmp_path, client)
    ro._drop(1, keep=2)
    assert client.lost == [] and client.reads >= client.busy_reads
    for m in VERSIONED:
        assert "versions: [ 2 ]" in (tmp_path / m / "config.pbtxt").read_text()


def test_drop_gives_up_with_the_versions_kept_while_work_still_runs(tmp_path):
    client = _FakeTriton(version=1, busy_reads=10**9)
    ro = _fake_rollout(tmp_path, client, drain_timeout=1.0)
    with pytest.raises(RolloutError, match="version 1's stages still run requests"):
        ro._drop(1, keep=2)
    assert client.lost == []
    assert "versions: [ 1, 2 ]" in (tmp_path / "flow" / "config.pbtxt").read_text()


# ---------------------------------------------------------------------------------------------------- assets


@pytest.fixture(scope="module")
def versions_assets(serving_assets, tmp_path_factory):
    """v1 / v2: the tiny demo model and its export (v2 rendered again from the same files: a drop-in); v3: another
    checkpoint (seed 1) with its own, consistent export (passes the static checks, fails parity); v4: v3's export
    beside a model folder whose flow.pt was replaced afterwards (export out of date)."""
    from cosyvoice_triton.export.onnx_export import export_onnx
    from cosyvoice_triton.models.demo import write_demo_model

    root = tmp_path_factory.mktemp("rollout")
    other = write_demo_model(root / "other", size="tiny", seed=1)
    export_onnx(other, root / "other_onnx" / "fp32", verify=False)
    stale = root / "stale"
    shutil.copytree(other, stale)
    shutil.copy(serving_assets["model_dir"] / "flow.pt", stale / "flow.pt")  # after the export: out of date
    good = (serving_assets["model_dir"], serving_assets["onnx_dir"])
    return {"root": root, "specs": [VersionSpec(1, *good), VersionSpec(2, *good),
                                    VersionSpec(3, Path(other), root / "other_onnx"),
                                    VersionSpec(4, stale, root / "other_onnx")]}


@pytest.fixture(scope="module")
def versioned_repo(versions_assets):
    repo = versions_assets["root"] / "model_repository"
    render_repository("local", repo, model_dir="unused", versions=versions_assets["specs"], max_queue_delay_us=20000,
                      instances={"cosyvoice_vc": 2})
    return repo


# ---------------------------------------------------------------------------------------------------- render


def test_render_writes_numbered_versions_pinned_pipelines_and_the_router(versioned_repo, versions_assets):
    repo = versioned_repo
    for model in VERSIONED:
        assert sorted(p.name for p in (repo / model).iterdir() if p.is_dir() and p.name.isdigit()) == \
            ["1", "2", "3", "4"], model
        text = (repo / model / "config.pbtxt").read_text()
        assert "version_policy { specific { versions: [ 1 ] } }" in text  # only the live version on disk
    for graph in ("flow_encoder", "hift_decoder"):
        params = (repo / graph / "config.pbtxt").read_text()
        assert 'key: "onnx_path" value: { string_value: "model.onnx" }' in params  # read from the version's folder
        v1, v3 = (repo / graph / n / "model.onnx" for n in ("1", "3"))
        assert v1.read_bytes() == (versions_assets["specs"][0].onnx_dir / "fp32" / f"{graph}.onnx").read_bytes()
        assert v3.read_bytes() != v1.read_bytes()
    for stage in ("flow", "hift"):
        assert 'key: "pin_graph_version" value: { string_value: "true" }' in (repo / stage / "config.pbtxt").read_text()
    for v in (1, 2, 3, 4):
        ens = (repo / pipeline_model(v) / "config.pbtxt").read_text()
        pins = dict(re.findall(r'model_name: "(\w+)"\s*model_version: (-?\d+)', ens))
        assert pins == {"preprocess": "-1", "speech_tokenizer": str(v), "speaker_encoder": str(v), "flow": str(v),
                        "hift": str(v), "postprocess": "-1"}
    router = (repo / "cosyvoice_vc" / "config.pbtxt").read_text()
    assert 'backend: "python"' in router and 'key: "split" value: { string_value: "1:100" }' in router
    for absent in ("cosyvoice_vc_stream", "speakers", "cosyvoice_tts"):  # they would call the newest version
        assert not (repo / absent).exists()
    marker = json.loads((repo / MARKER).read_text())
    assert marker["live_version"] == 1 and marker["versions"]["3"] == "cosyvoice_vc_v3"
    assert startup_models(repo)[-2:] == ["cosyvoice_vc_v1", "cosyvoice_vc"]


def test_manifest_records_checkpoint_export_and_precision(versioned_repo, versions_assets):
    from cosyvoice_triton.hashing import file_sha256

    manifests = read_manifests(versioned_repo)
    assert sorted(manifests) == [1, 2, 3, 4]
    m1, m3 = manifests[1], manifests[3]
    model_dir = versions_assets["specs"][0].model_dir
    assert m1["checkpoint"]["flow.pt"] == file_sha256(model_dir / "flow.pt")
    assert m1["checkpoint"]["flow.pt"] != m3["checkpoint"]["flow.pt"]
    g = m1["graphs"]["flow_estimator"]
    assert g["precision"] == "fp32" and g["source_file"] == "flow.pt"
    assert g["sha256"] == g["export_sha256"] == file_sha256(versioned_repo / "flow_estimator" / "1" / "model.onnx")
    assert m1["settings"]["sample_rate"] == 24000


def test_check_version_finds_each_problem(versioned_repo, versions_assets, tmp_path):
    manifests = read_manifests(versioned_repo)
    assert check_version(manifests[2], manifests[1]) == []
    assert check_version(manifests[3], manifests[1]) == []  # another checkpoint, consistent: parity decides
    stale = check_version(manifests[4], manifests[1])
    assert any(p.startswith("export out of date: flow_encoder was exported from flow.pt") for p in stale), stale
    assert not any(p.startswith("export out of date: hift") for p in stale)  # hift.pt is the one it came from
    # the model folder changes after the render: wrong checkpoint
    moved = dict(manifests[3], model_dir=str(tmp_path / "m"))
    shutil.copytree(manifests[3]["model_dir"], tmp_path / "m")
    (tmp_path / "m" / "hift.pt").write_bytes(b"not the checkpoint")
    wrong = check_version(moved, manifests[1])
    assert any(p.startswith("wrong checkpoint:") and "hift.pt" in p for p in wrong), wrong
    # another model's settings
    other = dict(manifests[2], settings={**manifests[2]["settings"], "sample_rate": 22050})
    assert any("other settings" in p and "sample_rate" in p for p in check_version(other, manifests[1]))


def test_render_refuses_bad_version_lists(versions_assets, tmp_path):
    spec = versions_assets["specs"][0]
    with pytest.raises(RenderError, match="given twice"):
        render_repository("local", tmp_path / "r", model_dir="x", versions=[spec, spec])
    with pytest.raises(RenderError, match="live_version 7"):
        render_repository("local", tmp_path / "r", model_dir="x", versions=[spec], live_version=7)
    with pytest.raises(RenderError, match="runtime=torch"):
        render_repository("local", tmp_path / "r", model_dir="x", versions=[spec], runtime="torch")
    with pytest.raises(ValueError):
        VersionSpec.parse("two:dir")


# ---------------------------------------------------------------------------------------------------- live


class Load:
    """``users`` threads converting a short fixed input back to back through the router (no client retries), each
    result recorded with its time."""

    def __init__(self, url: str, users: int = 2):
        from cosyvoice_triton.clients.client import VCClient
        from cosyvoice_triton.clients.retry import NO_RETRY

        s = stage_warmup_samples("preprocess", 1.0)
        self.item = (s["source_audio"], s["prompt_audio"])
        self.ok: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.clients = [VCClient(url, retry=NO_RETRY, timeout=PATIENCE_S) for _ in range(users)]
        self.threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in self.clients]

    def run(self, client) -> None:
        while not self.stop.is_set():
            try:
                client.convert(*self.item, source_sr=16000, prompt_sr=16000, seed=0)
                self.ok.append(time.monotonic())
            except Exception as exc:  # counted: the test asserts there are none
                self.failures.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=PATIENCE_S + 30)
        for c in self.clients:
            c.close()

    def wait(self, n: int, timeout: float = 2 * PATIENCE_S) -> None:
        target, deadline = len(self.ok) + n, time.monotonic() + timeout
        while len(self.ok) < target:
            assert time.monotonic() < deadline, f"load: {len(self.ok)} of {target} requests in {timeout} s"
            assert not self.failures, self.failures
            time.sleep(0.2)


def _phase(ro: Rollout, load: Load, n: int) -> dict[int, int]:
    """Requests per version's pipeline while ``n`` more requests complete (no reload in between)."""
    before = {v: ro.counts(v)[0] for v in (1, 2)}
    load.wait(n)
    after = {v: ro.counts(v)[0] for v in (1, 2)}
    return {v: after[v] - before[v] for v in (1, 2)}


def _assert_share(counts: dict[int, int], percent: int) -> None:
    """Smooth weighted round robin in each of the router's 2 instances (rendered so here): an instance's v2 picks
    are within 1 of its picks * p, so over n requests v2 gets n * p within 2, plus 2 for the requests of the 2 users
    that crossed the window's edges."""
    n = counts[1] + counts[2]
    assert abs(counts[2] - n * percent / 100) <= 4, (counts, percent)
    assert counts[2] >= 1, counts  # 20 requests at 10%: one instance has >= 10 of them, so one v2 pick


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two stages load 8 models each; with the exports of the fixtures on a loaded 2-core machine
def test_rollout_sequence_under_load(versioned_repo):
    repo = versioned_repo
    with served(repo, model_control="explicit", load_models=startup_models(repo)) as server, \
            Rollout(server.http_url, repo, admin_key=server.admin_key) as ro:
        st = ro.status()
        assert (st.live, st.candidate, st.split) == (1, 0, {1: 100.0})
        assert st.loaded["flow_encoder"] == [1]
        figures = {}
        with Load(server.http_url) as load:
            load.wait(3)
            # refused before any traffic: out of date (static checks: nothing loaded) and parity (loaded, compared,
            # unloaded again)
            with pytest.raises(RolloutRefused, match="export out of date"):
                ro.stage(4)
            assert ro.status().loaded["flow_encoder"] == [1]
            with pytest.raises(RolloutRefused, match=r"parity: v3's output is .* dB") as refused:
                ro.stage(3)
            st = ro.status()
            assert not st.ready[3] and st.loaded["flow"] == [1] and st.candidate == 0 and st.split == {1: 100.0}
            with pytest.raises(RolloutError, match="nothing staged"):
                ro.canary(10)

            parity = ro.stage(2)
            assert parity["passed"] and parity["db"] < 1e-3  # the same checkpoint and export
            st = ro.status()
            assert st.candidate == 2 and st.loaded["flow_encoder"] == [1, 2] and st.split == {1: 100.0, 2: 0.0}
            figures["staged"] = _phase(ro, load, 4)
            assert figures["staged"][2] == 0
            for pct, n in ((10, 20), (50, 12), (100, 6)):
                ro.canary(pct)
                assert ro.status().split[2] == pct
                figures[pct] = _phase(ro, load, n)
                _assert_share(figures[pct], pct)
            assert figures[100][1] <= 2  # only requests already on their way to v1 when the split changed
            ro.rollback()
            st = ro.status()
            assert (st.live, st.candidate, st.ready[2], st.loaded["hift"]) == (1, 0, False, [1])
            figures["rolled back"] = _phase(ro, load, 6)
            # the rollback reloaded v1's pipeline: the <= 2 requests in flight then are counted by the replaced one
            assert figures["rolled back"][2] == 0 and figures["rolled back"][1] >= 4, figures

            ro.stage(2)
            assert ro.promote() == 2
            st = ro.status()
            assert (st.live, st.candidate, st.split, st.ready[1]) == (2, 0, {2: 100.0}, False)
            assert st.loaded["flow_estimator"] == [2] and st.loaded["speech_tokenizer"] == [2]
            figures["promoted"] = _phase(ro, load, 6)  # the promote reloaded v2's pipeline: as after the rollback
            assert figures["promoted"][1] == 0 and figures["promoted"][2] >= 4, figures
        assert load.failures == [], load.failures
        print(f"\nrollout under load: {len(load.ok)} requests, 0 failed; per phase (v1, v2): "
              + ", ".join(f"{k}: {v[1]}/{v[2]}" for k, v in figures.items()) + f"; refused v3: {refused.value}")
        assert "version 2 refused" not in server.log_text()
