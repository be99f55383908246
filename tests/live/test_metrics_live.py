"""Speech metrics, dashboard and alerts against a live ``tritonserver`` (local flavor, tiny demo model).

* The custom metrics (``cosyvoice_*``) on the metrics port follow the requests sent: audio seconds in equal the
  sources and prompts sent, audio seconds out the audio returned, one real-time factor / first-chunk observation
  per request where they apply (and within the client's own timing), a reject per refused request under its
  reason; every series labelled with its model and version, next to Triton's own ``nv_*``.
* Every metric that a dashboard query (``deploy/grafana/dashboard.py``) or a rule (``deploy/prometheus/rules.yml``)
  names, parsed with a PromQL parser, is one the live server exposes (or a rule records).
* A real Prometheus (Debian's package, unpacked under build/tools by ``deploy/prometheus/fetch-prometheus.sh``)
  scrapes the server with the committed config and rules, and a custom metric comes back through its HTTP API
  with the value the server shows; every rule evaluates without error.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import ROOT, speech_pair, stop_process, wait_until

from cosyvoice_triton.loadtest.metrics import counter_total, parse_prometheus
from cosyvoice_triton.serving.stages import metrics as m

PROM_DIR = ROOT / "deploy" / "prometheus"
RULES = PROM_DIR / "rules.yml"
TOOLS = ROOT / "build" / "tools" / "prometheus"
#: Series Prometheus makes itself for every target (not exposed by the server).
PROMETHEUS_OWN = {"up"}
TEXT = "Hello there, this is a test."


def load_dashboard_module():
    spec = importlib.util.spec_from_file_location("cosyvoice_dashboard", ROOT / "deploy" / "grafana" / "dashboard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fetch_prometheus() -> Path:
    """build/tools/prometheus/usr/bin (prometheus, promtool), fetched once; skips where it cannot be had."""
    try:
        out = subprocess.run(["sh", str(PROM_DIR / "fetch-prometheus.sh"), str(TOOLS)], capture_output=True,
                             text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot fetch Debian's prometheus package: {exc}")
    if out.returncode != 0:
        pytest.skip("cannot fetch Debian's prometheus package (apt-get download prometheus + dpkg -x, "
                    f"deploy/prometheus/fetch-prometheus.sh): {out.stderr.strip()[-500:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def scrape(server) -> list:
    with urllib.request.urlopen(server.metrics_url, timeout=30) as r:
        return parse_prometheus(r.read().decode())


def value(samples, name: str, **labels) -> float:
    return counter_total(samples, name, **labels)


def delta(before, after, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


# -------------------------------------------------------------------------------------- PromQL names


def promql_names(expr: str) -> set[str]:
    """The metric names an expression selects (Grafana's interval variables replaced by a duration first)."""
    import promql_parser

    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr!r}"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL of the dashboard JSON: panel targets, and the metric of ``label_values(metric, label)``
    variables (Grafana's own function, not PromQL)."""
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if t.get("expr")]
    for v in dashboard["templating"]["list"]:
        if v.get("type") == "query":
            q = v["query"] if isinstance(v["query"], str) else v["query"]["query"]
            mm = re.fullmatch(r"label_values\((\w+),\s*\w+\)", q)
            assert mm, f"variable {v['name']}: unexpected query {q!r}"
            exprs.append(mm.group(1))
    return exprs


def rule_exprs() -> tuple[list[str], set[str]]:
    """(every rule expression, the names the recording rules record)."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    return [r["expr"] for r in rules], {r["record"] for r in rules if "record" in r}


def test_promql_names_parser():
    assert promql_names('sum by (model) (rate(a_total{model=~"$model"}[$__rate_interval])) / on() b') == {"a_total",
                                                                                                        "b"}
    assert promql_names("histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m])))") == {"x_bucket"}


# ------------------------------------------------------------------------------------------ live


@pytest.fixture(scope="module")
def traffic(triton_server):
    """VC and TTS requests over both protocols, two refused ones; the metrics before and after, and what the
    client saw."""
    from cosyvoice_triton.clients.client import StreamStats, VCClient, VCError

    src, ssr, prm, psr = speech_pair(2.0, 1.5)
    seen: dict = {"source_s": src.size / ssr, "prompt_s": prm.size / psr}
    before = scrape(triton_server)
    with VCClient(triton_server.http_url, protocol="http", timeout=300) as http:
        t0 = time.perf_counter()
        vc = http.convert(src, prm, source_sr=ssr, prompt_sr=psr, seed=1)
        seen["vc_s"], seen["vc_wall"] = vc.seconds, time.perf_counter() - t0
        t0 = time.perf_counter()
        tts = http.tts(TEXT, prompt=prm, prompt_sr=psr, seed=1)
        seen["tts_s"], seen["tts_wall"] = tts.seconds, time.perf_counter() - t0
        with pytest.raises(VCError):  # 10 ms of source: preprocess refuses it (bad_audio)
            http.convert(src[: ssr // 100], prm, source_sr=ssr, prompt_sr=psr)
    with VCClient(triton_server.grpc_url, protocol="grpc", timeout=300) as grpc:
        stats, t0 = StreamStats(), time.perf_counter()
        chunks = list(grpc.convert_stream(src, prm, source_sr=ssr, prompt_sr=psr, seed=1, stats=stats))
        seen["vc_stream_s"] = sum(c.waveform.size / c.sample_rate for c in chunks)
        seen["vc_stream"], seen["vc_stream_wall"] = stats, time.perf_counter() - t0  # to the final response
        stats, t0 = StreamStats(), time.perf_counter()
        chunks = list(grpc.tts_stream(TEXT, prompt=prm, prompt_sr=psr, seed=1, stats=stats))
        seen["tts_stream_s"] = sum(c.waveform.size / c.sample_rate for c in chunks)
        seen["tts_stream"], seen["tts_stream_wall"] = stats, time.perf_counter() - t0
        with pytest.raises(VCError):  # whitespace only: the text front end refuses it (bad_text)
            list(grpc.tts_stream("   ", prompt=prm, prompt_sr=psr))
    after = scrape(triton_server)
    (ROOT / "build").mkdir(exist_ok=True)
    with urllib.request.urlopen(triton_server.metrics_url, timeout=30) as r:
        (ROOT / "build" / "metrics_live.txt").write_bytes(r.read())  # for a look at what the server shows
    return before, after, seen


def test_every_custom_series_is_labelled_with_model_and_version(traffic):
    _, after, _ = traffic
    ours = [s for s in after if s.name.startswith("cosyvoice_") and not s.name.startswith("cosyvoice_llm")]
    assert ours, "no cosyvoice_* metrics on the metrics port"
    for s in ours:
        assert s.labels.get("model") and s.labels.get("version") == "1", s
    models = {s.labels["model"] for s in ours}
    assert {"preprocess", "postprocess", "speakers", "cosyvoice_vc_stream", "cosyvoice_tts_stream",
            "cosyvoice_tts"} <= models
    names = {s.name for s in after}
    for f in m.FAMILIES:
        wanted = {f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count"} if f.kind == "histogram" else {f.name}
        assert wanted <= names, f"{f.name}: missing {wanted - names}"
    for n in ("nv_inference_request_success", "nv_inference_queue_duration_us",
              "nv_inference_compute_infer_duration_us"):
        assert value(after, n, model="cosyvoice_vc", version="1") > 0, n


def test_audio_seconds_follow_the_requests(traffic):
    before, after, seen = traffic
    d = lambda name, **labels: delta(before, after, name, **labels)
    audio_in, audio_out = m.AUDIO_IN.name, m.AUDIO_OUT.name
    # cosyvoice_vc: in at preprocess (the refused request is not counted), out at postprocess
    assert d(audio_in, model="preprocess", input="source") == pytest.approx(seen["source_s"], rel=1e-6)
    assert d(audio_in, model="preprocess", input="prompt") == pytest.approx(seen["prompt_s"], rel=1e-6)
    assert d(audio_out, model="postprocess") == pytest.approx(seen["vc_s"], rel=1e-4)
    # cosyvoice_vc_stream
    assert d(audio_in, model="cosyvoice_vc_stream", input="source") == pytest.approx(seen["source_s"], rel=1e-6)
    assert d(audio_in, model="cosyvoice_vc_stream", input="prompt") == pytest.approx(seen["prompt_s"], rel=1e-6)
    assert d(audio_out, model="cosyvoice_vc_stream") == pytest.approx(seen["vc_stream_s"], rel=1e-4)
    # cosyvoice_tts, served by cosyvoice_tts_stream: counted under both; the bad request under the stream only
    assert d(audio_out, model="cosyvoice_tts") == pytest.approx(seen["tts_s"], rel=1e-4)
    assert d(audio_out, model="cosyvoice_tts_stream") == pytest.approx(seen["tts_s"] + seen["tts_stream_s"], rel=1e-4)
    assert d(audio_in, model="cosyvoice_tts", input="prompt") == pytest.approx(seen["prompt_s"], rel=1e-6)
    assert d(audio_in, model="cosyvoice_tts_stream", input="prompt") == pytest.approx(2 * seen["prompt_s"], rel=1e-6)
    assert min(seen["vc_s"], seen["vc_stream_s"], seen["tts_s"], seen["tts_stream_s"]) > 0


def test_real_time_factor_and_first_chunk_follow_the_requests(traffic):
    before, after, seen = traffic
    d = lambda name, **labels: delta(before, after, name, **labels)
    rtf, first = m.RTF.name, m.FIRST_CHUNK.name
    assert d(f"{rtf}_count", model="cosyvoice_vc_stream") == 1
    assert d(f"{rtf}_count", model="cosyvoice_tts") == 1
    assert d(f"{rtf}_count", model="cosyvoice_tts_stream") == 2  # via cosyvoice_tts, and streamed
    assert d(f"{first}_count", model="cosyvoice_vc_stream") == 1
    assert d(f"{first}_count", model="cosyvoice_tts_stream") == 1  # cosyvoice_tts asks for segments, not chunks
    # a stage does not know a request's wall time: no empty series either
    assert not [s for s in after if s.name.startswith(rtf) and s.labels["model"] == "postprocess"]
    # the server's time is within what the client waited: real-time factor <= client wall / audio seconds
    vc_stats, tts_stats = seen["vc_stream"], seen["tts_stream"]
    assert 0 < d(f"{rtf}_sum", model="cosyvoice_vc_stream") <= seen["vc_stream_wall"] / seen["vc_stream_s"]
    assert 0 < d(f"{rtf}_sum", model="cosyvoice_tts") <= seen["tts_wall"] / seen["tts_s"]
    assert 0 < d(f"{first}_sum", model="cosyvoice_vc_stream") <= vc_stats.first_chunk_s
    assert 0 < d(f"{first}_sum", model="cosyvoice_tts_stream") <= tts_stats.first_chunk_s
    # histogram buckets: cumulative, +Inf equals the count
    for model in ("cosyvoice_vc_stream", "cosyvoice_tts_stream"):
        buckets = sorted((float(s.labels["le"]), s.value) for s in after
                         if s.name == f"{rtf}_bucket" and s.labels["model"] == model)
        assert [b[0] for b in buckets][:-1] == list(m.RTF.buckets) and buckets[-1][0] == float("inf")
        assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))
        assert buckets[-1][1] == value(after, f"{rtf}_count", model=model)


def test_rejects_by_reason(traffic):
    before, after, _ = traffic
    rejects = {(s.labels["model"], s.labels["reason"]): s.value for s in after if s.name == m.REJECTS.name}
    old = {(s.labels["model"], s.labels["reason"]): s.value for s in before if s.name == m.REJECTS.name}
    assert {r for _, r in rejects} == set(m.REASONS)
    grew = {k: v - old.get(k, 0.0) for k, v in rejects.items() if v - old.get(k, 0.0)}
    assert grew == {("preprocess", "bad_audio"): 1.0, ("cosyvoice_tts_stream", "bad_text"): 1.0}


def test_dashboard_and_rules_name_only_metrics_the_server_exposes(traffic):
    _, after, _ = traffic
    exposed = {s.name for s in after}
    exprs, recorded = rule_exprs()
    dashboard = json.loads(load_dashboard_module().render())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 15 and len(exprs) >= 10
    known = exposed | recorded | PROMETHEUS_OWN
    used: set[str] = set()
    for expr in [*queries, *exprs]:
        names = promql_names(expr)
        assert names, expr
        assert names <= known, f"{expr!r} names {names - known}, which the live server does not expose"
        used |= names
    # and every speech family is on the dashboard
    for f in m.FAMILIES:
        assert any(n.startswith(f.name) for n in used), f"{f.name} is on no panel"
    assert recorded <= used, f"recorded but used by no panel or alert: {recorded - used}"


# ------------------------------------------------------------------------------------ Prometheus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}" if params else f"{base}{path}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def _until(fn, what: str):
    return wait_until(fn, what, interval=0.5)


def test_prometheus_scrapes_triton_and_answers_a_custom_metric(traffic, triton_server, tmp_path):
    bin_dir = fetch_prometheus()
    target = urllib.parse.urlparse(triton_server.metrics_url).netloc
    # the committed config, pointed at this server and scraping every second (rendered, never edited in place)
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "triton"]
    job["static_configs"] = [{"targets": [target]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    check = subprocess.run([str(bin_dir / "promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([str(bin_dir / "prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _until(lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=5).status == 200, "Prometheus ready")
        _until(lambda: [r for r in _api(base, "/api/v1/query", query='up{job="triton"}')["result"]
                        if r["value"][1] == "1"], "the triton target up")
        name, labels = m.AUDIO_OUT.name, {"model": "cosyvoice_vc_stream", "version": "1"}
        direct = value(scrape(triton_server), name, **labels)
        assert direct > 0
        selector = f'{name}{{model="cosyvoice_vc_stream",version="1"}}'
        result = _until(lambda: _api(base, "/api/v1/query", query=selector)["result"], f"{selector} in Prometheus")
        assert len(result) == 1 and result[0]["metric"]["job"] == "triton"
        assert {k: result[0]["metric"][k] for k in labels} == labels
        assert float(result[0]["value"][1]) == pytest.approx(direct, rel=1e-9)
        # the rules load and evaluate without error, and the recording rules produce their series
        _, recorded = rule_exprs()

        def rules_ran():
            rules = [r for g in _api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
            bad = [(r["name"], r.get("lastError")) for r in rules if r.get("health") != "ok"]
            names = set(_api(base, "/api/v1/label/__name__/values"))
            return len(rules) == len(rule_exprs()[0]) and not bad and recorded <= names and rules

        rules = _until(rules_ran, "every rule evaluated with health ok and every recorded series present")
        assert {r["name"] for r in rules if r["type"] == "alerting"} >= {"TritonDown", "CosyVoiceSlowerThanRealTime"}
        assert not [r for r in rules if r["type"] == "alerting" and r["name"] == "TritonDown" and r["alerts"]]
    finally:
        stop_process(proc)
        log.close()


def test_promtool_checks_the_committed_config_and_rules():
    bin_dir = fetch_prometheus()
    promtool = str(bin_dir / "promtool")
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"],
                 ["test", "rules", "rules_test.yml"]):
        out = subprocess.run([promtool, *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"
        assert "SUCCESS" in out.stdout + out.stderr


def test_committed_dashboard_is_the_generators_output():
    mod = load_dashboard_module()
    assert mod.OUT.read_text() == mod.render(), "regenerate: python deploy/grafana/dashboard.py"
    assert np.all([p["datasource"]["uid"] == "${datasource}" for p in json.loads(mod.render())["panels"]
                   if p["type"] != "row"])
