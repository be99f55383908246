"""The Grafana dashboard of cosyvoice-triton, built with Grafana's own SDK (grafana-foundation-sdk, PyPI).

    python deploy/grafana/dashboard.py                 # writes deploy/grafana/cosyvoice-triton.json
    python deploy/grafana/dashboard.py --check         # exit 1 when the committed JSON differs from this script

Speech (the cosyvoice_* custom metrics of the Python stages) above Triton's own (nv_*: requests, queue and
compute time, pending requests, batch size, CPU). Import the JSON in Grafana (Dashboards > Import) and pick the
Prometheus data source that scrapes deploy/prometheus/prometheus.yml's targets. Every query is checked against
the metrics a live server exposes (tests/live/test_metrics_live.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh

OUT = Path(__file__).resolve().parent / "cosyvoice-triton.json"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
MODEL = 'model=~"$model"'
RATE = "$__rate_interval"


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DS)


def series(title: str, unit: str, description: str, *targets: prometheus.Dataquery, width: int = 12
           ) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DS).height(8)
             .span(width).min(0))
    for t in targets:
        panel = panel.with_target(t)
    return panel


def number(title: str, unit: str, description: str, expr: str) -> stat.Panel:
    return (stat.Panel().title(title).description(description).unit(unit).datasource(DS).height(4).span(6)
            .with_target(query(expr, title)))


def quantiles(metric: str) -> list[prometheus.Dataquery]:
    return [query(f"histogram_quantile({q}, sum by (model, version, le) (rate({metric}_bucket{{{MODEL}}}[{RATE}])))",
                  f"p{round(q * 100)} {{{{model}}}} v{{{{version}}}}") for q in (0.5, 0.9, 0.99)]


def per_request(metric_us: str) -> str:
    """Triton's cumulative microseconds of a phase, per successful request, in ms."""
    return (f"sum by (model, version) (rate({metric_us}{{{MODEL}}}[{RATE}])) / 1e3 / "
            f"sum by (model, version) (rate(nv_inference_request_success{{{MODEL}}}[{RATE}]))")


def build() -> dashboard.Dashboard:
    d = (dashboard.Dashboard("CosyVoice on Triton").uid("cosyvoice-triton").tags(["cosyvoice", "triton", "speech"])
         .time("now-1h", "now").refresh("30s").editable()
         .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
         .with_variable(dashboard.QueryVariable("model").label("Model").datasource(DS)
                        .query("label_values(nv_inference_request_success, model)")
                        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).multi(True).include_all(True)))

    d = (d.with_row(dashboard.Row("Speech"))
         .with_panel(number("Speech out", "s", "Seconds of audio answered per second, all pipelines (cosyvoice_tts "
                            "is served by cosyvoice_tts_stream, so only the latter is counted here).",
                            'sum(rate(cosyvoice_audio_out_seconds_total{model=~"postprocess|cosyvoice_vc_stream|'
                            f'cosyvoice_tts_stream"}}[{RATE}]))'))
         .with_panel(number("Real-time factor p90", "none", "Wall time per second of speech answered, p90 over the "
                            "streaming pipelines and cosyvoice_tts (above 1: slower than real time).",
                            "histogram_quantile(0.9, sum by (le) "
                            f"(rate(cosyvoice_real_time_factor_bucket[{RATE}])))"))
         .with_panel(number("First chunk p90", "s", "Start of a streamed request to its first audio chunk, p90.",
                            "histogram_quantile(0.9, sum by (le) "
                            f"(rate(cosyvoice_first_chunk_seconds_bucket[{RATE}])))"))
         .with_panel(number("Rejects", "reqps", "Requests answered with an error per second, every model and reason "
                            "(a rejected ensemble request is counted by the stage that refused it).",
                            f"sum(rate(cosyvoice_rejects_total[{RATE}]))"))
         .with_panel(series("Audio out", "s", "Seconds of audio answered per second, by model.",
                            query("sum by (model, version) "
                                  f"(rate(cosyvoice_audio_out_seconds_total{{{MODEL}}}[{RATE}]))",
                                  "{{model}} v{{version}}")))
         .with_panel(series("Audio in", "s", "Seconds of source / prompt audio of the requests served, per second.",
                            query("sum by (model, version, input) "
                                  f"(rate(cosyvoice_audio_in_seconds_total{{{MODEL}}}[{RATE}]))",
                                  "{{model}} v{{version}} {{input}}")))
         .with_panel(series("Real-time factor", "none", "Wall time per second of speech, per request; cosyvoice_vc "
                            "(an ensemble): Triton's request time over postprocess's audio out.",
                            *quantiles("cosyvoice_real_time_factor"),
                            query("cosyvoice:vc_real_time_factor:ratio_rate5m", "cosyvoice_vc (mean, 5m)")))
         .with_panel(series("First-chunk latency", "s", "Start of a streamed request to its first audio chunk.",
                            *quantiles("cosyvoice_first_chunk_seconds")))
         .with_panel(series("Rejects by reason", "reqps", "Requests answered with an error: bad_* the client's "
                            "input, busy a full queue, cancelled the client went away, internal the server's fault.",
                            query(f"sum by (model, reason) (rate(cosyvoice_rejects_total{{{MODEL}}}[{RATE}])) > 0",
                                  "{{model}} {{reason}}")))
         .with_panel(series("TTS LM engine", "short", "cosyvoice_tts_stream's in-flight LM batch: rows decoding "
                            "and requests waiting for a row.",
                            query('sum by (model, what) (cosyvoice_llm{what=~"active|waiting"})',
                                  "{{model}} {{what}}")))
         .with_panel(series("Graph fallbacks", "reqps", "Graph requests whose call failed for a reason not their "
                            "input's (engine error, out of memory) and ran once more on the fallback graph (the "
                            "export's fp32 graph, or the CPU): served, or failed there too. Local flavor only.",
                            query("sum by (model, version, outcome) "
                                  f"(rate(cosyvoice_fallbacks_total{{{MODEL}}}[{RATE}]))",
                                  "{{model}} v{{version}} {{outcome}}"))))

    d = (d.with_row(dashboard.Row("Triton"))
         .with_panel(series("Requests", "reqps", "Triton's successful and failed requests per second.",
                            query(f"sum by (model, version) (rate(nv_inference_request_success{{{MODEL}}}[{RATE}]))",
                                  "{{model}} v{{version}} ok"),
                            query(f"sum by (model, version) (rate(nv_inference_request_failure{{{MODEL}}}[{RATE}]))",
                                  "{{model}} v{{version}} failed")))
         .with_panel(series("Queue time per request", "ms", "Time requests wait in Triton's scheduler queue.",
                            query(per_request("nv_inference_queue_duration_us"), "{{model}} v{{version}}")))
         .with_panel(series("Compute time per request", "ms", "Triton's compute time (input, infer, output).",
                            *[query(per_request(f"nv_inference_compute_{phase}_duration_us"),
                                    "{{model}} v{{version}} " + phase) for phase in ("input", "infer", "output")]))
         .with_panel(series("Pending requests", "short", "Requests queued or running in Triton, by model.",
                            query(f"sum by (model, version) (nv_inference_pending_request_count{{{MODEL}}})",
                                  "{{model}} v{{version}}")))
         .with_panel(series("Batch size", "short", "Inferences per model execution (dynamic batching at work).",
                            query(f"sum by (model, version) (rate(nv_inference_count{{{MODEL}}}[{RATE}])) / "
                                  f"sum by (model, version) (rate(nv_inference_exec_count{{{MODEL}}}[{RATE}]))",
                                  "{{model}} v{{version}}")))
         .with_panel(series("Host CPU and memory", "percentunit", "Triton's view of the host.",
                            query("nv_cpu_utilization", "CPU {{instance}}"),
                            query("nv_cpu_memory_used_bytes / nv_cpu_memory_total_bytes", "memory {{instance}}"))))
    return d


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = ap.parse_args(argv)
    text = render()
    json.loads(text)
    if args.check:
        same = args.out.is_file() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from deploy/grafana/dashboard.py: regenerate it'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
